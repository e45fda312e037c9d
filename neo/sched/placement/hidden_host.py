"""``HiddenHost``: an example placement, the NEO paper's rule. Host decodes join the lockstep
pipeline's two sub-batches only while their attention stays hidden under the GPU's work: each
host request, oldest first, goes to a sub-batch where the iteration's estimated time stays the
time of its GPU work (the host never holds the GPU up), the one where it grows least (the host
sub-batch on a tie); when it fits in neither, the placement stops. Every request that overflows the GPU
pool is admitted to the host pool.

It is a complete placement in one file: ``place`` builds the plan with the scheduler's shared
rules (fairness order, the host-wait counter, the estimates) and the cost function of the
engine's two-sub-batch stage order; ``economics`` says host decodes always pay, so the host pool
takes the overflow. Select it with ``EngineConfig(placement="hidden-host",
host_pipeline="lockstep")``.
"""

from neo.request import Request

from ..estimates import NO_GPU_WORK
from ..scheduler_output import SchedulerOutput, SubBatch
from ..stage_order import SEQUENTIAL
from .base import Placement

TOLERANCE = 1e-9  # seconds of slack when comparing an iteration with its GPU work alone


class HiddenHost(Placement):
    def place(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> None:
        estimates = scheduler.estimates
        work0 = estimates.gpu_work(batch0)
        graphed = estimates.replays_pipeline_graph(batch0)

        def seconds(side0: list[Request], side1: list[Request], host: bool = True) -> float:
            """The iteration with these host decodes in sub-batch 0 and 1 (``host``: with
            their host attention; without, the GPU's work alone)."""
            def attention(side: list[Request]) -> float:
                return estimates.host_attention(len(side), sum(r.num_tokens for r in side)) if host else 0.0

            times = [estimates.sub_batch_times(work0, len(side0), attention(side0)),
                     estimates.sub_batch_times(NO_GPU_WORK, len(side1), attention(side1))]
            return estimates.two_sub_batch_time(times, graphed)

        take_all = self.full_offload or not batch0  # no GPU work to hide under: every one decodes
        side0, side1 = batch0.host_decodes, []
        for request in scheduler.oldest_first(host_requests):
            # The host sub-batch first: on a tie the request goes there.
            options = [(side0, side1 + [request]), (side0 + [request], side1)]
            hidden = [sides for sides in options if seconds(*sides) <= seconds(*sides, host=False) + TOLERANCE]
            overdue = scheduler.host_decode_due and not (side0 or side1)  # the oldest decodes anyway
            if not (hidden or take_all or overdue):
                break
            side0, side1 = min(hidden or options, key=lambda sides: seconds(*sides))
        scheduler.count_host_wait(bool(host_requests) and not (side0 or side1))
        batch0.host_decodes = side0
        plan.sub_batches = [batch for batch in (batch0, SubBatch(host_decodes=side1)) if batch]
        plan.stage_order = estimates.two_sub_batch_order if len(plan.sub_batches) == 2 else SEQUENTIAL
        plan.predicted_time, plan.predicted_host_time = estimates.plan_time(plan)
        plan.profiled_host_time = plan.predicted_host_time / estimates.host_calibration.scale

    def economics(self, scheduler, gpu_requests: list[Request], host_requests: list[Request]) -> tuple[bool, bool]:
        """Host decodes always pay here (only hidden ones run), so the host pool takes the
        overflow."""
        return True, True
