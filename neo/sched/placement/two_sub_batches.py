"""``TwoSubBatches``: host decodes in the lockstep pipeline's two sub-batches::

    batch 0: prefills + GPU decodes (+ a few host decodes)
    batch 1: host decodes

The two go through the layers in the engine's two-sub-batch stage order (``asymmetric`` by
default: per layer the GPU runs one sub-batch's linear stages while the host attends for the
other), costed by ``neo.sched.cost``; a decode-only iteration, which the runner
replays from a pipeline CUDA graph, with the graph's launch overhead. Host requests are taken
oldest first (round robin); each goes to the sub-batch where the estimated iteration time grows
least, and ``neo`` keeps the number of them that gives the highest estimated tokens per second,
zero meaning the GPU-only plan (batch 0 alone). With a negligible launch overhead that is where
host attention just stays hidden; a large fixed cost per pipelined iteration makes larger host
batches pay. While host decodes are judged not to pay and none is due, an iteration without
prefills runs the GPU alone without placing any (prefills can hide a few host decodes, so
iterations with them still place). ``full-offload`` decodes every host request every
iteration, split between the sub-batches to balance them.

Whether host decodes pay (``economics``) is judged on a steady decode iteration
(``Estimates.steady_gpu_batch``) with the host requests as batch 1: they pay when that makes
more estimated tokens per second than batch 0 alone, and more would pay when adding requests
like the oldest waiting one raises it further.
"""

from dataclasses import dataclass, field

from neo.request import Request

from ..estimates import NO_GPU_WORK, GpuWork
from ..scheduler_output import SchedulerOutput, SubBatch
from ..stage_order import SEQUENTIAL
from .base import Placement

EPSILON = 1e-9  # seconds: keeps rates finite under a zero perf model


@dataclass
class _Sides:
    """Host decodes placed so far in each sub-batch, with their context tokens."""

    batch0: list[Request] = field(default_factory=list)
    batch1: list[Request] = field(default_factory=list)
    context0: int = 0
    context1: int = 0

    def sizes(self, add_to: int | None = None, tokens: int = 0) -> tuple[int, int, int, int]:
        """(requests0, context0, requests1, context1), optionally with one more request."""
        requests0, context0 = len(self.batch0), self.context0
        requests1, context1 = len(self.batch1), self.context1
        if add_to == 0:
            requests0, context0 = requests0 + 1, context0 + tokens
        elif add_to == 1:
            requests1, context1 = requests1 + 1, context1 + tokens
        return requests0, context0, requests1, context1

    def add(self, side: int, request: Request) -> None:
        if side == 0:
            self.batch0.append(request)
            self.context0 += request.num_tokens
        else:
            self.batch1.append(request)
            self.context1 += request.num_tokens


class TwoSubBatches(Placement):
    def place(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> None:
        estimates = scheduler.estimates
        batch1 = self._place_host_decodes(scheduler, batch0, host_requests)
        plan.sub_batches = [batch for batch in (batch0, batch1) if batch]
        plan.stage_order = estimates.two_sub_batch_order if len(plan.sub_batches) == 2 else SEQUENTIAL
        plan.predicted_time, plan.predicted_host_time = estimates.plan_time(plan)
        plan.profiled_host_time = plan.predicted_host_time / estimates.host_calibration.scale

    def _place_host_decodes(self, scheduler, batch0: SubBatch, host_requests: list[Request]) -> SubBatch:
        """Choose how many host requests decode (oldest first, round robin) and in which
        sub-batch each goes, by estimated tokens per second."""
        estimates = scheduler.estimates
        batch1 = SubBatch()
        ordered = scheduler.oldest_first(host_requests)
        if not ordered:
            scheduler.count_host_wait(False)
            return batch1
        must_decode = scheduler.host_decode_due and (scheduler.host_decodes_pay
                                                     or any(map(scheduler.never_fits_gpu, ordered)))
        if not (self.full_offload or scheduler.host_decodes_pay or must_decode or batch0.prefills or not batch0):
            # A decode iteration of the kind just judged not to pay host decodes: GPU alone.
            scheduler.count_host_wait(True)
            return batch1
        sides = _Sides()
        work0 = estimates.gpu_work(batch0)
        graphed = estimates.replays_pipeline_graph(batch0)
        base_tokens = len(batch0.prefills) + len(batch0.gpu_decodes)
        best_count = 0
        best_rate = (base_tokens / (estimates.sequential_time(batch0, work0) + EPSILON)
                     if base_tokens else -1.0)
        for count, request in enumerate(ordered, start=1):
            rate = (base_tokens + count) / (self._add(estimates, work0, sides, request, graphed) + EPSILON)
            if rate > best_rate or (must_decode and best_count == 0):
                best_count, best_rate = count, rate
        if self.full_offload:
            best_count = len(ordered)
        chosen = {id(request) for request in ordered[:best_count]}
        batch0.host_decodes.extend(r for r in sides.batch0 if id(r) in chosen)
        batch1.host_decodes.extend(r for r in sides.batch1 if id(r) in chosen)
        scheduler.count_host_wait(best_count == 0)
        return batch1

    @staticmethod
    def _add(estimates, work0: GpuWork, sides: _Sides, request: Request, graphed: bool) -> float:
        """Put one more host decode in the sub-batch where the estimated iteration time grows
        least (ties, e.g. with a zero perf model, keep about a third of them in batch 0).
        Returns the estimated iteration time with it (``graphed``: replayed from a graph)."""
        best = None
        for side in (1, 0):
            requests0, context0, requests1, context1 = sides.sizes(add_to=side, tokens=request.num_tokens)
            balance = 0 if (side == 1) == (2 * len(sides.batch0) >= len(sides.batch1)) else 1
            times = [estimates.sub_batch_times(work0, requests0, estimates.host_attention(requests0, context0)),
                     estimates.sub_batch_times(NO_GPU_WORK, requests1, estimates.host_attention(requests1, context1))]
            seconds = estimates.two_sub_batch_time(times, graphed)
            candidate = (seconds, balance, side)
            best = candidate if best is None or candidate < best else best
        sides.add(best[2], request)
        return best[0]

    def economics(self, scheduler, gpu_requests: list[Request], host_requests: list[Request]) -> tuple[bool, bool]:
        estimates = scheduler.estimates
        steady = estimates.steady_gpu_batch(gpu_requests, host_requests, scheduler.waiting[0] if scheduler.waiting else None)
        gpu_rate = steady.count / (steady.alone_time + EPSILON) if steady.count else -1.0
        host_context = sum(r.num_tokens for r in host_requests)

        def rate(requests: int, context: int) -> float:
            host = estimates.sub_batch_times(NO_GPU_WORK, requests, estimates.host_attention(requests, context))
            seconds = estimates.two_sub_batch_time([steady.stage_times, host], steady.pipeline_graphed)
            return (steady.count + requests) / (seconds + EPSILON)

        current = rate(len(host_requests), host_context) if host_requests else -1.0
        more = [rate(len(host_requests) + extra, host_context + context) for extra, context in scheduler.extra_requests()]
        best_more = max(more, default=-1.0)
        return max(current, best_more) > gpu_rate, best_more > max(current, gpu_rate)
