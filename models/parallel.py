"""Tensor parallelism (Megatron style): the process group a model's shards talk over, and the
shapes each rank holds.

With ``size`` ranks, every decoder layer is split so that each rank computes a slice of the
heads and of the MLP and only two collectives per layer join them::

    QKV (column-parallel: this rank's q heads / size, kv heads / size)
      -> attention of this rank's heads (its own KV cache of kv heads / size)
      -> O (row-parallel: this rank's q_size / size input columns) -> all-reduce (+ bias once)
    gate/up (column-parallel: intermediate / size rows each) -> SiLU-and-mul
      -> down (row-parallel: intermediate / size input columns) -> all-reduce (+ bias once)

The embedding table and the LM head are split by vocabulary rows: a rank embeds the ids of
its rows (the others are zero) and an all-reduce sums the ranks' rows; each rank computes the
logits of its vocabulary rows and an all-gather joins them. Norms, rotary tables and the
residual stream are replicated. With ``size`` 1 (no group) every collective is skipped and the
model runs exactly as an unsplit one.

Work that runs concurrently with the iterations on a stream of its own (the host batches of
the async host pipeline) issues its collectives over a second group of the same ranks
(``side_group``, entered with ``on_side_group``). NCCL runs all collectives of one group on one
stream per device in the order they were issued, so collectives of two concurrent streams in one
group would queue behind each other: an iteration's all-reduce would wait for a host batch's,
which waits for that batch's host attention. In a group of their own, each stream's collectives
keep their own order on every rank, and neither waits for the other.

This module imports nothing from the engine: the caller passes a ``torch.distributed`` group
(NCCL on GPUs, gloo on the CPU) or None.
"""

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import ModelConfig


class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``.

    group: a ``torch.distributed`` process group of the ranks that share one model (the
    default group when ``dist.group.WORLD`` is passed), or None for a model on one rank.
    side_group: a second group of the same ranks, for collectives queued on a stream that runs
    concurrently with the iterations' (``on_side_group``); None: ``group`` serves both.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, side_group: dist.ProcessGroup | None = None):
        self.group = group
        self.side_group = side_group if side_group is not None else group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if side_group is not None and (dist.get_world_size(side_group), dist.get_rank(side_group)) != (
                self.size, self.rank):
            raise ValueError(f"the side group must hold the same ranks as the group: rank {self.rank} of "
                             f"{self.size}, but rank {dist.get_rank(side_group)} of "
                             f"{dist.get_world_size(side_group)} there")

    @contextmanager
    def on_side_group(self):
        """Within the block, every collective goes over ``side_group``. Collectives are issued
        by one thread, so the switch is seen only by the work queued inside the block."""
        group, self.group = self.group, self.side_group
        try:
            yield
        finally:
            self.group = group

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` over the ranks in place (``op``: a sum unless told; nothing on one
        rank); returns it."""
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def broadcast_from_driver(self, tensor: torch.Tensor) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank 0's, in place (nothing on one rank);
        returns it."""
        if self.size > 1:
            dist.broadcast(tensor, group=self.group, group_src=0)
        return tensor

    def row_parallel_linear(self, input: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel linear layer: ``input [T, in / size]`` (this rank's input features)
        times ``weight [out, in / size]`` (this rank's columns), summed over the ranks, plus
        ``bias [out]`` once -> ``[T, out]``. On one rank it is ``F.linear(input, weight, bias)``."""
        if self.size == 1:
            return F.linear(input, weight, bias)
        output = self.all_reduce(F.linear(input, weight))
        return output if bias is None else output.add_(bias)

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's ``[N, C]`` -> ``[N, size * C]``: the ranks' columns side by side in rank
        order (``tensor`` itself on one rank)."""
        if self.size == 1:
            return tensor
        pieces = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        return torch.cat(pieces, dim=1)


def _common_divisors(numbers: list[int]) -> list[int]:
    return [size for size in range(1, min(numbers) + 1) if all(number % size == 0 for number in numbers)]


def check_divisible(config: ModelConfig, size: int) -> None:
    """A ``ValueError`` naming the model's sizes and the rank counts that would work unless
    ``size`` divides its attention heads, KV heads, intermediate size and vocabulary."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    sizes = {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    indivisible = [f"{name} {value}" for name, value in sizes.items() if value % size]
    if indivisible:
        working = ", ".join(str(number) for number in _common_divisors(list(sizes.values())))
        raise ValueError(f"tensor_parallel_size {size} does not divide {' and '.join(indivisible)} of "
                         f"{config.name or config.architecture} (num_attention_heads {config.num_heads}, "
                         f"num_key_value_heads {config.num_kv_heads}, intermediate_size "
                         f"{config.intermediate_size}, vocab_size {config.vocab_size}); sizes that "
                         f"work: {working}")


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one of ``size`` ranks holds: ``config`` with the attention heads, KV heads,
    intermediate size and vocabulary divided by ``size`` (``config`` itself for one rank).
    ``hidden_size``, ``head_dim`` and everything else stay."""
    check_divisible(config, size)
    if size == 1:
        return config
    return replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                   intermediate_size=config.intermediate_size // size,
                   vocab_size=config.vocab_size // size)
