"""``neo profile``: measure this machine's stage times into a ``PerfTable``.

Measured through the engine's own runner (its model, KV pools, kernels and host side), every
layer on its own cache, with block tables laid out as the block manager hands out fresh blocks
(each request's blocks consecutive):

- linear: pre- and post-attention stages of every layer for a sub-batch of T decode tokens;
- gpu_attention: paged decode attention over the GPU pool vs context tokens;
- prefill_attention: prefill attention of one prompt vs its length;
- host_attention: host K/V store + decode attention vs (requests, context tokens), timed inside
  real iterations of host decodes through the engine's executor (the host functions' own
  time), so the figure is what the engine's host work costs, hand-off included; the points are
  measured in rounds (``_host_attention_table``);
- pipeline_overhead / iteration_overhead: the overheads that make the cost function
  (``neo.sched.cost``, with the engine's stage orders) meet the measured time of small real
  plans (launches, hand-offs, copies, input preparation); pipeline_graph_overhead: the same
  two-sub-batch plan replayed from a pipeline CUDA graph; host_batch_overhead: a small host
  batch of the async host pipeline, launched and collected (engines with that pipeline);
- graph_decode: whole decode-only iterations of short requests through the engine's runner,
  which replays its CUDA graphs for them (when the engine has graphs). Under async scheduling
  they are launched as the engine launches them, each before the tokens of the one before are
  read, and timed from one read to the next: the input preparation of one iteration overlaps
  the device's previous one, so a replay costs its device time, not that plus the launch.

The table is keyed by model shape (and tensor-parallel rank count, the host-batch order
where it is not ``host-batch``, and synchronous scheduling where the engine does not schedule
ahead), dtype, device, block size, host threads, the CPU attention
kernel, the two-sub-batch stage order and the compiled kernels' builds (a digest of each
extension file: rebuilt kernels are profiled again), and cached under ``$NEO_CACHE_DIR``
(default ``~/.cache/neo``) so the engine profiles once per machine (and again for an engine
whose limits or pools reach beyond the cached table's points).
"""

import hashlib
import json
import logging
import os
import random
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from neo.models.attention_metadata import AttentionMetadata
from neo.models.config import ModelConfig
from neo.ops import build_fingerprints, ispc_bf16_decode_variant
from neo.request import KVLocation, Request
from neo.sampling_params import SamplingParams
from neo.sched.block_manager import BlockManager
from neo.sched.cost import StageTimes, iteration_seconds
from neo.sched.perf_model import PerfModel, PerfTable
from neo.sched.scheduler_output import SchedulerOutput, SubBatch
from neo.sched.stage_order import HOST_BATCH, SEQUENTIAL, StageOrder, host_batch_sub_batches

from .model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Part of the table key: a change to how stages are measured invalidates cached tables.
PROFILE_METHOD = 10


def cache_directory() -> str:
    root = os.environ.get("NEO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "neo")
    return os.path.join(root, "perf")


def pre_fraction(model: ModelConfig) -> float:
    """The QKV projection's share of a layer's GEMM weights: of a sub-batch's linear time, the
    part in ``pre`` (decode GEMMs read every weight once; prefill GEMMs' work grows with them)."""
    qkv = model.hidden_size * (model.q_size + 2 * model.kv_size)
    rest = model.q_size * model.hidden_size + 3 * model.hidden_size * model.intermediate_size
    return qkv / (qkv + rest)


PROBE_LENGTH = 256


@dataclass(frozen=True)
class ProfileLimits:
    """The engine's limits the tables must reach."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int

    @property
    def probe_length(self) -> int:
        """Tokens of each request of the small plans the overheads are measured with: 256, or
        the longest a request may be in a shorter context."""
        return min(PROBE_LENGTH, self.max_model_len - 1)


def load_perf_model(setting: str, profiler: "Profiler") -> PerfModel:
    """The perf model the engine's scheduler uses (see ``EngineConfig.perf_model``): ``zero``,
    a table's path, or ``auto`` (the cached table of this machine and engine, profiled with
    ``profiler`` when there is none or it does not reach the engine's limits)."""
    if setting == "zero":
        return PerfModel.zero()
    if setting != "auto":
        table = PerfTable.load(setting)
        if table.key != profiler.key():
            logger.warning("perf model %s was measured for %s, not for this engine (%s)",
                           setting, table.key, profiler.key())
        return PerfModel(table)
    path = profiler.default_path()
    if os.path.exists(path):
        cached = PerfTable.load(path)
        missing = profiler.uncovered(cached)
        if not missing:
            return PerfModel(cached)
        logger.warning("the cached perf model %s does not reach this engine's %s: profiling again",
                       path, ", ".join(missing))
    else:
        logger.warning("no perf model for this machine yet: profiling (once; cached in %s)", path)
    table = profiler.run()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    table.save(path)
    return PerfModel(table)


def _geometric(low: int, high: int, factor: float = 2.0) -> list[int]:
    points, value = [], low
    while value < high:
        points.append(int(value))
        value *= factor
    points.append(high)
    return sorted(set(points))


class Profiler:
    """Measures stage times through a runner whose pools are empty."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, limits: ProfileLimits, host_threads: int,
                 host_kernel: str, stage_order: StageOrder, repeats: int = 3,
                 host_batch_order: StageOrder = HOST_BATCH, schedules_ahead: bool = True):
        """``host_threads``, ``host_kernel``: the host side's threads and CPU attention kernel;
        ``stage_order``: the lockstep pipeline's two-sub-batch order (part of the key);
        ``host_batch_order``: the async host pipeline's (part of the key unless ``host-batch``:
        the host batch overhead is measured in it); ``schedules_ahead``: whether the engine
        launches each iteration before reading the tokens of the one before
        (``EngineConfig.schedules_ahead``; part of the key when not): graph decodes are timed
        so."""
        self.runner = runner
        self.block_manager = block_manager
        self.limits = limits
        self.host_threads = host_threads
        self.host_kernel = host_kernel
        self.host_batch_order = host_batch_order
        self.stage_order = stage_order
        self.schedules_ahead = schedules_ahead
        self.repeats = repeats
        self.model = runner.model
        self.model_config: ModelConfig = runner.model.config
        self.rank_config: ModelConfig = runner.model.rank_config  # the heads this rank attends over
        self.layout = runner.kv_cache.layout
        self.device = runner.device
        self.rng = random.Random(0)

    def key(self) -> dict:
        """What the table is measured on: a cached table serves only an engine of the same key.
        An engine of several tensor-parallel ranks adds their number (its stages run one rank's
        shapes and the collectives)."""
        model = self.model_config
        size = self.model.parallel.size
        order = self.host_batch_order
        batch_order = {"host_batch_order": order.name} if order is not HOST_BATCH else {}
        synchronous = {} if self.schedules_ahead else {"schedules_ahead": False}
        # The ISPC kernel's bf16 variant is chosen at each call (NEO_CPU_DECODE_ATTENTION_VARIANT).
        variant = ({"cpu_attention_variant": ispc_bf16_decode_variant()}
                   if self.host_kernel == "ispc" and self.layout.dtype == torch.bfloat16 else {})
        return ({"tensor_parallel_size": size} if size > 1 else {}) | batch_order | synchronous | variant | {
            "model_shape": model.shape_key,
            "dtype": str(self.layout.dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "block_size": self.layout.block_size,
            "cpu_threads": self.host_threads,
            "cpu_attention_kernel": self.host_kernel,
            "stage_order": self.stage_order.name,
            "method": PROFILE_METHOD,
            "kernels": build_fingerprints(),
        }

    def default_path(self) -> str:
        """The table's place in the cache."""
        digest = hashlib.sha256(json.dumps(self.key(), sort_keys=True).encode()).hexdigest()[:16]
        return os.path.join(cache_directory(), f"{digest}.json")

    def _points(self) -> dict[str, list[int]]:
        """The points each table is measured at, from this engine's limits and pools."""
        max_tokens = self.limits.max_num_batched_tokens
        gpu_capacity = self.layout.num_gpu_blocks * self.layout.block_size
        host_capacity = self.layout.num_host_blocks * self.layout.block_size
        return {
            "batched tokens": _geometric(1, max_tokens),
            "GPU context": _geometric(256, max(256, min(gpu_capacity, 1 << 20)), 4.0) if gpu_capacity >= 256 else [],
            "prompt length": _geometric(16, min(max_tokens, self.limits.max_model_len - 1), 2.0),
            # Up to max_num_seqs itself, the most a host batch or sub-batch holds: the table
            # extrapolates past its last row.
            "host requests": [r for r in (1, 8, 32, 128, 512) if r < self.limits.max_num_seqs]
                             + [self.limits.max_num_seqs],
            "host context": _geometric(256, max(256, min(host_capacity, 1 << 21)), 4.0) if host_capacity >= 256 else [],
            "graph batch": self._graph_decode_points(),
        }

    def uncovered(self, table: PerfTable) -> list[str]:
        """What this engine would measure beyond the largest point of ``table`` (a table
        profiled for smaller limits or pools extrapolates there)."""
        points = self._points()
        wanted = {name: max(values, default=0) for name, values in points.items()}
        if points["host context"]:  # what is measured there: equal lengths within the limits
            wanted["host context"] = max(sum(self._host_lengths(requests, wanted["host context"]))
                                         for requests in points["host requests"])
        reached = {
            "batched tokens": max(table.linear_tokens, default=0),
            "GPU context": max(table.gpu_attention_tokens, default=0),
            "prompt length": max(table.prefill_lengths, default=0),
            "host requests": max(table.host_attention_requests, default=0),
            "host context": max((max(row) for row in table.host_attention_tokens if row), default=0),
            "graph batch": max(table.graph_decode_requests, default=0),
        }
        return [f"{name} (up to {wanted[name]}, profiled up to {int(reached[name])})"
                for name in points if wanted[name] > reached[name]]

    def run(self) -> PerfTable:
        """Measure every stage-time point. On the driver of several tensor-parallel ranks the
        others are told to run their own profilers now: every rank measures the same points in
        the same order, meeting in the model's collectives, while the driver's runner sends no
        plans."""
        channel = self.runner.plan_channel
        if channel is None:
            return self._measure()
        channel.send(("profile", None))
        self.runner.plan_channel = None
        try:
            return self._measure()
        finally:
            self.runner.plan_channel = channel

    def _measure(self) -> PerfTable:
        table = PerfTable(key=self.key(), pre_fraction=pre_fraction(self.model_config))
        points = self._points()
        token_points, gpu_context_points = points["batched tokens"], points["GPU context"]
        prefill_points, request_points = points["prompt length"], points["host requests"]
        host_context_points, graph_points = points["host context"], points["graph batch"]
        host_rows = self._host_points(request_points, host_context_points)
        steps = (len(token_points) + len(gpu_context_points) + len(prefill_points)
                 + (self.repeats + 1) * sum(len(row) for row in host_rows) + 3 + len(graph_points))
        # One progress bar: the driver's (the other ranks measure the same points in lockstep).
        with tqdm(total=steps, desc="profiling stage times", unit="point",
                  disable=self.model.parallel.rank != 0) as progress:
            for tokens in token_points:
                table.linear_tokens.append(tokens)
                table.linear_seconds.append(self._time(lambda: self._linear(tokens)))
                progress.update(1)
            for context in gpu_context_points:
                table.gpu_attention_tokens.append(context)
                table.gpu_attention_seconds.append(self._gpu_attention(context))
                progress.update(1)
            for length in prefill_points:
                table.prefill_lengths.append(length)
                table.prefill_seconds.append(self._prefill_attention(length))
                progress.update(1)
            table.host_attention_requests = list(request_points)
            table.host_attention_tokens, table.host_attention_seconds = self._host_attention_table(
                host_rows, progress)
            model = PerfModel(table)
            table.iteration_overhead = self._iteration_overhead(model)
            progress.update(1)
            table.pipeline_overhead, table.pipeline_graph_overhead = self._pipeline_overheads(model)
            progress.update(1)
            table.host_batch_overhead = self._host_batch_overhead(model)
            progress.update(1)
            table.graph_decode_context = self._graph_decode_context()
            for requests in graph_points:
                table.graph_decode_requests.append(requests)
                table.graph_decode_seconds.append(self._graph_decode(requests))
                progress.update(1)
        return table

    # -- timing --------------------------------------------------------------------------------

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time(self, function) -> float:
        """Median wall time of ``function`` (after one warm-up), device work included."""
        function()
        self._synchronize()
        samples = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            function()
            self._synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    # -- stages --------------------------------------------------------------------------------

    def _metadata(self, num_tokens: int) -> AttentionMetadata:
        device = self.device
        empty_int = torch.empty(0, dtype=torch.int32, device=device)
        return AttentionMetadata(
            num_prefill_tokens=0, num_gpu_decodes=num_tokens, num_host_decodes=0,
            positions=torch.randint(0, self.limits.max_model_len, (num_tokens,), device=device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device), max_prefill_len=0,
            gpu_block_table=torch.empty((0, 0), dtype=torch.int32, device=device), gpu_seq_lens=empty_int,
            host_block_table=torch.empty((0, 0), dtype=torch.int32),
            host_seq_lens=torch.empty(0, dtype=torch.int32),
            host_slot_mapping=torch.empty(0, dtype=torch.int64),
            num_offloaded_prefill_tokens=0,
            prefill_host_slot_mapping=torch.empty(0, dtype=torch.int64, device=device))

    @torch.inference_mode()
    def _linear(self, num_tokens: int) -> None:
        meta = self._metadata(num_tokens)
        hidden = torch.randn(num_tokens, self.model_config.hidden_size, dtype=self.layout.dtype,
                             device=self.device) * 0.1
        residual = None
        for index, layer in enumerate(self.model.layers):
            k_cache, v_cache = self.runner.kv_cache.gpu_layers[index]
            query, _, _, residual = layer.pre_attention(hidden, residual, meta, k_cache, v_cache)
            attention_output = torch.zeros_like(query)
            hidden, residual = layer.post_attention(attention_output, residual, meta)

    def _block_table(self, lengths: list[int], num_blocks: int) -> torch.Tensor:
        """Each request's blocks consecutive, requests in shuffled order from block 0: what the
        block manager hands out from a fresh pool (wrapping around a pool too small)."""
        block_size = self.layout.block_size
        counts = [-(-length // block_size) for length in lengths]
        order = list(range(len(lengths)))
        self.rng.shuffle(order)
        starts, next_block = [0] * len(lengths), 0
        for index in order:
            starts[index], next_block = next_block, next_block + counts[index]
        width = max(counts)
        rows = [[(start + offset) % num_blocks for offset in range(width)] for start in starts]
        return torch.tensor(rows, dtype=torch.int32)

    def _split(self, context: int, num_sequences: int) -> list[int]:
        base = max(1, context // num_sequences)
        return [base] * num_sequences

    @torch.inference_mode()
    def _gpu_attention(self, context: int) -> float:
        num_sequences = max(1, min(self.limits.max_num_seqs, context // 512))
        lengths = self._split(context, num_sequences)
        k_cache, v_cache = self.runner.kv_cache.gpu_layers[0]
        table = self._block_table(lengths, k_cache.shape[0]).to(self.device)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=self.device)
        config = self.rank_config
        query = torch.randn(num_sequences, config.num_heads, config.head_dim, dtype=self.layout.dtype, device=self.device)
        output = torch.empty_like(query)
        layers = config.num_layers

        def run():
            for index in range(layers):
                layer_k, layer_v = self.runner.kv_cache.gpu_layers[index]
                torch.ops.neo.paged_decode_attention(output, query, layer_k, layer_v, table, seq_lens,
                                                     self.model.layers[0].scale)

        return self._time(run)

    @torch.inference_mode()
    def _prefill_attention(self, length: int) -> float:
        config = self.rank_config
        shape = (length, config.num_heads, config.head_dim)
        query = torch.randn(shape, dtype=self.layout.dtype, device=self.device)
        key = torch.randn(length, config.num_kv_heads, config.head_dim, dtype=self.layout.dtype, device=self.device)
        output = torch.empty_like(query)
        cu_seqlens = torch.tensor([0, length], dtype=torch.int32, device=self.device)

        def run():
            for _ in range(config.num_layers):
                torch.ops.neo.prefill_attention(output, query, key, key, cu_seqlens, length,
                                                self.model.layers[0].scale)

        return self._time(run)

    def _host_lengths(self, num_requests: int, context: int) -> list[int]:
        """``num_requests`` equal lengths adding up to about ``context`` tokens, each within the
        model's length and all within the host pool (each request also needs its next slot)."""
        block_size = self.layout.block_size
        per_request_blocks = self.layout.num_host_blocks // num_requests
        length = min(max(1, context // num_requests), self.limits.max_model_len - 1,
                     per_request_blocks * block_size - 1)
        return [length] * num_requests

    def _host_points(self, request_points: list[int], context_points: list[int]) -> list[list[list[int]]]:
        """Per request count, the request lengths of each host-attention point: one per
        context point, those that come out at the same total (capped lengths) measured once."""
        rows = []
        for requests in request_points:
            row = []
            for context in context_points:
                lengths = self._host_lengths(requests, context)
                if all(sum(lengths) != sum(other) for other in row):
                    row.append(lengths)
            rows.append(row)
        return rows

    def _host_attention_table(self, rows: list[list[list[int]]],
                              progress) -> tuple[list[list[int]], list[list[float]]]:
        """(tokens, seconds) rows of the host-attention table for the points of ``rows``
        (``_host_points``), one row per request count.

        The points are measured in rounds, each round visiting every point once: the first
        round warms each shape up, and a point's time is the median of the later rounds. Spread
        over the whole host phase instead of back to back, a point's samples do not all fall
        into one spell in which something else holds the host's cores or memory bandwidth (a
        table is cached and steers every later start, so one such spell would steer them all).
        Each visit reads K/V that the other points' visits have since pushed out of the
        caches, as serving does."""
        points = [lengths for row in rows for lengths in row]
        samples: list[list[float]] = [[] for _ in points]
        for round_index in range(self.repeats + 1):
            for lengths, point_samples in zip(points, samples):
                seconds = self._host_attention(lengths)
                if round_index:
                    point_samples.append(seconds)
                progress.update(1)
        medians = iter([statistics.median(point_samples) for point_samples in samples])
        return ([[sum(lengths) for lengths in row] for row in rows],
                [[next(medians) for _ in row] for row in rows])

    def _host_attention(self, lengths: list[int]) -> float:
        """Host time of one iteration in which requests of ``lengths`` decode on the host."""
        requests = self.allocate_requests(KVLocation.HOST, lengths)
        plan = SchedulerOutput(sub_batches=[SubBatch(host_decodes=requests)], stage_order=SEQUENTIAL)
        try:
            return self.runner.execute(plan).host_seconds
        finally:
            self.free_requests(requests)

    # -- overheads -----------------------------------------------------------------------------

    def allocate_requests(self, location: KVLocation, lengths: list[int]) -> list[Request]:
        """Requests of these lengths allocated in ``location``'s pool, each about to decode its
        last prompt token."""
        requests = []
        for index, length in enumerate(lengths):
            request = Request(f"profile-{location.value}-{index}", [1] * length, SamplingParams(max_tokens=1))
            self.block_manager.allocate(request, location)
            request.num_cached_tokens = length - 1
            requests.append(request)
        return requests

    def free_requests(self, requests: list[Request]) -> None:
        for request in requests:
            self.block_manager.free(request)

    def _measure_plan(self, plan: SchedulerOutput) -> float:
        return self._time(lambda: self.runner.execute(plan))

    def _time_ahead(self, plan: SchedulerOutput, iterations: int = 8) -> float:
        """Median seconds per iteration of ``plan`` launched back to back as async scheduling
        launches them (``Engine._step_ahead``): each launch queued before the tokens of the one
        before are read, timed from the first read to the last over ``iterations`` iterations
        (after one warm-up). The requests' own tokens are their inputs: no launch takes
        another's samples."""
        runner = self.runner
        runner.execute(plan)
        samples = []
        for _ in range(self.repeats):
            in_flight = runner.launch(plan, read_later=True)
            following = runner.launch(plan, read_later=True)
            runner.collect(in_flight)
            start = time.perf_counter()
            for _ in range(iterations):
                in_flight, following = following, runner.launch(plan, read_later=True)
                runner.collect(in_flight)
            samples.append((time.perf_counter() - start) / iterations)
            runner.collect(following)
        return statistics.median(samples)

    def _iteration_overhead(self, model: PerfModel) -> float:
        """The fixed overhead that makes the sequential order's cost meet a small measured
        decode iteration."""
        probe = self.limits.probe_length
        requests = self.allocate_requests(KVLocation.GPU, [probe])
        try:
            measured = self._measure_plan(SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=requests)],
                                                          stage_order=SEQUENTIAL))
        finally:
            self.free_requests(requests)
        stages = iteration_seconds(SEQUENTIAL, [StageTimes(model.linear(1), model.gpu_attention(probe), 0.0)],
                                   model.table.pre_fraction)
        return max(0.0, measured - stages)

    def _graph_decode_context(self) -> int:
        return self.layout.block_size  # one block per request

    def _graph_decode_points(self) -> list[int]:
        """Request counts of the graph-decode table: up to the largest captured batch, each
        request in a block of its own; none without graphs."""
        largest = min(self.runner.graph_coverage.decode_max_requests, self.layout.num_gpu_blocks)
        return _geometric(1, largest, 4.0) if largest >= 1 else []

    def _graph_decode(self, num_requests: int) -> float:
        requests = self.allocate_requests(KVLocation.GPU, [self._graph_decode_context()] * num_requests)
        plan = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=requests)], stage_order=SEQUENTIAL)
        try:
            seconds = self._time_ahead(plan) if self.schedules_ahead else self._measure_plan(plan)
            if not self.runner.execute(plan).replayed_graph:
                raise RuntimeError(f"the decode of {num_requests} requests did not replay a CUDA graph")
            return seconds
        finally:
            self.free_requests(requests)

    def _pipeline_overheads(self, model: PerfModel) -> tuple[float, float]:
        """(eager, replayed from a pipeline graph) launch overheads of a small two-sub-batch
        decode plan in the engine's order; the graph's is the eager one where the engine has no
        pipeline graphs."""
        if self.layout.num_host_blocks < 4 or self.layout.num_gpu_blocks < 32:
            return 0.0, 0.0
        probe = self.limits.probe_length
        gpu = self.allocate_requests(KVLocation.GPU, [probe])
        host = self.allocate_requests(KVLocation.HOST, [probe, probe])
        plan = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=gpu, host_decodes=host[:1]),
                                            SubBatch(host_decodes=host[1:])], stage_order=self.stage_order)
        coverage = self.runner.graph_coverage
        graphed = coverage.pipeline_max_requests
        try:
            coverage.pipeline_max_requests = 0  # eagerly
            try:
                eager = self._measure_plan(plan)
            finally:
                coverage.pipeline_max_requests = graphed
            replayed = eager
            if graphed:
                replayed = self._measure_plan(plan)
                if not self.runner.execute(plan).replayed_graph:
                    logger.warning("the pipelined decode plan did not replay a CUDA graph: its overhead "
                                   "is the eager one")
                    replayed = eager
        finally:
            self.free_requests(gpu + host)
        times = [StageTimes(model.linear(2), model.gpu_attention(probe), model.host_attention(1, probe)),
                 StageTimes(model.linear(1), 0.0, model.host_attention(1, probe))]
        return (self._overhead_for(model, self.stage_order, times, eager, lowest=0.0),
                self._overhead_for(model, self.stage_order, times, replayed, lowest=-replayed))

    def _host_batch_overhead(self, model: PerfModel) -> float:
        """Measured time of a host batch of two probe-length decodes (launched, then collected)
        over its order's cost without overhead; none where the engine runs no host batches."""
        runner = self.runner
        probe = self.limits.probe_length
        if runner.host_batches is None or self.layout.num_host_blocks < 2 * -(-probe // self.layout.block_size):
            return 0.0
        requests = self.allocate_requests(KVLocation.HOST, [probe, probe])
        batch = SubBatch(host_decodes=requests)

        def run():
            runner.launch_host_batch(batch)
            runner.collect_host_batch(wait_seconds=float("inf"))

        try:
            measured = self._time(run)
        finally:
            self.free_requests(requests)
        order, parts = host_batch_sub_batches(self.host_batch_order, len(requests))
        sizes = [len(requests[part]) for part in parts]
        seconds, _ = model.host_batch_time(order, [(size, probe * size) for size in sizes])
        stages = seconds - model.table.host_batch_overhead  # the cost function's, without the overhead
        return measured - stages

    @staticmethod
    def _overhead_for(model: PerfModel, order: StageOrder, times: list[StageTimes], measured: float,
                      lowest: float) -> float:
        """The launch overhead (at least ``lowest``) that makes the cost of ``order`` with
        ``times`` equal the measured seconds (the cost grows with the overhead)."""
        def cost(overhead: float) -> float:
            return model.iteration_time(order, times, launch_overhead=overhead)

        low, high = lowest, measured
        if cost(low) >= measured:
            return low
        for _ in range(50):
            middle = (low + high) / 2
            low, high = (middle, high) if cost(middle) < measured else (low, middle)
        return low
