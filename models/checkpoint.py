"""Where a Hugging Face checkpoint tensor goes in neo's (partly fused) parameters.

A checkpoint stores ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``, ``up_proj``) as
separate tensors; neo's layers hold each group as one fused parameter whose rows are the pieces
stacked in order. A ``CheckpointTarget`` names the rows of one parameter a checkpoint tensor
fills. Each layer class lists its own targets (``checkpoint_targets``), so a family whose layer
holds other weights names them next to the parameters themselves.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckpointTarget:
    """Rows ``[row_start, row_start + shape[0])`` of ``parameter``, which one checkpoint tensor
    of ``shape`` fills."""

    parameter: torch.nn.Parameter
    row_start: int
    shape: tuple[int, ...]

    def destination(self) -> torch.Tensor:
        return self.parameter.narrow(0, self.row_start, self.shape[0])


def whole(parameter: torch.nn.Parameter) -> CheckpointTarget:
    """The target of a checkpoint tensor that fills all of ``parameter``."""
    return CheckpointTarget(parameter, 0, tuple(parameter.shape))


def row_pieces(parameter: torch.nn.Parameter, prefix: str, suffix: str,
               pieces: list[tuple[str, int]]) -> dict[str, CheckpointTarget]:
    """Targets of the stacked pieces of a fused ``parameter``.

    pieces: ``(name, rows)`` in row order; piece ``name`` is the checkpoint tensor
    ``f"{prefix}{name}.{suffix}"``.
    """
    targets, start = {}, 0
    for piece, rows in pieces:
        targets[f"{prefix}{piece}.{suffix}"] = CheckpointTarget(
            parameter, start, (rows,) + tuple(parameter.shape[1:]))
        start += rows
    return targets
