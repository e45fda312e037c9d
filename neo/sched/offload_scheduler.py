"""``OffloadScheduler``: the load-aware scheduler of the ``neo`` and ``full-offload`` policies.

Each prefilled request lives wholly in the GPU pool or wholly in the host pool; new requests
go to the GPU pool while it has room, the overflow to the host pool. Each iteration:

1. Every running request gets a slot for its next token; when GPU blocks run out the newest GPU
   requests move to the host pool, when host blocks run out the newest host requests give
   their blocks back and wait to be prefilled again.
2. Waiting requests are prefilled (on the GPU; a host-bound prompt's KV is copied out layer by
   layer) within the token budget, into the GPU pool if it has room, else the host pool, but
   under ``neo`` only while more host decodes would raise the estimated tokens per second
   (step 4 of an earlier iteration judges that, again whenever request counts, the waiting
   head or the host correction change): where offloading does not pay, requests wait for GPU
   room as under gpu-only.
3. While the GPU pool has room, host requests move back to it, oldest first.
4. Host decodes are placed into the two sub-batches::

       batch 0: prefills + GPU decodes (+ a few host decodes)
       batch 1: host decodes

   Per layer the pipeline overlaps GPU work of one sub-batch with host attention of the other
   (see ``executor.py``), so with stage times from the ``PerfModel`` an iteration takes about
   ``max(lin(1), cpu(0)) + max(lin(0) + gpu(0), cpu(1))``, the GPU side stretched by the
   pipeline's own overhead (``PerfModel.two_batch_time``): the eager one, or for a decode-only
   iteration without swaps, which the runner replays from a CUDA graph, the graph's.
   Host requests are taken oldest first (round robin); each goes to the sub-batch where the
   estimated time grows least, and the ``neo`` policy keeps the number of them that gives the
   highest estimated tokens per second, zero meaning the GPU-only plan (batch 0 alone). With
   a negligible pipeline overhead that is where host attention just stays hidden
   (``cpu(1) <= lin(0) + gpu(0)`` and ``cpu(0) <= lin(1)``); a large fixed cost per pipelined
   iteration makes larger host batches pay. Host requests always progress: where host
   decodes do not pay, they move back to the GPU pool before any new request is admitted (as
   gpu-only swaps in); while host decodes pay (on a steady decode iteration, see
   ``_host_decode_economics``), or for a request that could never fit the GPU pool, no host
   request waits more than ``max_host_wait`` iterations for a decode. While host decodes are
   judged not to pay and none is due, an iteration without prefills runs the GPU alone without
   placing any (prefills can hide a few host decodes, so iterations with them still place).
   ``full-offload`` has no GPU pool: every request decodes on the host, every iteration, split
   between the sub-batches to balance them.

Host-attention estimates are the profile's times corrected by the host time the engine measured
in recent iterations (``HostTimeCalibration``, fed through ``observe``); before any measurement
the correction is optimistic, so host decodes are tried wherever they might pay.
"""

from dataclasses import dataclass, field

from .block_manager import BlockManager
from neo.runner.decode_graphs import graph_block_width
from neo.config import EngineConfig
from .perf_model import HostTimeCalibration, PerfModel
from neo.request import KVLocation, Request
from .scheduler import Scheduler
from .scheduler_output import SchedulerOutput, SubBatch

GPU, HOST = KVLocation.GPU, KVLocation.HOST
EPSILON = 1e-9  # seconds: keeps rates finite under a zero perf model
# Whether host decodes pay is judged again when what it depends on changes (request counts,
# the waiting head, the host correction), and at least this often as contexts grow.
ECONOMICS_REFRESH_ITERATIONS = 16


@dataclass
class _Placement:
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

    @property
    def requests(self) -> list[Request]:
        return self.batch0 + self.batch1


@dataclass
class _SteadyGpuBatch:
    """Batch 0 of a steady decode iteration (``OffloadScheduler._steady_gpu_batch``)."""

    count: int  # GPU decodes
    eager_time: float  # its stage times: beside host decodes it runs eagerly or in a pipeline graph
    alone_time: float  # alone: a decode graph's replay where the engine has one
    graphed: bool  # within the graphs' context


@dataclass
class _GpuWork:
    """Batch 0's GPU work apart from its host decodes: tokens through the linear stages and
    the seconds of its GPU (decode and prefill) attention."""

    linear_tokens: int
    attention_seconds: float


class OffloadScheduler(Scheduler):
    def __init__(self, config: EngineConfig, block_manager: BlockManager, perf_model: PerfModel,
                 num_layers: int, max_host_wait: int = 4, host_calibration: HostTimeCalibration | None = None):
        super().__init__(config, block_manager)
        self.perf_model = perf_model
        self.host_calibration = host_calibration or HostTimeCalibration()
        self.num_layers = num_layers
        self.max_host_wait = max_host_wait
        self.full_offload = config.policy == "full-offload"
        self.iteration = 0
        self.iterations_without_host_decode = 0
        # Decided each iteration for the next one's prefills: whether host decodes pay at all
        # (else host requests return to the GPU before new admissions), and whether more of
        # them would raise the estimated throughput (new requests go to the host pool only then).
        self.host_decodes_pay = self.full_offload
        self.host_admission_open = self.full_offload
        self._economics_seen: tuple | None = None  # what the last judgement was made on
        self._economics_iteration = 0

    def schedule(self) -> SchedulerOutput:
        self.iteration += 1
        output = SchedulerOutput()
        batch0 = SubBatch()
        host_requests = self._make_decode_slots(batch0, output)
        budget = self.config.max_num_batched_tokens - len(batch0.gpu_decodes) - len(host_requests)
        if self.full_offload:
            self._admit_prefills(batch0, budget)
        elif self.host_decodes_pay:
            self._admit_prefills(batch0, budget)
            host_requests = self._move_to_gpu(host_requests, batch0, output)
        else:  # host decodes do not pay: host requests come back first, as gpu-only swaps in
            host_requests = self._move_to_gpu(host_requests, batch0, output)
            if not host_requests:
                self._admit_prefills(batch0, budget)
        self._plan_host_decodes(batch0, host_requests, output)
        for request in output.requests:
            request.last_scheduled_iteration = self.iteration
        return output

    def observe(self, plan: SchedulerOutput, host_seconds: float, measured_seconds: float) -> None:
        """The measured host time of an executed plan corrects later host estimates (plans
        that also copied out a prefill's K/V on the host are left out: the estimate omits it)."""
        if not plan.profiled_host_time or any(r.location is HOST for b in plan.sub_batches for r in b.prefills):
            return
        self.host_calibration.observe(plan.profiled_host_time, host_seconds)

    # -- 1. decode slots ------------------------------------------------------------------------

    def _plannable(self) -> list[Request]:
        """The running requests this iteration may decode, evict or move (all of them here)."""
        return self.running

    def _make_decode_slots(self, batch0: SubBatch, output: SchedulerOutput) -> list[Request]:
        """Slots for every plannable request's next token, GPU pool first. GPU requests go into
        ``batch0``; returns the host requests that got a slot (GPU requests evicted just now
        among them), oldest first."""
        plannable = self._plannable()
        gpu_queue = [r for r in plannable if r.location is GPU]
        while gpu_queue:
            request = gpu_queue.pop(0)
            if self._make_slot(request, gpu_queue, output):
                batch0.gpu_decodes.append(request)
        host_queue = [r for r in plannable if r.location is HOST]
        ready = []
        while host_queue:
            request = host_queue.pop(0)
            if self._make_slot(request, host_queue, output):
                ready.append(request)
        return ready

    def _make_slot(self, request: Request, queue: list[Request], output: SchedulerOutput) -> bool:
        """Room for ``request``'s next token in its pool. While the pool is full, evict the newest
        request of ``queue`` (``request`` itself when none is left). True if it got the slot."""
        manager = self.block_manager
        while manager.needs_new_block(request) and manager.num_free(request.location) == 0:
            victim = queue.pop() if queue else request
            self._evict(victim, output)
            if victim is request:
                return False
        manager.append_slot(request)
        return True

    def _evict(self, request: Request, output: SchedulerOutput) -> None:
        """A GPU request moves to the host pool if it has room; otherwise the request gives its
        blocks back to be prefilled again, or ends if no pool could ever hold it."""
        manager = self.block_manager
        if request.location is GPU and manager.can_move(request, HOST, reserve=1):
            output.swap_out += manager.move(request, HOST)
            return
        largest_pool = max(manager.num_total(HOST), 0 if self.full_offload else manager.num_total(GPU))
        if len(request.block_table) + 1 > largest_pool:
            self.running.remove(request)
            self.finish(request, "length")
            output.finished.append(request)
            return
        self._recompute_or_end(request, output)

    # -- 2. prefills ---------------------------------------------------------------------------

    def _prefill_location(self, request: Request) -> KVLocation | None:
        """The GPU pool while it has room, else the host pool (a prompt's KV is copied out
        layer by layer as the prefill makes it)."""
        if not self.full_offload and super()._prefill_location(request) is GPU:
            return GPU
        if not self.host_admission_open and self.running:  # alone, it always may
            return None
        return HOST if self.block_manager.can_allocate(request.num_tokens + 1, HOST) else None

    # -- 3. host -> GPU ------------------------------------------------------------------------

    def _move_to_gpu(self, host_requests: list[Request], batch0: SubBatch,
                     output: SchedulerOutput) -> list[Request]:
        """Move host requests (oldest first, slots already made) to the GPU pool while it has
        room; they decode there this iteration. Returns those left on the host."""
        manager = self.block_manager
        for index, request in enumerate(host_requests):
            if not manager.can_move(request, GPU, reserve=self.watermark_blocks):
                return host_requests[index:]
            output.swap_in += manager.move(request, GPU)
            batch0.gpu_decodes.append(request)
        return []

    # -- 4. host decodes -----------------------------------------------------------------------

    def _plan_host_decodes(self, batch0: SubBatch, host_requests: list[Request], output: SchedulerOutput) -> None:
        """Complete the plan with the host decodes (placed into the two sub-batches here) and
        its estimates."""
        batch1 = self._place_host_decodes(batch0, host_requests, swaps=bool(output.swap_in or output.swap_out))
        output.sub_batches = [batch for batch in (batch0, batch1) if batch]
        output.predicted_time, output.predicted_host_time = self._estimate(output)
        output.profiled_host_time = output.predicted_host_time / self.host_calibration.scale

    def _place_host_decodes(self, batch0: SubBatch, host_requests: list[Request], swaps: bool) -> SubBatch:
        """Choose how many host requests decode (oldest first, round robin) and in which
        sub-batch each goes, by estimated tokens per second (``swaps``: the plan moves blocks
        between the pools)."""
        batch1 = SubBatch()
        ordered = sorted(host_requests, key=lambda r: r.last_scheduled_iteration)
        if not self.full_offload:
            if ordered or self.waiting:
                self._judge_host_decodes(ordered)
            else:  # nothing to decide until requests wait or live on the host: gpu-only rules
                self.host_decodes_pay = self.host_admission_open = False
                self._economics_seen = None
        if not ordered:
            self.iterations_without_host_decode = 0
            return batch1
        must_decode = (self.iterations_without_host_decode >= self.max_host_wait
                       and (self.host_decodes_pay or any(map(self._never_fits_gpu, ordered))))
        if not (self.full_offload or self.host_decodes_pay or must_decode or batch0.prefills or not batch0):
            # A decode iteration of the kind just judged not to pay host decodes: GPU alone.
            self.iterations_without_host_decode += 1
            return batch1
        placement = _Placement()
        work0 = self._gpu_work(batch0)
        graphed = self._replays_pipeline_graph(batch0, swaps)
        base_tokens = len(batch0.prefills) + len(batch0.gpu_decodes)
        best_count = 0
        best_rate = (base_tokens / (self._sequential_time(batch0, work0, swaps=swaps) + EPSILON)
                     if base_tokens else -1.0)
        for count, request in enumerate(ordered, start=1):
            rate = (base_tokens + count) / (self._place(work0, placement, request, graphed) + EPSILON)
            if rate > best_rate or (must_decode and best_count == 0):
                best_count, best_rate = count, rate
        if self.full_offload:
            best_count = len(ordered)
        chosen = {id(request) for request in ordered[:best_count]}
        batch0.host_decodes.extend(r for r in placement.batch0 if id(r) in chosen)
        batch1.host_decodes.extend(r for r in placement.batch1 if id(r) in chosen)
        self.iterations_without_host_decode = 0 if best_count else self.iterations_without_host_decode + 1
        return batch1

    def _judge_host_decodes(self, host_requests: list[Request]) -> None:
        """Update ``host_decodes_pay`` and ``host_admission_open`` (see
        ``_host_decode_economics``) when their inputs changed or
        ``ECONOMICS_REFRESH_ITERATIONS`` passed: judging costs tens of estimates, more than
        the rest of a plan."""
        gpu_requests = [r for r in self.running if r.location is GPU]
        seen = (len(gpu_requests), len(host_requests), self.waiting[0].num_tokens if self.waiting else 0,
                self._measured_corrections())
        if seen == self._economics_seen and self.iteration - self._economics_iteration < ECONOMICS_REFRESH_ITERATIONS:
            return
        self._economics_seen, self._economics_iteration = seen, self.iteration
        self.host_decodes_pay, self.host_admission_open = self._host_decode_economics(gpu_requests, host_requests)

    def _measured_corrections(self) -> tuple:
        """What the engine's measurements currently correct the estimates by (a change calls
        for judging again)."""
        return (self.host_calibration.scale,)

    def _never_fits_gpu(self, request: Request) -> bool:
        return len(request.block_table) + 1 + self.watermark_blocks > self.block_manager.num_total(GPU)

    def _steady_gpu_batch(self, gpu_requests: list[Request], host_requests: list[Request]) -> _SteadyGpuBatch:
        """Batch 0 of a steady decode iteration: the GPU pool full of requests of the running
        requests' mean length, no prefills (an admitted request decodes for many iterations,
        most of them without prefills)."""
        model = self.perf_model
        running = gpu_requests + host_requests
        lengths = [r.num_tokens for r in running] or ([self.waiting[0].num_tokens] if self.waiting else [1])
        mean_length = sum(lengths) / len(lengths)
        pool_tokens = self.block_manager.num_total(GPU) * self.block_manager.block_size
        count = max(len(gpu_requests), int(pool_tokens // mean_length))
        context = max(sum(r.num_tokens for r in gpu_requests), int(count * mean_length))
        eager_time = model.linear(count) + model.gpu_attention(context) if count else 0.0
        # Alone, that batch replays a CUDA graph where the engine has one for it.
        graphed = self.config.use_cuda_graphs and mean_length <= self.config.cuda_graph_max_context
        graph_time = model.graph_decode(count, context) if count and graphed else None
        alone_time = eager_time + model.iteration_overhead if graph_time is None else graph_time
        return _SteadyGpuBatch(count, eager_time, alone_time, graphed)

    def _extra_requests(self) -> list[tuple[int, int]]:
        """(requests, context tokens) of 1, 2, 4, ... more requests like the oldest waiting one,
        up to the sequence cap (none when nothing waits)."""
        if not self.waiting:
            return []
        length = self.waiting[0].num_tokens + 1
        extras, extra = [], 1
        while extra <= self.config.max_num_seqs - len(self.running):
            extras.append((extra, extra * length))
            extra *= 2
        return extras

    def _host_decode_economics(self, gpu_requests: list[Request],
                               host_requests: list[Request]) -> tuple[bool, bool]:
        """(do host decodes pay, would more of them pay), judged on a steady decode iteration
        (``_steady_gpu_batch``) with the host requests as batch 1. "Pay" means more estimated
        tokens per second than batch 0 alone; "more" adds requests (``_extra_requests``)."""
        model = self.perf_model
        steady = self._steady_gpu_batch(gpu_requests, host_requests)
        gpu_rate = steady.count / (steady.alone_time + EPSILON) if steady.count else -1.0
        host_context = sum(r.num_tokens for r in host_requests)

        def rate(requests: int, context: int) -> float:
            time = model.two_batch_time(steady.eager_time, 0.0, model.linear(requests), 0.0,
                                        self._host_attention(requests, context), graphed=steady.graphed)
            return (steady.count + requests) / (time + EPSILON)

        current = rate(len(host_requests), host_context) if host_requests else -1.0
        more = [rate(len(host_requests) + extra, host_context + context) for extra, context in self._extra_requests()]
        best_more = max(more, default=-1.0)
        return max(current, best_more) > gpu_rate, best_more > max(current, gpu_rate)

    def _place(self, work0: _GpuWork, placement: _Placement, request: Request, graphed: bool) -> float:
        """Put one more host decode in the sub-batch where the estimated iteration time grows
        least (ties, e.g. with a zero perf model, keep about a third of them in batch 0).
        Returns the estimated iteration time with it (``graphed``: replayed from a graph)."""
        best = None
        for side in (1, 0):
            sizes = placement.sizes(add_to=side, tokens=request.num_tokens)
            balance = 0 if (side == 1) == (2 * len(placement.batch0) >= len(placement.batch1)) else 1
            candidate = (self._two_batch_time(work0, *sizes, graphed=graphed), balance, side)
            best = candidate if best is None or candidate < best else best
        placement.add(best[2], request)
        return best[0]

    # -- estimates (whole-model seconds) -------------------------------------------------------

    def _gpu_work(self, batch: SubBatch) -> _GpuWork:
        """The part of a sub-batch's GPU work that does not depend on its host decodes."""
        model = self.perf_model
        return _GpuWork(batch.num_prefill_tokens + len(batch.gpu_decodes),
                        model.gpu_attention(sum(r.num_tokens for r in batch.gpu_decodes))
                        + model.prefill_attention([r.num_tokens for r in batch.prefills]))

    def _two_batch_time(self, work0: _GpuWork, requests0: int, context0: int,
                        requests1: int, context1: int, graphed: bool) -> float:
        return self._two_batch_seconds(work0, requests0, requests1, self._host_attention(requests0, context0),
                                       self._host_attention(requests1, context1), graphed)

    def _two_batch_seconds(self, work0: _GpuWork, requests0: int, requests1: int, host0: float,
                           host1: float, graphed: bool) -> float:
        """A two-sub-batch iteration with that many host decodes and host seconds per side
        (``graphed``: replayed from a pipeline graph)."""
        model = self.perf_model
        return model.two_batch_time(model.linear(work0.linear_tokens + requests0), work0.attention_seconds,
                                    model.linear(requests1), host0, host1, graphed=graphed)

    def _host_attention(self, num_requests: int, context_tokens: int) -> float:
        """Host attention seconds of that many decodes: the profile's, corrected."""
        return self.perf_model.host_attention(num_requests, context_tokens) * self.host_calibration.scale

    def _host_time(self, batch: SubBatch) -> float:
        return self._host_attention(len(batch.host_decodes), sum(r.num_tokens for r in batch.host_decodes))

    def _sequential_time(self, batch: SubBatch, work: _GpuWork | None = None, host: float | None = None,
                         swaps: bool = False) -> float:
        """One sub-batch: its host attention (if any) does not overlap GPU work. ``work`` and
        ``host`` (its host attention seconds) when the caller has them already; ``swaps``:
        the plan also moves blocks between the pools (no CUDA graph then)."""
        model = self.perf_model
        graph = None if swaps else self._graph_time(batch)
        if graph is not None:
            return graph
        work = self._gpu_work(batch) if work is None else work
        host = self._host_time(batch) if host is None else host
        return (model.linear(work.linear_tokens + len(batch.host_decodes)) + work.attention_seconds + host
                + model.iteration_overhead)

    def _graph_time(self, batch: SubBatch) -> float | None:
        """Seconds of a sub-batch of GPU decodes alone that the runner replays from a CUDA
        graph (see ``DecodeGraphs.can_run``); None for any other sub-batch."""
        if batch.prefills or batch.host_decodes or not batch.gpu_decodes or not self.config.use_cuda_graphs:
            return None
        if not self._gpu_tables_fit_graphs(batch):
            return None
        return self.perf_model.graph_decode(len(batch.gpu_decodes), sum(r.num_tokens for r in batch.gpu_decodes))

    def _gpu_tables_fit_graphs(self, batch: SubBatch) -> bool:
        """Whether the GPU decodes' block tables are within the graphs' captured width."""
        widest = max((len(request.block_table) for request in batch.gpu_decodes), default=0)
        return widest <= graph_block_width(self.config.cuda_graph_max_context, self.block_manager.block_size)

    def _replays_pipeline_graph(self, batch0: SubBatch, swaps: bool) -> bool:
        """Whether a two-sub-batch plan with this batch 0 is one the runner replays from a
        pipeline graph (decode-only, no swaps; see ``PipelineGraphs.shape``)."""
        return (self.config.use_cuda_graphs and not swaps and not batch0.prefills
                and self._gpu_tables_fit_graphs(batch0))

    def _estimate(self, plan: SchedulerOutput) -> tuple[float, float]:
        """(estimated seconds of a plan, of which host attention)."""
        host = [self._host_time(batch) for batch in plan.sub_batches]
        swaps = bool(plan.swap_in or plan.swap_out)
        if len(plan.sub_batches) == 2:
            batch0, batch1 = plan.sub_batches
            seconds = self._two_batch_seconds(self._gpu_work(batch0), len(batch0.host_decodes),
                                              len(batch1.host_decodes), host[0], host[1],
                                              self._replays_pipeline_graph(batch0, swaps))
        else:
            seconds = self._sequential_time(plan.sub_batches[0], host=host[0], swaps=swaps) if plan.sub_batches else 0.0
        return seconds, sum(host)
