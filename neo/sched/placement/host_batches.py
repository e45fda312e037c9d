"""``HostBatches``: host decodes as host batches of the async host pipeline.

Each iteration is one sub-batch for the GPU (prefills and GPU decodes), and the host decodes
run as a host batch of their own beside the GPU's iterations (``neo.runner.host_batches``), one
batch in flight at a time, in the ``host-batch`` stage order on a stream of its own. When none
is in flight, every host request that got its slot joins the next one; requests in flight are
left out of planning until their batch completes (``host_batch_done``), and an abort of one of
them frees its blocks only then. A batch that completes between two plans (under async
scheduling, while the engine waits for an iteration's tokens) is followed at once by the batch
the next plan would launch, where nothing else that plan decides could change it
(``Scheduler.schedule_host_batch``, ``place_host_batch``): the host does not wait a step. A
request evicted to the host pool joins a batch launched after the iteration that copies its
blocks out.

Whether host decodes pay: the GPU never waits for a host batch's attention, but the batch costs
the GPU's own iterations time: its ``pre``/``post`` stages read all the weights once per
sub-batch of its order (the sum over the halves in ``host-batch-pair``:
``Estimates.host_batch_gpu_time``; a sub-batch the batch's graphs replay costs what a decode
graph of as many rows does, one launched stage by stage ``linear(n)``), and beside it the iterations
may run slower still (its kernels share the SMs, its host threads share the host with the
launching thread). That slowdown is measured (``HostBatchInterference``: iterations beside a
batch against their estimate alone): a batch that lasts ``T`` seconds with the iterations ``s``
times slower costs them ``(1 - 1/s) * T`` seconds. Before anything is measured it costs its GPU
stages' time, as if they ran in the GPU's iterations; once measured, that cost is not a floor:
the stages run on a stream of their own, in the gaps of the GPU's iterations, and the measured
slowdown is what the iterations lost (it can be less than the stages' time). In that time a
steady GPU iteration (``Estimates.steady_gpu_batch``) makes ``gpu_rate * cost`` tokens, so a
host batch of ``n`` decodes gains ``n - gpu_rate * cost`` tokens: it pays when that is
positive. New requests go to
the host pool while a larger host population would gain more, and only while the host, at that
population's batch time, would finish the oldest waiting request (its remaining output, one
token per host batch) before the GPU alone drains the rest of the work, the work still arriving
included (``host_finishes_first``): when the GPU pool is short only for a while, a request put
in the host pool comes back to it after a few host tokens, which repay neither the copy back nor
the GPU iterations the host batches slowed; a population that would pay only at a size the host
cannot finish in time is never reached, and the part of it admitted would straggle; while
arrivals keep the GPU saturated, it never drains and the host pool stays open. A batch is
launched when it pays, when the GPU has nothing else to do (``full-offload``, or no GPU work
this iteration), or when its oldest request has waited ``max_host_wait`` iterations while host
decodes pay (or it can never fit the GPU pool). Where they do not pay, host requests (a GPU
request evicted to the host pool, a population the measured slowdown turned unprofitable) wait
to come back to the GPU pool, which they do before any new request is admitted, as a gpu-only
engine's preempted requests do.

A host batch is estimated by the cost function of its order over the sub-batches the runner
splits it into (``host-batch``: ``linear(n)`` + host attention; ``host-batch-pair``: the
asymmetric overlap of the halves; each plus the profiled ``host_batch_overhead``), its host
attention and the rest of its time (its GPU stages and hand-offs) each corrected online by what
the completed batches measured of it (``TimeCalibration``; the rest only from batches that ran
beside no prefill: the first batches, beside a burst of prefills, take several times their
estimate, and a correction learned from them alone would close the host pool for good, since
no later batch would measure it again). An iteration of GPU decodes alone is estimated by its
profiled time corrected by what such iterations measured beside no batch
(``Estimates.gpu_decode_calibration``; the economics see a new correction at their periodic
refresh), and one that runs while a batch is in flight by that times the measured slowdown
(before it is measured, grown by the batch's GPU stages' share of the batch's time).
"""

from dataclasses import dataclass, field

from neo.request import Request

from ..calibration import HostBatchInterference
from ..estimates import is_gpu_decode_only, remaining_output
from ..runner_output import HostBatchOutput, IterationOutput
from ..scheduler_output import SchedulerOutput, SubBatch
from ..stage_order import SEQUENTIAL
from .base import Placement

EPSILON = 1e-9  # seconds: keeps rates finite under a zero perf model


@dataclass
class InFlightHostBatch:
    """The host batch launched and not yet done: the one record of it on the scheduling side."""

    requests: list[Request]
    predicted_time: float  # its estimated seconds until its tokens
    predicted_host_time: float  # of which host attention
    profiled_host_time: float  # the same from the profile alone (uncalibrated)
    uncorrected_rest_time: float  # its seconds beside host attention, before the rest's calibration
    # Whether a prefill ran beside it: its GPU stages then wait behind the prefill's kernels,
    # which its estimate leaves out, so its rest is no sample for the rest's calibration.
    beside_prefill: bool = False
    aborted: list[Request] = field(default_factory=list)  # their blocks are freed once it is done

    def __post_init__(self):
        self.ids = {id(request) for request in self.requests}


class HostBatches(Placement):
    def __init__(self, full_offload: bool = False):
        super().__init__(full_offload)
        self.in_flight: InFlightHostBatch | None = None
        self.interference = HostBatchInterference()
        # Whether the plan before prefilled: under async scheduling a batch launched now runs
        # beside it.
        self._previous_plan_prefilled = False

    # -- requests in flight --------------------------------------------------------------------

    @property
    def host_batch_in_flight(self) -> bool:
        return self.in_flight is not None

    @property
    def in_flight_requests(self) -> list[Request]:
        return self.in_flight.requests if self.in_flight is not None else []

    def plannable(self, running: list[Request]) -> list[Request]:
        if self.in_flight is None:
            return running
        return [r for r in running if id(r) not in self.in_flight.ids]

    def defer_abort(self, request: Request) -> bool:
        if self.in_flight is None or id(request) not in self.in_flight.ids:
            return False
        self.in_flight.aborted.append(request)  # the host batch still reads and writes its blocks
        return True

    def host_batch_done(self, scheduler, output: HostBatchOutput | None) -> list[Request]:
        flight, self.in_flight = self.in_flight, None
        for request in flight.aborted:
            scheduler.block_manager.free(request)
        if output is not None:
            estimates = scheduler.estimates
            estimates.host_calibration.observe(flight.profiled_host_time, output.host_seconds)
            if not flight.beside_prefill:
                estimates.host_batch_rest_calibration.observe(flight.uncorrected_rest_time,
                                                              output.seconds - output.host_seconds)
        return [r for r in flight.requests if not r.is_finished]

    def observe(self, scheduler, plan: SchedulerOutput, output: IterationOutput) -> None:
        super().observe(scheduler, plan, output)
        if plan.gpu_decode_sample is None:
            return
        calibration = scheduler.estimates.gpu_decode_calibration
        if not plan.beside_host_batch:
            calibration.observe(plan.gpu_decode_sample, output.seconds)
        self.interference.observe(plan.gpu_decode_sample, output.seconds, plan.beside_host_batch, calibration.scale)

    def measured_corrections(self, scheduler) -> tuple:
        estimates = scheduler.estimates
        return estimates.host_calibration.scale, estimates.host_batch_rest_calibration.scale, self.interference.factor

    # -- host decodes --------------------------------------------------------------------------

    def place(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> None:
        estimates = scheduler.estimates
        if batch0:
            plan.sub_batches = [batch0]
            plan.stage_order = SEQUENTIAL
        plan.predicted_host_time = plan.profiled_host_time = 0.0
        self._launch_host_batch(scheduler, batch0, host_requests, plan)
        self.note_prefills(batch0)
        alone = estimates.corrected_sequential_time(batch0) if batch0 else 0.0
        slowdown = 1.0  # beside the host batch in flight: measured, else its GPU stages' share of it
        if self.in_flight is not None:
            slowdown = self.interference.factor or 1 + (estimates.host_batch_gpu_time(len(self.in_flight.requests))
                                                         / (self.in_flight.predicted_time + EPSILON))
        plan.predicted_time = alone * slowdown
        plan.beside_host_batch = self.in_flight is not None
        # A plan's block copies lengthen it beyond its estimate, so it is no sample.
        if is_gpu_decode_only(batch0) and not plan.has_swaps:
            plan.gpu_decode_sample = alone / estimates.gpu_decode_calibration.scale  # the profile's

    def note_prefills(self, batch0: SubBatch) -> None:
        """A plan with this batch 0 was made (by this placement or, under ``auto``, the lockstep
        one): whether it prefills marks the batch in flight, and a batch launched next."""
        if self.in_flight is not None and batch0.prefills:
            self.in_flight.beside_prefill = True
        self._previous_plan_prefilled = bool(batch0.prefills)

    places_between_steps = True

    def place_host_batch(self, scheduler, beside: SchedulerOutput, host_requests: list[Request],
                         plan: SchedulerOutput) -> None:
        batch0 = beside.sub_batches[0] if beside.sub_batches else SubBatch()
        requests = self.host_batch_candidate(scheduler, batch0, host_requests, beside)
        if requests:
            self._start_host_batch(scheduler, requests, plan)

    def _launch_host_batch(self, scheduler, batch0: SubBatch, host_requests: list[Request],
                           plan: SchedulerOutput) -> None:
        """Put the plannable host requests into ``plan.host_batch`` when no batch is in flight
        and launching one is worth it (see the module docstring)."""
        requests = self.host_batch_candidate(scheduler, batch0, host_requests, plan)
        if not requests:
            scheduler.count_host_wait(bool(self.launchable(host_requests, plan)))
            return
        self._start_host_batch(scheduler, requests, plan)

    def _start_host_batch(self, scheduler, requests: list[Request], plan: SchedulerOutput) -> None:
        """``requests`` become ``plan.host_batch``, estimated, and the batch in flight."""
        estimates = scheduler.estimates
        seconds, host = estimates.host_batch_time(requests)
        plan.host_batch = SubBatch(host_decodes=requests)
        plan.host_batch_predicted_time = seconds
        plan.host_batch_predicted_host_time = host
        plan.host_batch_profiled_host_time = host / estimates.host_calibration.scale
        rest = (seconds - host) / estimates.host_batch_rest_calibration.scale
        self.in_flight = InFlightHostBatch(list(requests), seconds, host, plan.host_batch_profiled_host_time, rest,
                                           beside_prefill=self._previous_plan_prefilled)
        for request in requests:
            request.last_scheduled_iteration = scheduler.iteration
        scheduler.count_host_wait(False)

    @staticmethod
    def launchable(host_requests: list[Request], plan: SchedulerOutput) -> list[Request]:
        """The host requests a host batch launched with ``plan`` may hold. Requests evicted to
        the host pool just now wait for the next batch: their blocks are copied out by this
        iteration's GPU work, which a batch launched now does not wait for."""
        arriving = {host_block for _, host_block in plan.swap_out}
        return [r for r in host_requests if r.block_table[0] not in arriving]

    def host_batch_candidate(self, scheduler, batch0: SubBatch, host_requests: list[Request],
                             plan: SchedulerOutput) -> list[Request]:
        """The requests of the host batch this placement would launch with ``plan`` (oldest
        first, at most ``max_num_seqs``); empty when one is in flight, none may join, or
        launching one is not worth it. Changes nothing."""
        host_requests = self.launchable(host_requests, plan)
        if self.in_flight is not None or not host_requests:
            return []
        context = sum(r.num_tokens for r in host_requests)
        overdue = scheduler.host_decode_due and (scheduler.host_decodes_pay
                                                 or any(map(scheduler.never_fits_gpu, host_requests)))
        if not (self.full_offload or self._gain(scheduler, batch0, len(host_requests), context) > 0
                or not batch0 or overdue):
            return []
        return scheduler.oldest_first(host_requests)[:scheduler.config.max_num_seqs]

    def _gain(self, scheduler, batch0: SubBatch, num_host_decodes: int, context_tokens: int) -> float:
        """Tokens a host batch of that many decodes (and context tokens) gains over what it
        costs this iteration's GPU work (``batch0``'s tokens per second)."""
        tokens = len(batch0.prefills) + len(batch0.gpu_decodes)
        if not tokens:
            return float(num_host_decodes)
        rate = tokens / (scheduler.estimates.corrected_sequential_time(batch0) + EPSILON)
        return num_host_decodes - rate * self.gpu_cost(scheduler.estimates, num_host_decodes, context_tokens)

    def gpu_cost(self, estimates, num_host_decodes: int, context_tokens: int) -> float:
        """Seconds of GPU-iteration time a host batch of that many decodes costs (see the
        module docstring)."""
        slowdown = self.interference.factor
        if slowdown is None:
            return estimates.host_batch_gpu_time(num_host_decodes)
        return (1 - 1 / slowdown) * estimates.host_batch_time_of(num_host_decodes, context_tokens)

    def economics(self, scheduler, gpu_requests: list[Request], host_requests: list[Request]) -> tuple[bool, bool]:
        """(do host decodes pay, would more of them pay) for a steady decode iteration's GPU
        rate: a host population of ``n`` gains ``n - gpu_rate * cost(n)`` tokens per host
        batch; "more" adds requests like the oldest waiting one (``Scheduler.extra_requests``),
        only where the host would finish it before the GPU drains (``host_finishes_first``)."""
        estimates = scheduler.estimates
        steady = estimates.steady_gpu_batch(gpu_requests, host_requests, scheduler.waiting[0] if scheduler.waiting else None)
        alone_time = steady.alone_time * estimates.gpu_decode_calibration.scale  # as its iterations measure
        gpu_rate = steady.count / (alone_time + EPSILON) if steady.count else 0.0
        host_context = sum(r.num_tokens for r in host_requests)

        def gain(requests: int, context: int) -> float:
            return requests - gpu_rate * self.gpu_cost(estimates, requests, context) if requests else 0.0

        current = gain(len(host_requests), host_context)
        extras = [(extra, context) for extra, context in scheduler.extra_requests()  # none when nothing waits
                  if self.host_finishes_first(scheduler, gpu_requests, host_requests, gpu_rate, extra, context)]
        best_more = max((gain(len(host_requests) + extra, host_context + context) for extra, context in extras),
                        default=0.0)
        return max(current, best_more) > 0, best_more > max(current, 0.0)

    def host_finishes_first(self, scheduler, gpu_requests: list[Request], host_requests: list[Request],
                            gpu_rate: float, extra: int, extra_context: int) -> bool:
        """Whether the oldest waiting request, put in the host pool now with the ``extra - 1``
        behind it (``extra_context`` tokens in all), would finish there before the GPU alone
        drains the rest of the work: its remaining output, one token per host batch of the host
        population with them, against ``Estimates.gpu_drain_time`` of the GPU requests and the
        requests still waiting at ``gpu_rate``, with the work still arriving
        (``Scheduler.arrivals``). Judged for the population that would gain, not for one more
        request: a host population that pays only at a size the host cannot finish in time is
        never reached, and the part of it admitted straggles. If not, the GPU pool is short only
        for a while: the requests would return to the GPU pool once that has room, after a few
        host tokens that do not repay the copy back and the GPU iterations their host batches
        slowed, or straggle on the host after the GPU has finished. While arrivals keep the GPU
        saturated it never drains, and the host pool stays open."""
        estimates = scheduler.estimates
        head, behind = scheduler.waiting[0], list(scheduler.waiting)[extra:]
        seconds = estimates.host_batch_time_of(len(host_requests) + extra,
                                               sum(r.num_tokens for r in host_requests) + extra_context)
        drain = estimates.gpu_drain_time(gpu_requests, behind, gpu_rate, scheduler.config.max_num_batched_tokens,
                                         scheduler.arrivals.arriving_work())
        return remaining_output(head) * seconds <= drain
