"""``HostBatchRunner``: batches of host decodes that run beside the GPU's iterations.

Under the async host pipeline (``EngineConfig.host_pipeline="async"``) the host decodes are not
part of the GPU's iterations. A batch of them is launched on a CUDA stream of its own and goes
through the layers there in the ``host-batch`` stage order (``neo.sched.stage_order``): per
layer its ``pre`` and ``post`` run on the GPU, its attention on the host CPU. While the host
attends, the compute stream runs the GPU's own iterations (prefills, GPU decodes), as many as
fit::

    compute stream | iteration k          | iteration k+1       | iteration k+2       | ...
    host stream    | pre(h,0) .............. post(h,0) pre(h,1) ............. post(h,1) ...
    host CPU       |           attn_host(h,0)                   attn_host(h,1)

So the GPU never waits for the host, and the host never waits for the GPU's iterations, only for
the batch's own ``pre``/``post`` (the stream has high priority). In the ``host-batch-pair``
order (``EngineConfig.host_batch_order``) the batch goes through the layers in two halves,
asymmetric, and the host attends for one half while the stream runs the other's ``post`` and
``pre``, so it need not wait for them either. Each host batch reads all the weights once (once
per half in the pair), on top of the GPU's iterations: that is the price of the batch's tokens.

The batch's pipeline graphs and the GPU iterations' decode graphs replay at the same time on
two streams, so each owner captures on a stream of its own: graphs captured on one stream share
its cuBLAS workspace, and concurrent GEMMs on a shared workspace deadlocked the GPU (see
``neo.runner.decode_graphs``).

The batch's host work runs in CUDA host functions on its own executor's copy stream
(``HostDecodeStage``), and its decode-only iteration is replayed from pipeline CUDA graphs when
they fit. The graphs of every shape a batch can replay (``host_batch_shapes``: the batch sizes
padded as ``neo.runner.pipeline_graphs`` pads them, split as the batch order splits them) are
captured when the engine is built (``capture_graphs``), largest first so that one memory pool
fits them all, rather than in the first batch of each shape: a capture begins by waiting for
the whole device, so during serving it would hold the batch (and the launching thread) for the
GPU's iteration in flight and the capture itself, and under tensor parallelism for the slowest
rank's. The CUDA driver holds only a few dozen pending host functions per stream; a launch
beyond that blocks the launching thread until the host has run enough of them, and a graph of
every layer holds one host function per layer. So the layers are captured in parts of at most
``layers_per_part`` layers (``neo.runner.executor.layer_parts``; one graph per part,
``neo.runner.pipeline_graphs``), and at most two parts are pending at a time: ``launch`` queues
the first two, each followed by an event on the host stream, and ``advance`` (which the engine
calls every step, and ``ready``/``collect`` call while they poll) queues the next part once the
part two before it has completed::

    host stream | part 0 | part 1 | ...... part 2 | ...... part 3 | logits, sampling, token copy
    queued at   | launch   launch   advance after   advance after   with the last part
                |                   part 0 ended    part 1 ended

So at most ``2 * layers_per_part`` host functions are pending (32 with the default 16 layers),
within the driver's queue: launching costs the engine's thread about two graph replays and
never waits on the driver. A model of at most ``layers_per_part`` layers has one part, launched whole. The sampled
tokens are copied to pinned memory behind an event that ``collect`` polls; the batch's
``started``/``ended`` timing events bracket all its parts.

While a part waits in a host function, the GPU's hardware work queue that holds it waits too,
and so does every stream that shares that queue: the engine asks the driver for as many queues as
it grants (``neo.engine.hardware_queues``), so that the compute stream's iterations do not wait
behind the batch's host attention.

A batch with no graph (contexts beyond the graphs' limit, graphs off, or no CUDA) is
walked eagerly in the same parts (``EagerParts``: the executor's ``forward_layers`` over each
part's layers), queued by the same rule, so an eager launch holds the engine's thread no longer
than a replayed one. Where host work cannot be ordered on streams (no CUDA, or CPU kernels
written in Python) every part is queued at launch and the batch runs to completion there.

Under tensor parallelism every rank walks the batch over its shard, its collectives on the side
group (``TensorParallel.on_side_group``), so they never queue behind or ahead of the iterations'.
The driver's runner decides when each part is queued and reports how many it has queued
(``on_parts_queued``); the other ranks queue theirs when told (``follow``, ``follow_parts``), so
every rank issues the batch's collectives in the same order, and no rank queues a part before
the driver has seen the part two before it complete.
"""

import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from neo.kv.kv_cache import KVCache
from neo.request import Request
from neo.sched.runner_output import HostBatchOutput
from neo.sched.scheduler_output import SubBatch
from neo.sched.stage_order import HOST_BATCH, StageOrder, host_batch_sub_batches

from .batch_inputs import build_batch_inputs
from .executor import LayerPartWalk, PipelineExecutor, layer_parts
from .host_attention import HostKernels
from .host_failures import raise_other_rank_failure, reduce_host_failures
from .host_worker import HostAttentionWorker
from .logits_processors import process_logits
from .pipeline_graphs import DEFAULT_CAPACITY, PartReplay, PipelineGraphs, padded, padded_counts
from .sampler import Sampler
from .token_logprobs import TokenLogprobs

POLL_SECONDS = 0.0005  # between checks whether a host batch has completed
DEFAULT_LAYERS_PER_PART = 16
PARTS_PENDING = 2  # graph parts queued and not yet completed, at most


def host_batch_shapes(order: StageOrder, max_decodes: int) -> list[tuple[StageOrder, tuple[tuple[int, int], ...]]]:
    """Every (order, padded shape) a host batch of 1 to ``max_decodes`` decodes replays in
    ``order`` (``host_batch_sub_batches`` splits it, ``padded_counts`` pads each part's rows;
    a host batch has no GPU rows), the largest first."""
    sizes = padded_counts(max_decodes)
    shapes = {}
    for count in range(1, max_decodes + 1):
        batch_order, parts = host_batch_sub_batches(order, count)
        shape = tuple((0, padded(part.stop - part.start, sizes)) for part in parts)
        shapes[(batch_order.name, shape)] = (batch_order, shape)
    return sorted(shapes.values(), key=lambda item: (sum(rows for _, rows in item[1]), item[0].name), reverse=True)


class EagerParts(LayerPartWalk):
    """A host batch walked eagerly, one part of its layers at a time: each part queues its
    layers' steps (``PipelineExecutor.forward_layers``) on the current stream, the logits the
    final norm and LM head behind the last."""

    def __init__(self, executor: PipelineExecutor, inputs: list, order: StageOrder, parts: list[range]):
        """``inputs``: the ``BatchInputs`` of each of ``order``'s sub-batches."""
        super().__init__(len(parts))
        self._executor = executor
        self._inputs = inputs
        self._order = order
        self._parts = parts
        executor.prepare([batch.metadata for batch in inputs])
        self._states = executor.embed([batch.input_ids for batch in inputs])

    def _queue_part(self, index: int) -> None:
        self._states = self._executor.forward_layers(self._states, [batch.metadata for batch in self._inputs],
                                                     self._order, self._parts[index])

    def _logits(self) -> torch.Tensor:
        model = self._executor.model
        hidden = [model.final_norm(state.hidden[batch.logits_indices], state.residual[batch.logits_indices])
                  for state, batch in zip(self._states, self._inputs)]
        logits = self._executor.compute_logits(torch.cat(hidden) if len(hidden) > 1 else hidden[0])
        self._executor.end()
        return logits


@dataclass
class _QueuedParts:
    """A batch whose parts are being queued (a graph replay or an eager walk), and an event
    recorded after each queued part but the last (on CUDA)."""

    walk: LayerPartWalk
    ends: list[torch.cuda.Event]


@dataclass
class _InFlight:
    requests: list[Request]
    started: torch.cuda.Event | None  # timing events on the host stream
    launched_at: float
    replayed_graph: bool
    parts: _QueuedParts | None = None  # parts still to queue; None once the sampling is queued
    tokens: torch.Tensor | None = None  # int64 [n], on the host once ``done`` has passed
    done: torch.cuda.Event | None = None  # None: completed at launch
    ended: torch.cuda.Event | None = None
    host_seconds: float | None = None  # known at launch when it ran to completion
    logprobs: TokenLogprobs | None = None  # on the device until ``done`` has passed
    wait_seconds: float = 0.0  # spent in ``collect`` waiting for it
    failure: Exception | None = None  # raised queuing a later part: the batch is over
    host_failures: torch.Tensor | None = None  # the ranks' host failure flags, above one rank


class HostBatchRunner:
    """Launches one host batch at a time and hands back its tokens once it has completed."""

    def __init__(self, model, kv_cache: KVCache, host_kernels: HostKernels, worker: HostAttentionWorker,
                 device: torch.device, max_decodes: int, max_blocks_per_sequence: int, graph_context: int | None,
                 pad_rows: bool = False, layers_per_part: int = DEFAULT_LAYERS_PER_PART,
                 order: StageOrder = HOST_BATCH):
        """``graph_context``: replay pipeline graphs for batches whose contexts are at most that
        many tokens (None: never). ``pad_rows``: pad GEMM rows to ``neo.runner.gemm_rows`` buckets.
        ``layers_per_part``: the most layers one part (graph or eager walk) holds (at least 1).
        ``order``: the batches' stage order (``EngineConfig.host_batch_order``); a batch goes
        through it in the sub-batches ``host_batch_sub_batches`` gives."""
        self.order = order
        parts = layer_parts(len(model.layers), layers_per_part)
        self.parts = parts
        self.model = model
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.executor = PipelineExecutor(model, kv_cache, device, host_kernels, worker, max_host_decodes=max_decodes,
                                         max_blocks_per_sequence=max_blocks_per_sequence, pad_rows=pad_rows)
        self.asynchronous = self.executor.stream_ordered_host_work
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.graphs = None
        self.graph_shapes = []
        if self.asynchronous and graph_context is not None:
            self.graph_shapes = host_batch_shapes(order, max_decodes)
            self.graphs = PipelineGraphs(model, self.executor, max_decodes, graph_context, self.block_size, device,
                                         capacity=max(DEFAULT_CAPACITY, len(self.graph_shapes)), parts=parts)
        self.sampler = Sampler()
        # The sampled tokens of the batch in flight land here (allocated once: allocating
        # page-locked memory waits for the whole device, the batch just queued included).
        self.token_buffer = (torch.empty(max_decodes, dtype=torch.int64, pin_memory=True)
                             if self.stream is not None else None)
        self._in_flight: _InFlight | None = None
        self.part_launches = 0  # parts queued so far, over all batches
        # The driver of several tensor-parallel ranks: told the count of the batch's parts queued
        # so far each time it grows (the other ranks queue theirs up to it).
        self.on_parts_queued: Callable[[int], None] | None = None
        self._following: LayerPartWalk | None = None  # a rank that follows: the batch it walks

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def capture_graphs(self) -> int:
        """Capture the graphs of every shape a host batch can replay (``host_batch_shapes``),
        largest first, in the context a batch is queued in; returns how many are captured (0
        without graphs; fewer when a capture failed and turned the graphs off). Every rank
        captures the same shapes in the same order, as it builds its runner."""
        if self.graphs is None:
            return 0
        with self._on_host_stream():
            for order, shape in self.graph_shapes:
                if not self.graphs.capture(shape, order):
                    return 0
        return len(self.graph_shapes)

    def launch(self, batch: SubBatch) -> None:
        """Queue the batch (host decodes only; their slots made) on the host stream: its first
        two graph parts, or the whole batch where no graph replays."""
        if self._in_flight is not None:
            raise RuntimeError("a host batch is already in flight")
        if batch.prefills or batch.gpu_decodes or not batch.host_decodes:
            raise ValueError("a host batch holds host decodes only")
        launched_at = time.perf_counter()
        with self._on_host_stream():
            started = self._timing_event()
            walk = self._start(batch)
            flight = _InFlight(batch.host_decodes, started, launched_at, isinstance(walk, PartReplay),
                               parts=_QueuedParts(walk, []))
            self._queue_due_parts(flight, most=PARTS_PENDING if self.asynchronous else None)
        if not self.asynchronous:  # it ran to completion here
            if flight.done is not None:
                flight.done.synchronize()
            flight.done = None
            flight.host_seconds = self.executor.host_busy_seconds()
        self._in_flight = flight

    def advance(self) -> None:
        """Queue the next graph parts of the batch in flight whose turn has come (each once the
        part two before it has completed), and the sampling behind the last part; does nothing
        when no batch is in flight or all its parts are queued. Never waits for the device; what
        fails here ends the batch and is raised by ``collect``."""
        flight = self._in_flight
        if flight is None or flight.parts is None:
            return
        try:
            with self._on_host_stream():
                self._queue_due_parts(flight)
        except Exception as error:
            flight.parts = None
            flight.failure = error

    def follow(self, batch: SubBatch) -> None:
        """A tensor-parallel rank other than the driver: start walking a host batch received
        from it (``neo.runner.rank_plan``); its parts are queued as ``follow_parts`` says. The
        batch before it has completed on the driver, so here it has all but ended: its end is
        waited for, and what failed in its host work raised."""
        self._end_following()
        with self._on_host_stream():
            self._following = self._start(batch)

    def follow_parts(self, count: int) -> None:
        """A rank that follows: queue the parts of its batch up to the first ``count`` (as many
        as the driver has queued), and once all are queued its logits, which only join the
        driver's (the driver samples)."""
        walk = self._following
        if walk is None:
            raise RuntimeError(f"told to queue {count} parts of a host batch, but none was launched")
        if not walk.queued <= count <= walk.num_parts:
            raise RuntimeError(f"told to queue {count} parts of a host batch of {walk.num_parts}, "
                               f"{walk.queued} already queued")
        with self._on_host_stream():
            self.part_launches += count - walk.queued
            while walk.queued < count:
                walk.queue_next()
            if walk.all_queued:
                reduce_host_failures(self.model, self.executor)
                walk.logits()
        if walk.all_queued and not self.asynchronous:  # it ran to completion here
            self._end_following()

    def _end_following(self) -> None:
        """A rank that follows: wait for the batch it walks (all of whose parts were queued)
        and raise what failed in its host work."""
        walk, self._following = self._following, None
        if walk is None:
            return
        if not walk.all_queued:
            raise RuntimeError(f"a host batch was launched while {walk.num_parts - walk.queued} "
                               f"parts of the one before were not queued")
        if self.stream is not None:
            self.stream.synchronize()
        self.executor.raise_host_failure()

    def _start(self, batch: SubBatch) -> LayerPartWalk:
        """The batch's inputs loaded for a walk in parts: a graph replay where one fits, else
        an eager walk."""
        order, parts = host_batch_sub_batches(self.order, len(batch.host_decodes))
        inputs = [build_batch_inputs(SubBatch(host_decodes=batch.host_decodes[part]), self.block_size, self.device,
                                     self.executor.pad_rows) for part in parts]
        shape = self.graphs.shape(inputs) if self.graphs is not None else None
        replay = self.graphs.start(inputs, shape, order) if shape is not None else None
        return replay if replay is not None else EagerParts(self.executor, inputs, order, self.parts)

    def ready(self) -> bool:
        """Whether a launched batch has completed (False when none is in flight); queues its
        next parts first (``advance``)."""
        flight = self._in_flight
        if flight is None:
            return False
        self.advance()
        if flight.failure is not None:
            return True
        return flight.parts is None and (flight.done is None or flight.done.query())

    def collect(self, wait_seconds: float) -> HostBatchOutput | None:
        """The batch in flight once it has completed, waiting up to ``wait_seconds`` for it;
        None when none is in flight or it is still running. Raises what failed in its host work
        (the batch is over either way)."""
        flight = self._in_flight
        if flight is None:
            return None
        waited = time.perf_counter()
        deadline = waited + wait_seconds
        while not self.ready() and time.perf_counter() < deadline:
            time.sleep(POLL_SECONDS)
        flight.wait_seconds += time.perf_counter() - waited
        if not self.ready():
            return None
        self._in_flight = None
        if flight.failure is not None:
            # The parts queued before it, and any host work of the part that failed, still use
            # the batch's buffers.
            for stream in (self.stream, self.executor.copy_stream):
                if stream is not None:
                    stream.synchronize()
            raise flight.failure
        if flight.done is not None:
            flight.done.synchronize()
        self.executor.raise_host_failure()
        raise_other_rank_failure(flight.host_failures)
        if flight.logprobs is not None:
            flight.logprobs.record(flight.requests)
        if flight.started is not None and flight.ended is not None:
            seconds = flight.started.elapsed_time(flight.ended) / 1e3
        else:
            seconds = time.perf_counter() - flight.launched_at
        host_seconds = flight.host_seconds if flight.host_seconds is not None else self.executor.host_busy_seconds()
        return HostBatchOutput(flight.requests, flight.tokens.tolist(), seconds, host_seconds or 0.0,
                               flight.replayed_graph, flight.wait_seconds)

    def _queue_due_parts(self, flight: _InFlight, most: int | None = None) -> None:
        """Queue the parts whose turn has come, at most ``most`` of them (None: no limit): where
        host work is ordered on streams, a part once the part ``PARTS_PENDING`` before it has
        completed (the first ``PARTS_PENDING`` at once); elsewhere every part, each having
        completed when queued. An event follows each part but the last, and the sampling
        follows the last. ``on_parts_queued`` hears the new count first, so the other ranks
        queue the same parts whatever order their collectives need."""
        parts = flight.parts
        walk = parts.walk
        due = walk.num_parts - walk.queued if most is None else min(most, walk.num_parts - walk.queued)
        if self.asynchronous:
            ready = 0
            while ready < due:
                before = walk.queued + ready - PARTS_PENDING  # the part that must have completed
                if before >= walk.queued or (before >= 0 and not parts.ends[before].query()):
                    break
                ready += 1
            due = ready
        if due == 0:
            return
        if self.on_parts_queued is not None:
            self.on_parts_queued(walk.queued + due)
        for _ in range(due):
            walk.queue_next()
            if self.asynchronous and not walk.all_queued:
                parts.ends.append(torch.cuda.Event())
                parts.ends[-1].record()
        self.part_launches += due
        if walk.all_queued:
            flight.parts = None
            flight.host_failures = reduce_host_failures(self.model, self.executor)
            self._queue_sampling(flight, walk.logits())

    def _queue_sampling(self, flight: _InFlight, logits: torch.Tensor) -> None:
        """Sample the batch's tokens from its float32 ``logits [requests, vocab]`` and, on CUDA,
        copy them to pinned memory behind the ``ended`` and ``done`` events (on the host stream)."""
        requests = flight.requests
        sampled = self.sampler(process_logits(logits, requests), [r.sampling_params for r in requests],
                               [r.generator for r in requests])
        flight.logprobs = TokenLogprobs.compute(logits, sampled, requests)
        if self.stream is None:
            flight.tokens = sampled
            return
        flight.tokens = self.token_buffer[:len(requests)]
        flight.tokens.copy_(sampled, non_blocking=True)
        flight.ended = self._timing_event()
        flight.done = torch.cuda.Event()
        flight.done.record()

    @contextmanager
    def _on_host_stream(self):
        """The context a batch's work is queued in: the host stream (on CUDA), the side group's
        collectives, inference mode."""
        with (torch.cuda.stream(self.stream) if self.stream is not None else nullcontext(),
              self.model.parallel.on_side_group(), torch.inference_mode()):
            yield

    def _timing_event(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
