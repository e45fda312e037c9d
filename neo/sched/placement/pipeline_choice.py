"""``PipelineChoice``: each iteration, the host pipeline whose plan makes the most tokens per
second (``EngineConfig.host_pipeline="auto"``).

The candidates are the plans of the two other placements for the same slots, prefills and
returns (the scheduler core has made them):

- lockstep (``TwoSubBatches``): host decodes in the two sub-batches, as many as raise the
  estimated tokens per second; zero of them is the gpu-only plan (batch 0 alone). Its rate is
  the plan's tokens over its estimated seconds (the cost function of the two-sub-batch order).
- async (``HostBatches``): batch 0 alone on the GPU, and a host batch of the host requests
  launched beside it, when that placement would launch one. Its rate is that of the host
  batch's span ``T`` (the cost function of the ``host-batch`` order): the GPU goes on at
  batch 0's rate ``r`` except for the time the batch costs it (``HostBatches.gpu_cost``), and
  the batch adds its ``n`` tokens: ``r + (n - r * cost) / T``. Without GPU work, ``n / T``.

The plan with the higher rate runs (a tie goes to async). Both are estimated from the same
``Estimates`` and perf model the placements use on their own, the GPU's iterations at the
profile's times on both sides: the correction the async placement applies to its decode
iterations alone (``Estimates.corrected_sequential_time``) has no counterpart for the GPU
stages of lockstep's two-sub-batch plans, which nothing measures.

The rule that keeps the two kinds of iteration apart: **no lockstep iteration while a host
batch is in flight.** While one is, the host's attention threads are busy with it and its
requests are out of planning, so every iteration until it completes is planned by
``HostBatches`` (the GPU's work alone, estimated with the measured slowdown beside a batch);
the choice is made again in the first iteration after it completes. A lockstep iteration's
host decodes therefore never share the host with a host batch, and a request is never in a
host batch and a sub-batch at once.
"""

from neo.request import Request

from ..runner_output import HostBatchOutput, IterationOutput
from ..scheduler_output import SchedulerOutput, SubBatch
from .base import Placement
from .host_batches import EPSILON, HostBatches, InFlightHostBatch
from .two_sub_batches import TwoSubBatches


class PipelineChoice(Placement):
    def __init__(self, full_offload: bool = False):
        super().__init__(full_offload)
        self.lockstep = TwoSubBatches(full_offload)
        self.asynchronous = HostBatches(full_offload)
        self._planned_by: Placement = self.asynchronous  # the placement of the last plan

    # -- host batches in flight: the async placement's ------------------------------------------

    @property
    def in_flight(self) -> InFlightHostBatch | None:
        return self.asynchronous.in_flight

    @property
    def host_batch_in_flight(self) -> bool:
        return self.asynchronous.host_batch_in_flight

    @property
    def in_flight_requests(self) -> list[Request]:
        return self.asynchronous.in_flight_requests

    def plannable(self, running: list[Request]) -> list[Request]:
        return self.asynchronous.plannable(running)

    def defer_abort(self, request: Request) -> bool:
        return self.asynchronous.defer_abort(request)

    def host_batch_done(self, scheduler, output: HostBatchOutput | None) -> list[Request]:
        return self.asynchronous.host_batch_done(scheduler, output)

    def observe(self, scheduler, plan: SchedulerOutput, output: IterationOutput) -> None:
        self._planned_by.observe(scheduler, plan, output)

    def measured_corrections(self, scheduler) -> tuple:
        return self.asynchronous.measured_corrections(scheduler)

    # -- the choice ----------------------------------------------------------------------------

    def place(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> None:
        self._planned_by = self.choose(scheduler, batch0, host_requests, plan)
        self._planned_by.place(scheduler, batch0, host_requests, plan)
        if self._planned_by is self.lockstep:  # a host batch launched next runs beside its prefills
            self.asynchronous.note_prefills(batch0)

    def choose(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> Placement:
        """The placement whose plan for these inputs makes more estimated tokens per second
        (see the module docstring). Changes nothing."""
        if self.asynchronous.in_flight is not None or not host_requests:
            return self.asynchronous
        lockstep_plan = self._lockstep_trial(scheduler, batch0, host_requests, plan)
        if not any(batch.host_decodes for batch in lockstep_plan.sub_batches):
            return self.asynchronous
        lockstep_rate = len(lockstep_plan.requests) / (lockstep_plan.predicted_time + EPSILON)
        return self.lockstep if lockstep_rate > self.async_rate(scheduler, batch0, host_requests, plan) \
            else self.asynchronous

    def async_rate(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> float:
        """Estimated tokens per second of the async plan: batch 0 alone, and the host batch
        ``HostBatches`` would launch beside it, over that batch's span."""
        estimates = scheduler.estimates
        gpu_tokens = len(batch0.prefills) + len(batch0.gpu_decodes)
        gpu_rate = gpu_tokens / (estimates.sequential_time(batch0) + EPSILON) if batch0 else 0.0
        requests = self.asynchronous.host_batch_candidate(scheduler, batch0, host_requests, plan)
        if not requests:
            return gpu_rate
        seconds, _ = estimates.host_batch_time(requests)
        cost = self.asynchronous.gpu_cost(estimates, len(requests), sum(r.num_tokens for r in requests))
        return gpu_rate + (len(requests) - gpu_rate * cost) / (seconds + EPSILON)

    def _lockstep_trial(self, scheduler, batch0: SubBatch, host_requests: list[Request],
                        plan: SchedulerOutput) -> SchedulerOutput:
        """The lockstep placement's plan for these inputs, made on copies (the scheduler's
        count of iterations host requests waited is left as it was)."""
        trial_batch0 = SubBatch(list(batch0.prefills), list(batch0.gpu_decodes), list(batch0.host_decodes))
        trial = SchedulerOutput(swap_out=plan.swap_out, swap_in=plan.swap_in)
        waited = scheduler.iterations_without_host_decode
        self.lockstep.place(scheduler, trial_batch0, host_requests, trial)
        scheduler.iterations_without_host_decode = waited
        return trial

    def economics(self, scheduler, gpu_requests: list[Request], host_requests: list[Request]) -> tuple[bool, bool]:
        """Host decodes pay when they pay under either pipeline, and more of them would pay
        when more would under either: each iteration runs the better of the two."""
        lockstep_pay, lockstep_more = self.lockstep.economics(scheduler, gpu_requests, host_requests)
        async_pay, async_more = self.asynchronous.economics(scheduler, gpu_requests, host_requests)
        return lockstep_pay or async_pay, lockstep_more or async_more
