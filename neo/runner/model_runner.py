"""``ModelRunner``: executes a plan. It never decides anything the scheduler must predict: which
plans replay a captured CUDA graph is answered by its ``GraphCoverage``, which the scheduler
reads too."""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from neo.kv.kv_cache import KVCache
from neo.sched.graph_coverage import GraphCoverage
from neo.sched.runner_output import HostBatchOutput, IterationOutput
from neo.sched.scheduler_output import SchedulerOutput, SubBatch
from neo.sched.stage_order import StageOrder

from .batch_inputs import build_batch_inputs
from .decode_graphs import DecodeGraphs
from .executor import IterationTiming, PipelineExecutor
from .host_batches import HostBatchRunner
from .host_failures import raise_other_rank_failure, reduce_host_failures
from .logits_processors import process_logits
from .pipeline_graphs import PipelineGraphs
from .rank_plan import PlanChannel
from .sampled_tokens import HostTokenBuffers, PreviousTokens, SampledTokens
from .sampler import Sampler
from .token_logprobs import TokenLogprobs

# The range each iteration's launch (and, on the other ranks, its execution) shows as in a
# torch.profiler timeline (``neo.engine.torch_profiler``).
ITERATION_LABEL = "neo.iteration"


def block_pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    """int64 host ``[n, 2]`` (source block, destination block) rows."""
    return torch.tensor(pairs, dtype=torch.int64).reshape(len(pairs), 2)


@dataclass
class LaunchedIteration:
    """An iteration whose device work is queued (``ModelRunner.launch``); ``tokens`` None when it
    had no sub-batch. ``requests`` in logit-row order (``plan.requests`` order); ``began`` and
    ``queue_seconds``: when the launch began and how long queuing took; ``timing``: the
    executor's events, for its GPU busy time (None when a decode graph replayed);
    ``host_failures``: the ranks' host failure flags (``reduce_host_failures``), where it
    touched the host pool above one rank."""

    requests: list
    tokens: SampledTokens | None
    logprobs: TokenLogprobs | None
    began: float
    queue_seconds: float
    decode_graph: bool
    replayed: bool
    timing: IterationTiming | None
    host_failures: torch.Tensor | None = None

    def ready(self) -> bool:
        """Whether its tokens can be read without waiting."""
        return self.tokens is None or self.tokens.ready()

    def previous_tokens(self) -> PreviousTokens | None:
        """Its samples, as the next iteration's ``previous``."""
        return None if self.tokens is None else PreviousTokens(self.tokens.on_device, self.requests)


class ModelRunner:
    """Builds each sub-batch's inputs, runs the executor (or replays a graph), samples one token
    per request.

    Under tensor parallelism every rank has one, over its shard of the model and its KV pools:
    the driver's (rank 0) sends each plan through ``plan_channel`` before executing it and
    samples; the others execute the plans they receive with ``follow`` (``rank_plan.py``)."""

    def __init__(self, model, kv_cache: KVCache, executor: PipelineExecutor, device: torch.device,
                 stage_orders: dict[int, StageOrder], decode_graphs: DecodeGraphs | None = None,
                 pipeline_graphs: PipelineGraphs | None = None, host_batches: HostBatchRunner | None = None,
                 plan_channel: PlanChannel | None = None, max_sampled_rows: int = 1, share_samples: bool = False):
        """``stage_orders``: the order of a plan of that many sub-batches that names none.
        ``host_batches``: runs the host batches of the async host pipeline (None: lockstep).
        ``plan_channel``: on the driver of several ranks, where each plan goes first (None: one
        rank, or a rank that follows). ``max_sampled_rows``: the most tokens an iteration samples
        (the page-locked buffers they are read through are allocated for that many now).
        ``share_samples``: every iteration's samples go from the driver to every rank on the
        device (async scheduling over several ranks: a plan made before the tokens of the one
        before were read leaves them unresolved, and every rank takes them from there)."""
        self.model = model
        self.kv_cache = kv_cache
        self.executor = executor
        self.device = device
        self.stage_orders = stage_orders
        self.decode_graphs = decode_graphs
        self.pipeline_graphs = pipeline_graphs
        self.host_batches = host_batches
        self.plan_channel = plan_channel
        self.share_samples = share_samples
        self._followed_samples: PreviousTokens | None = None  # a following rank's copy of the last samples
        if host_batches is not None:
            host_batches.on_parts_queued = self._send_host_batch_parts
        self.block_size = kv_cache.layout.block_size
        self.sampler = Sampler()
        self.host_token_buffers = HostTokenBuffers(device, max_sampled_rows)
        # Both kinds of graphs are captured for the same context (``EngineConfig.cuda_graph_max_context``).
        self.graph_coverage = GraphCoverage(
            decode_max_requests=decode_graphs.sizes[-1] if decode_graphs is not None else 0,
            pipeline_max_requests=pipeline_graphs.sizes[-1] if pipeline_graphs is not None else 0,
            max_blocks=decode_graphs.max_blocks if decode_graphs is not None else 0,
            host_batch_max_requests=(host_batches.graphs.sizes[-1]
                                     if host_batches is not None and host_batches.graphs is not None else 0))

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, on_launched: Callable[[], None] | None = None) -> IterationOutput:
        """Run the plan's sub-batches and swaps; returns the sampled token of each request in
        ``plan.requests`` order, with what was measured (the requests that ask for
        log-probabilities get them recorded). ``on_launched`` is called once the
        device work (sampling included) is queued, before waiting for the tokens."""
        return self.collect(self.launch(plan, on_launched))

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, on_launched: Callable[[], None] | None = None,
               previous: PreviousTokens | None = None, read_later: bool = False) -> LaunchedIteration:
        """Queue the plan's device work up to the sampled tokens, then call ``on_launched``.
        ``previous``: the samples of the iteration launched before, which the requests whose
        newest token is unresolved take as input (async scheduling). ``read_later``: copy the
        tokens to page-locked host memory behind the sampling, for a ``collect`` after the next
        launch."""
        with torch.profiler.record_function(ITERATION_LABEL):
            return self._launch(plan, on_launched, previous, read_later)

    def _launch(self, plan: SchedulerOutput, on_launched: Callable[[], None] | None,
                previous: PreviousTokens | None, read_later: bool) -> LaunchedIteration:
        began = time.perf_counter()
        if self.plan_channel is not None:
            self.plan_channel.send_plan(plan)
        logits, requests, decode_graph, replayed = self._forward(plan, previous)
        if logits is None:
            if on_launched is not None:
                on_launched()
            return LaunchedIteration([], None, None, began, time.perf_counter() - began, False, False, None)
        host_failures = None
        if self.model.parallel.size > 1 and plan.touches_host_pool:  # one rank: no look at the requests
            host_failures = reduce_host_failures(self.model, self.executor)
        sampled = self.sampler(process_logits(logits, requests), [r.sampling_params for r in requests],
                               [r.generator for r in requests])
        if self.share_samples:  # every rank calls this in the same order: the profiler's samples too
            self.model.parallel.broadcast_from_driver(sampled)
        logprobs = TokenLogprobs.compute(logits, sampled, requests)
        tokens = self.host_token_buffers.start_copy(sampled) if read_later else SampledTokens(sampled, sampled, None)
        queue_seconds = time.perf_counter() - began
        if on_launched is not None:
            on_launched()
        # A decode graph replays no executor work: no GPU busy time measured.
        return LaunchedIteration(requests, tokens, logprobs, began, queue_seconds, decode_graph, replayed,
                                 None if decode_graph else self.executor.timing(), host_failures)

    def collect(self, launched: LaunchedIteration) -> IterationOutput:
        """Wait for a launched iteration's tokens (not for work queued after them); returns them
        in ``plan.requests`` order with what was measured, the log-probabilities recorded."""
        if launched.tokens is None:
            elapsed = time.perf_counter() - launched.began
            return IterationOutput([], elapsed, 0.0, elapsed)
        tokens = launched.tokens.tolist()
        self.executor.raise_host_failure()
        raise_other_rank_failure(launched.host_failures)
        if launched.logprobs is not None:
            launched.logprobs.record(launched.requests)
        return IterationOutput(tokens, time.perf_counter() - launched.began,
                               0.0 if launched.decode_graph else self.executor.host_busy_seconds(),
                               launched.queue_seconds,
                               None if launched.timing is None else self.executor.gpu_busy_seconds(launched.timing),
                               launched.replayed)

    @torch.inference_mode()
    def follow(self, plan: SchedulerOutput) -> None:
        """A rank other than the driver: execute a plan received from it (``rank_plan.planned``,
        whole block tables restored by ``PlanChannel.receive``) over this rank's shard, its
        logits only joining the driver's (the driver samples; with ``share_samples`` its samples
        arrive here for the next plan's unresolved tokens).

        An iteration that touches the host pool (``SchedulerOutput.touches_host_pool``) is waited
        for (its stream only, not a host batch beside it) and its host failure raised before the
        next message is taken: a host batch reads what it wrote there, and its host work's
        buffers and failure flag serve the next iteration too (the driver, likewise, reads such
        an iteration's tokens before it plans on). Any other iteration is not waited for: the
        next plan is built while it runs, as on the driver."""
        with torch.profiler.record_function(ITERATION_LABEL):
            self._follow(plan)

    def _follow(self, plan: SchedulerOutput) -> None:
        logits, requests, _, _ = self._forward(plan, self._followed_samples)
        if logits is None:
            return
        touches_host_pool = plan.touches_host_pool
        if touches_host_pool:
            reduce_host_failures(self.model, self.executor)
        if self.share_samples:
            samples = torch.empty(len(requests), dtype=torch.int64, device=self.device)
            self._followed_samples = PreviousTokens(self.model.parallel.broadcast_from_driver(samples), requests)
        if touches_host_pool:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.executor.raise_host_failure()

    def _forward(self, plan: SchedulerOutput,
                 previous: PreviousTokens | None = None) -> tuple[torch.Tensor | None, list, bool, bool]:
        """The plan's swaps and sub-batches up to the logits: ``(logits [requests, vocab] float32,
        the requests in logit-row order, whether a decode graph replayed, whether any graph
        replayed)``; logits None when the plan has no sub-batch (its swaps are done).
        ``previous``: see ``launch``."""
        sub_batches = [batch for batch in plan.sub_batches if batch]
        swaps = plan.has_swaps
        if not sub_batches:
            if swaps:
                self.swap(plan)
            return None, [], False, False
        batches = [build_batch_inputs(batch, self.block_size, self.device, self.executor.pad_rows, previous)
                   for batch in sub_batches]
        requests = [request for inputs in batches for request in inputs.requests]
        logits = None
        decode_graph = self.graph_coverage.replays_decode_graph(sub_batches)
        order = plan.stage_order or self.stage_orders[len(batches)]
        shape = None
        if not decode_graph and self.graph_coverage.replays_pipeline_graph(sub_batches):
            shape = self.pipeline_graphs.shape(batches)
        if swaps and (decode_graph or shape is not None):
            self.swap(plan)  # a graph cannot wait for each layer's copies as the eager walk does
            swaps = False
        if decode_graph:
            # No host work: clear the host failure an earlier iteration left (already raised),
            # which ``collect`` and the ranks' reduction would otherwise read as this one's.
            self.executor.prepare([])
            logits = self.decode_graphs.run(batches[0])
        elif shape is not None:
            logits = self.pipeline_graphs.run(batches, shape, order)
            if logits is None:  # the capture failed: these iterations run eagerly from now on
                self.graph_coverage.pipeline_max_requests = 0
        replayed = logits is not None
        if logits is None:
            copies = (plan.swap_out, plan.swap_in) if swaps else ([], [])  # none if copied above
            logits = self.executor.run(batches, order, *map(block_pairs, copies))
        return logits, requests, decode_graph, replayed

    def launch_host_batch(self, batch: SubBatch) -> None:
        """Launch a host batch on its own stream (async host pipeline)."""
        if self.host_batches is None:
            raise RuntimeError("this engine runs no host batches (host_pipeline is not 'async')")
        if self.plan_channel is not None:
            self.plan_channel.send_host_batch(batch)
        self.host_batches.launch(batch)

    def follow_host_batch(self, batch: SubBatch) -> None:
        """A rank other than the driver: start a host batch received from it over this rank's
        shard (async host pipeline); ``follow_host_batch_parts`` queues its parts."""
        self.host_batches.follow(batch)

    def follow_host_batch_parts(self, count: int) -> None:
        """A rank other than the driver: queue the host batch's layer parts up to ``count``, as
        many as the driver has queued."""
        self.host_batches.follow_parts(count)

    def _send_host_batch_parts(self, count: int) -> None:
        """The driver: tell the other ranks that ``count`` parts of its host batch are queued
        (not while profiling, when each rank paces its own)."""
        if self.plan_channel is not None:
            self.plan_channel.send_parts(count)

    def advance_host_batch(self) -> None:
        """Queue the next layer parts of the host batch in flight whose turn has come
        (``HostBatchRunner.advance``); nothing without one."""
        if self.host_batches is not None:
            self.host_batches.advance()

    @property
    def host_batch_in_flight(self) -> bool:
        return self.host_batches is not None and self.host_batches.in_flight

    def host_batch_ready(self) -> bool:
        """Whether the host batch in flight has completed (``HostBatchRunner.ready``, which
        queues its due layer parts first); False without one."""
        return self.host_batches is not None and self.host_batches.ready()

    def collect_host_batch(self, wait_seconds: float) -> HostBatchOutput | None:
        """The host batch in flight once it has completed, waiting up to ``wait_seconds`` for
        it; None if none is in flight or it is still running."""
        if not self.host_batch_in_flight:
            return None
        return self.host_batches.collect(wait_seconds)

    def release_graphs(self) -> None:
        """Free the decode, pipeline and host-batch graphs once the last iteration has completed
        (the runner executes nothing after this): a rank must, before it leaves its
        tensor-parallel group, since those graphs hold the model's collectives
        (``DecodeGraphs.release``). No device-wide wait here: after a rank failed, a collective
        on the stream may never complete."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
            self.decode_graphs = None
        if self.pipeline_graphs is not None:
            self.pipeline_graphs.release()
            self.pipeline_graphs = None
        if self.host_batches is not None and self.host_batches.graphs is not None:
            self.host_batches.graphs.release()
            self.host_batches.graphs = None

    def swap(self, plan: SchedulerOutput) -> None:
        """Copy the plan's swapped blocks, every layer, on the current stream: work queued after
        this (a graph replay, which cannot wait for them layer by layer as an eager walk does)
        sees them moved."""
        self.kv_cache.swap(block_pairs(plan.swap_out), block_pairs(plan.swap_in))
