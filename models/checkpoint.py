"""Where a Hugging Face checkpoint tensor goes in neo's (partly fused) parameters.

A checkpoint stores ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``, ``up_proj``) as
separate tensors; neo's layers hold each group as one fused parameter whose rows are the pieces
stacked in order. A ``CheckpointTarget`` names the rows of one parameter a checkpoint tensor
fills. Each layer class lists its own targets (``checkpoint_targets``), so a family whose layer
holds other weights names them next to the parameters themselves.

Under tensor parallelism (``parallel.py``) a rank holds one equal part of a checkpoint tensor:
its rows (column-parallel weights, their biases, vocabulary rows) or its columns
(row-parallel weights). The target then names that part too (``shard_dim``, ``shard_index`` of
``num_shards``), so a loader reads only the part (a safetensors slice) and a fused parameter
of a rank stacks the rank's part of each piece: ``[q_r | k_r | v_r]``.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CheckpointTarget:
    """Rows ``[row_start, row_start + part_shape[0])`` of ``parameter``, which this rank's part
    of one checkpoint tensor of ``shape`` fills.

    shard_dim: the dimension of the checkpoint tensor split between ranks (0: rows, 1:
    columns), None when every rank holds all of it; the rank holds part ``shard_index`` of
    ``num_shards`` equal parts along it.
    """

    parameter: torch.nn.Parameter
    row_start: int
    shape: tuple[int, ...]
    shard_dim: int | None = None
    shard_index: int = 0
    num_shards: int = 1

    @property
    def part_shape(self) -> tuple[int, ...]:
        """The shape of this rank's part (``shape`` when the tensor is not split)."""
        if self.shard_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.shard_dim] //= self.num_shards
        return tuple(shape)

    def part_index(self) -> tuple[slice, ...]:
        """The index of this rank's part in the checkpoint tensor (for a tensor or a
        safetensors slice)."""
        if self.shard_dim is None:
            return (slice(None),)
        length = self.part_shape[self.shard_dim]
        start = self.shard_index * length
        return (slice(None),) * self.shard_dim + (slice(start, start + length),)

    def destination(self) -> torch.Tensor:
        return self.parameter.narrow(0, self.row_start, self.part_shape[0])


def whole(parameter: torch.nn.Parameter) -> CheckpointTarget:
    """The target of a checkpoint tensor that fills all of ``parameter``."""
    return CheckpointTarget(parameter, 0, tuple(parameter.shape))


def split(parameter: torch.nn.Parameter, dim: int, shard_index: int, num_shards: int) -> CheckpointTarget:
    """The target of a checkpoint tensor split along ``dim`` into ``num_shards`` parts, of which
    ``parameter`` holds part ``shard_index`` (``whole`` when ``num_shards`` is 1)."""
    if num_shards == 1:
        return whole(parameter)
    shape = list(parameter.shape)
    shape[dim] *= num_shards
    return CheckpointTarget(parameter, 0, tuple(shape), dim, shard_index, num_shards)


def row_pieces(parameter: torch.nn.Parameter, prefix: str, suffix: str,
               pieces: list[tuple[str, int]], shard_index: int = 0,
               num_shards: int = 1) -> dict[str, CheckpointTarget]:
    """Targets of the stacked pieces of a fused ``parameter``.

    pieces: ``(name, rows)`` in row order, the rows ``parameter`` holds of each; piece ``name``
    is the checkpoint tensor ``f"{prefix}{name}.{suffix}"``. With ``num_shards`` > 1 each piece
    is split by rows and ``parameter`` holds part ``shard_index`` of every piece.
    """
    targets, start = {}, 0
    shard_dim = None if num_shards == 1 else 0
    for piece, rows in pieces:
        targets[f"{prefix}{piece}.{suffix}"] = CheckpointTarget(
            parameter, start, (rows * num_shards,) + tuple(parameter.shape[1:]), shard_dim, shard_index,
            num_shards)
        start += rows
    return targets
