"""Host failures across tensor-parallel ranks.

A host function that fails on a rank (the stream-ordered hand-off, ``neo.runner.host_attention``)
records the failure and skips its later layers' attention, while the rank's collectives run on:
the other ranks cannot see it, and the driver would sample from that rank's stale attention
rows. So after every piece of work that touched the host pool (an iteration with host decodes,
prefills into the host pool or swaps; a host batch), every rank max-reduces its failure flag at
the same point, and the driver reads the result with its tokens and discards them when another
rank's host work failed.
"""

import torch
import torch.distributed as dist

from .executor import PipelineExecutor

OTHER_RANK_HOST_FAILURE = "host decode attention failed on another tensor-parallel rank"


def reduce_host_failures(model, executor: PipelineExecutor) -> torch.Tensor | None:
    """Above one rank: the ranks' host failure flags (``PipelineExecutor.host_failure_flag``),
    max-reduced, uint8 ``[1]`` on the device, queued on the current stream; None on one rank.
    Every rank calls it at the same point of the same work."""
    if model.parallel.size == 1:
        return None
    return model.parallel.all_reduce(executor.host_failure_flag(), op=dist.ReduceOp.MAX)


def raise_other_rank_failure(host_failures: torch.Tensor | None) -> None:
    """The driver, once its tokens are read and its own host failure raised: raise if another
    rank's host work failed."""
    if host_failures is not None and host_failures.item():
        raise RuntimeError(OTHER_RANK_HOST_FAILURE)
