"""``AsyncOffloadScheduler``: the neo and full-offload policies under the async host pipeline.

Pools, admission, eviction and moves back to the GPU are ``OffloadScheduler``'s; what differs
is where host decodes go. Each iteration is one sub-batch for the GPU (prefills and GPU
decodes), and the host decodes run as a host batch of their own beside the GPU's iterations
(``neo.host_batches``), one batch in flight at a time. When none is in flight, every host
request that got its slot joins the next one; requests in flight are left out of planning until
their batch completes (``host_batch_done``), and an abort of one of them frees its blocks only
then. A request evicted to the host pool joins a batch launched after the iteration that copies
its blocks out.

Whether host decodes pay: the GPU never waits for a host batch's attention, but the batch
costs the GPU's own iterations time: its ``pre``/``post`` stages read all the weights once,
``linear(n)`` seconds for ``n`` host decodes, and beside it the iterations may run slower
still (its kernels share the SMs, its host threads share the host with the launching thread).
That slowdown is measured (``HostBatchInterference``: iterations beside a batch against their
estimate alone): a batch that lasts ``T`` seconds with the iterations ``s`` times slower costs
them ``(1 - 1/s) * T`` seconds, and at least ``linear(n)`` (the only cost before anything is
measured). In that time a steady GPU iteration (``_steady_gpu_batch``) makes ``gpu_rate *
cost`` tokens, so a host batch of ``n`` decodes gains ``n - gpu_rate * cost`` tokens: it pays
when that is positive. New requests go to the host pool while a larger host population would
gain more (as in ``OffloadScheduler``, judged again when request counts, the waiting head or a
measured correction change). A batch is launched when it pays, when the GPU has nothing else
to do (``full-offload``, or no GPU work this iteration), or when its oldest request has waited
``max_host_wait`` iterations: host requests always progress.

A host batch is estimated as ``linear(n) + host attention + host_batch_overhead`` (its stages
follow one another; ``PerfModel.host_batch_time``), host attention corrected online by the
host time each completed batch measured. An iteration that runs while a batch is in flight is
estimated as its time alone times the measured slowdown (before it is measured, grown by the
batch's GPU stages' share of the batch's time).
"""

from .perf_model import HostBatchInterference
from neo.request import KVLocation, Request, RequestStatus
from .offload_scheduler import EPSILON, OffloadScheduler
from .scheduler_output import SchedulerOutput, SubBatch

GPU, HOST = KVLocation.GPU, KVLocation.HOST


class AsyncOffloadScheduler(OffloadScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_flight: list[Request] = []  # the host batch launched and not yet done
        self._in_flight_ids: set[int] = set()
        self._aborted_in_flight: list[Request] = []  # their blocks are freed once the batch is done
        self._in_flight_profiled_host_time = 0.0
        self._in_flight_predicted_time = 0.0
        self.interference = HostBatchInterference()
        # The last plan's decode iteration: (its estimate alone, beside a host batch), for ``observe``.
        self._planned_decode_iteration: tuple[float, bool] | None = None

    # -- requests in flight --------------------------------------------------------------------

    def _plannable(self) -> list[Request]:
        return [r for r in self.running if id(r) not in self._in_flight_ids]

    def abort(self, request: Request, reason: str = "abort") -> None:
        if id(request) not in self._in_flight_ids:
            super().abort(request, reason)
            return
        # The host batch still reads and writes its blocks: they are freed when it is done.
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._aborted_in_flight.append(request)

    def host_batch_done(self, host_seconds: float | None) -> list[Request]:
        """The host batch in flight has completed (``host_seconds``: its measured host time,
        None when it failed). Frees the blocks of requests aborted meanwhile; returns the
        requests whose tokens the caller appends (those not aborted)."""
        done = [r for r in self.in_flight if not r.is_finished]
        for request in self._aborted_in_flight:
            self.block_manager.free(request)
        if host_seconds is not None:
            self.host_calibration.observe(self._in_flight_profiled_host_time, host_seconds)
        self.in_flight, self._in_flight_ids, self._aborted_in_flight = [], set(), []
        return done

    def observe(self, plan: SchedulerOutput, host_seconds: float, measured_seconds: float) -> None:
        super().observe(plan, host_seconds, measured_seconds)
        if self._planned_decode_iteration is not None:
            estimated_alone, beside = self._planned_decode_iteration
            self.interference.observe(estimated_alone, measured_seconds, beside)

    def _measured_corrections(self) -> tuple:
        return self.host_calibration.scale, self.interference.factor

    # -- host decodes --------------------------------------------------------------------------

    def _plan_host_decodes(self, batch0: SubBatch, host_requests: list[Request], output: SchedulerOutput) -> None:
        output.sub_batches = [batch0] if batch0 else []
        output.predicted_host_time = output.profiled_host_time = 0.0
        self._launch_host_batch(batch0, host_requests, output)
        swaps = bool(output.swap_in or output.swap_out)
        alone = self._sequential_time(batch0, swaps=swaps) if batch0 else 0.0
        slowdown = 1.0  # beside the host batch in flight: measured, else its GPU stages' share of it
        if self.in_flight:
            slowdown = self.interference.factor or 1 + (self.perf_model.linear(len(self.in_flight))
                                                         / (self._in_flight_predicted_time + EPSILON))
        output.predicted_time = alone * slowdown
        decode_only = bool(batch0) and not batch0.prefills and not swaps
        self._planned_decode_iteration = (alone, bool(self.in_flight)) if decode_only else None

    def _launch_host_batch(self, batch0: SubBatch, host_requests: list[Request], output: SchedulerOutput) -> None:
        """Put the plannable host requests into ``output.host_batch`` when no batch is in flight
        and launching one is worth it (see the module docstring)."""
        if not self.full_offload:
            if host_requests or self.in_flight or self.waiting:
                self._judge_host_decodes(host_requests + self.in_flight)
            else:  # nothing to decide until requests wait or live on the host: gpu-only rules
                self.host_decodes_pay = self.host_admission_open = False
                self._economics_seen = None
        # Requests evicted to the host pool just now wait for the next batch: their blocks are
        # copied out by this iteration's GPU work, which a batch launched now does not wait for.
        arriving = {host_block for _, host_block in output.swap_out}
        host_requests = [r for r in host_requests if r.block_table[0] not in arriving]
        if self.in_flight or not host_requests:
            self.iterations_without_host_decode = 0 if not host_requests else self.iterations_without_host_decode + 1
            return
        due = self.iterations_without_host_decode >= self.max_host_wait
        context = sum(r.num_tokens for r in host_requests)
        if not (self.full_offload or self._gain(batch0, len(host_requests), context) > 0 or not batch0 or due):
            self.iterations_without_host_decode += 1
            return
        requests = sorted(host_requests, key=lambda r: r.last_scheduled_iteration)[:self.config.max_num_seqs]
        output.host_batch = SubBatch(host_decodes=requests)
        host = self._host_attention(len(requests), sum(r.num_tokens for r in requests))
        output.host_batch_predicted_time = self.perf_model.host_batch_time(self.perf_model.linear(len(requests)), host)
        output.host_batch_predicted_host_time = host
        output.host_batch_profiled_host_time = host / self.host_calibration.scale
        self._in_flight_profiled_host_time = output.host_batch_profiled_host_time
        self._in_flight_predicted_time = output.host_batch_predicted_time
        self.in_flight = list(requests)
        self._in_flight_ids = {id(r) for r in requests}
        for request in requests:
            request.last_scheduled_iteration = self.iteration
        self.iterations_without_host_decode = 0

    def _gain(self, batch0: SubBatch, num_host_decodes: int, context_tokens: int) -> float:
        """Tokens a host batch of that many decodes (and context tokens) gains over what it
        costs this iteration's GPU work (``batch0``'s tokens per second)."""
        tokens = len(batch0.prefills) + len(batch0.gpu_decodes)
        if not tokens:
            return float(num_host_decodes)
        rate = tokens / (self._sequential_time(batch0) + EPSILON)
        return num_host_decodes - rate * self._gpu_cost(num_host_decodes, context_tokens)

    def _gpu_cost(self, num_host_decodes: int, context_tokens: int) -> float:
        """Seconds of GPU-iteration time a host batch of that many decodes costs (see the
        module docstring)."""
        linear = self.perf_model.linear(num_host_decodes)
        slowdown = self.interference.factor
        if slowdown is None:
            return linear
        seconds = self.perf_model.host_batch_time(linear, self._host_attention(num_host_decodes, context_tokens))
        return max(linear, (1 - 1 / slowdown) * seconds)

    def _host_decode_economics(self, gpu_requests: list[Request],
                               host_requests: list[Request]) -> tuple[bool, bool]:
        """(do host decodes pay, would more of them pay) for a steady decode iteration's GPU
        rate: a host population of ``n`` gains ``n - gpu_rate * cost(n)`` tokens per host
        batch; "more" adds requests like the oldest waiting one (``_extra_requests``)."""
        steady = self._steady_gpu_batch(gpu_requests, host_requests)
        gpu_rate = steady.count / (steady.alone_time + EPSILON) if steady.count else 0.0
        host_context = sum(r.num_tokens for r in host_requests)

        def gain(requests: int, context: int) -> float:
            return requests - gpu_rate * self._gpu_cost(requests, context) if requests else 0.0

        current = gain(len(host_requests), host_context)
        best_more = max((gain(len(host_requests) + extra, host_context + context)
                         for extra, context in self._extra_requests()), default=0.0)
        return max(current, best_more) > 0, best_more > max(current, 0.0)
