"""What the driver rank sends the other tensor-parallel ranks each iteration, and the channel.

The scheduler runs once, on rank 0 (the driver). Before its runner executes a plan, it
broadcasts a ``RankPlan``: per sub-batch, a ``PlannedRequest`` per request with exactly what
``build_batch_inputs`` reads (token ids, block table, KV location), plus the swaps and the stage
order. Every rank's runner then builds the same inputs, walks the same stage order over its own
shard and KV heads, and meets the others in the model's collectives in the same order. Block
tables are the same on every rank (one block manager), so the pools of all ranks hold the same
number of blocks. Sampling stays on the driver: the sampled tokens reach the other ranks as the
next plan's decode inputs.

Messages are ``(kind, payload)``: ``("execute", planned(plan))`` before an iteration,
``("launch", planned_sub_batch(host_batch))`` before a host batch of the async host pipeline is
launched, ``("profile", None)`` before the driver profiles stage times (every rank then runs its
own profiler in lockstep: the model's collectives join their measurements); ``None`` tells the
others to stop. The channel is a gloo group of its own (``PlanChannel``):
``broadcast_object_list`` pickles the message on rank 0 and unpickles it on the others.
"""

from dataclasses import dataclass

import torch.distributed as dist

from neo.request import KVLocation, Request
from neo.sched.scheduler_output import SchedulerOutput, SubBatch


@dataclass
class PlannedRequest:
    """The part of a ``Request`` a rank needs to lay out its tokens (``build_batch_inputs``):
    ``all_token_ids`` is filled for prefills only (decodes read ``last_token_id``)."""

    num_tokens: int
    block_table: list[int]
    location: KVLocation
    last_token_id: int
    all_token_ids: list[int]

    @classmethod
    def of(cls, request: Request, prefill: bool) -> "PlannedRequest":
        return cls(request.num_tokens, list(request.block_table), request.location, request.last_token_id,
                   list(request.all_token_ids) if prefill else [])


def planned_sub_batch(batch: SubBatch) -> SubBatch:
    """``batch`` with every request replaced by its ``PlannedRequest``."""
    return SubBatch(prefills=[PlannedRequest.of(request, True) for request in batch.prefills],
                    gpu_decodes=[PlannedRequest.of(request, False) for request in batch.gpu_decodes],
                    host_decodes=[PlannedRequest.of(request, False) for request in batch.host_decodes])


def planned(plan: SchedulerOutput) -> SchedulerOutput:
    """The parts of ``plan`` the other ranks execute: sub-batches of ``PlannedRequest``s, the
    host batch likewise, the swaps and the stage order (no estimates, no finished requests)."""
    return SchedulerOutput(sub_batches=[planned_sub_batch(batch) for batch in plan.sub_batches],
                           stage_order=plan.stage_order,
                           host_batch=None if plan.host_batch is None else planned_sub_batch(plan.host_batch),
                           swap_out=list(plan.swap_out), swap_in=list(plan.swap_in))


class PlanChannel:
    """Rank 0 -> every other rank, over its own gloo group (``group``: made by every rank with
    ``dist.new_group(backend="gloo")``)."""

    def __init__(self, group: dist.ProcessGroup, rank: int):
        self.group = group
        self.rank = rank

    def send(self, message) -> None:
        """Rank 0: hand ``message`` (picklable; None: stop) to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self):
        """Ranks 1..N-1: the next message of rank 0 (blocks until it comes)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
