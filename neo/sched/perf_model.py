"""``PerfModel``: stage times of this machine, by linear interpolation in profiled tables.

Every time is for the whole model (all layers) and in seconds. Tables (from ``neo profile``):

- ``linear``: GPU time of the pre/post-attention stages vs tokens in the sub-batch.
- ``gpu_attention``: GPU decode-attention time vs context tokens of the GPU decodes.
- ``prefill_attention``: GPU prefill-attention time vs prompt length (one prompt).
- ``host_attention``: host decode-attention time vs (requests, context tokens): per request
  count a row of (context tokens, seconds) points, interpolated within each row, then
  across the rows.
- ``pipeline_overhead``: extra time of a two-sub-batch iteration over its stage times
  (launches, hand-offs, copies), and ``iteration_overhead`` of any iteration;
  ``pipeline_graph_overhead`` the same for a decode-only two-sub-batch iteration replayed from
  a CUDA graph (``PipelineGraphs``): no launches, so it may be negative (the replay runs
  faster than the eagerly timed stages add up to).
- ``host_batch_overhead``: extra time of a host batch of the async host pipeline over its
  stage times (``linear`` + ``host_attention``, which follow one another): launches, hand-offs,
  the pipeline graph's replay.
- ``graph_decode``: a whole decode-only iteration replayed from the engine's CUDA graphs vs
  requests, each of ``graph_decode_context`` tokens (input copies, replay, logits, sampling;
  empty where the engine has no graphs). Longer contexts add their extra GPU attention time.
  The stage tables are timed eagerly, and on a small model a decode iteration launched kernel
  by kernel takes much longer than its replay.

A two-sub-batch iteration (see ``executor.py``) overlaps per layer the GPU stages of one
sub-batch with the host attention of the other, so ``two_batch_time`` is
``max(lin(1) + o/2, cpu(0)) + max(lin(0) + gpu(0) + o/2, cpu(1))`` with ``o`` the pipeline
overhead: the launching thread's extra work stretches the GPU side and hides under long host
attention, as it does in the engine.

``PerfModel.zero()`` predicts zero for everything (for tests: the scheduler then admits all
host decodes and prefers the plan with more tokens).

``HostTimeCalibration`` corrects the profiled host-attention time by what the engine measures
while it serves (see its docstring).
"""

import bisect
import json
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field


def bracket(xs: list[float], x: float) -> list[int]:
    """Indices of the points ``interpolate`` uses at ``x`` (non-empty ``xs``): the only one, or
    the pair around ``x`` (the end pair beyond the ends)."""
    if len(xs) == 1:
        return [0]
    index = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    return [index - 1, index]


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear through the points; linear extrapolation beyond the ends."""
    if not xs:
        return 0.0
    points = bracket(xs, x)
    if len(points) == 1:
        return ys[0] * (x / xs[0]) if xs[0] else ys[0]
    first, second = points
    x0, x1, y0, y1 = xs[first], xs[second], ys[first], ys[second]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class PerfTable:
    """The profiled tables and what they were measured on."""

    key: dict = field(default_factory=dict)  # model shape, dtype, device, threads
    linear_tokens: list[float] = field(default_factory=list)
    linear_seconds: list[float] = field(default_factory=list)
    gpu_attention_tokens: list[float] = field(default_factory=list)
    gpu_attention_seconds: list[float] = field(default_factory=list)
    prefill_lengths: list[float] = field(default_factory=list)
    prefill_seconds: list[float] = field(default_factory=list)
    host_attention_requests: list[float] = field(default_factory=list)
    host_attention_tokens: list[list[float]] = field(default_factory=list)  # [requests][points]
    host_attention_seconds: list[list[float]] = field(default_factory=list)  # [requests][points]
    pipeline_overhead: float = 0.0
    pipeline_graph_overhead: float = 0.0
    iteration_overhead: float = 0.0
    host_batch_overhead: float = 0.0
    graph_decode_requests: list[float] = field(default_factory=list)
    graph_decode_seconds: list[float] = field(default_factory=list)
    graph_decode_context: int = 0  # tokens per request in the graph_decode points

    def save(self, path: str) -> None:
        with open(path, "w") as file:
            json.dump(asdict(self), file, indent=1)

    @classmethod
    def load(cls, path: str) -> "PerfTable":
        with open(path) as file:
            return cls(**json.load(file))


class PerfModel:
    """Predicts stage times from a ``PerfTable``."""

    def __init__(self, table: PerfTable):
        self.table = table

    @classmethod
    def zero(cls) -> "PerfModel":
        return cls(PerfTable())

    @property
    def is_zero(self) -> bool:
        return not self.table.linear_tokens

    def linear(self, num_tokens: int) -> float:
        if num_tokens == 0:
            return 0.0
        return interpolate(self.table.linear_tokens, self.table.linear_seconds, num_tokens)

    def gpu_attention(self, context_tokens: int) -> float:
        if context_tokens == 0:
            return 0.0
        return interpolate(self.table.gpu_attention_tokens, self.table.gpu_attention_seconds, context_tokens)

    def prefill_attention(self, prompt_lengths: list[int]) -> float:
        return sum(interpolate(self.table.prefill_lengths, self.table.prefill_seconds, length)
                   for length in prompt_lengths)

    def host_attention(self, num_requests: int, context_tokens: int) -> float:
        table = self.table
        requests = table.host_attention_requests
        if num_requests == 0 or not requests:
            return 0.0
        # Only the rows ``interpolate`` uses across the request counts are evaluated (the
        # scheduler asks this several times per host request per iteration).
        rows = bracket(requests, num_requests)
        per_row = [interpolate(table.host_attention_tokens[row], table.host_attention_seconds[row], context_tokens)
                   for row in rows]
        return interpolate([requests[row] for row in rows], per_row, num_requests)

    def graph_decode(self, num_requests: int, context_tokens: int) -> float | None:
        """Seconds of a decode-only iteration replayed from a CUDA graph; None when the table
        has no such points or ``num_requests`` lies beyond them."""
        requests = self.table.graph_decode_requests
        if not requests or num_requests > requests[-1]:
            return None
        profiled_context = num_requests * self.table.graph_decode_context
        extra_attention = max(0.0, self.gpu_attention(context_tokens) - self.gpu_attention(profiled_context))
        return interpolate(requests, self.table.graph_decode_seconds, num_requests) + extra_attention

    def two_batch_time(self, linear0: float, gpu0: float, linear1: float, cpu0: float, cpu1: float,
                       pipeline_overhead: float | None = None, graphed: bool = False) -> float:
        """Seconds of a two-sub-batch iteration from its stage times (see the module docstring);
        ``graphed``: replayed from a pipeline graph (its overhead), unless ``pipeline_overhead``
        is given."""
        if pipeline_overhead is None:
            pipeline_overhead = self.table.pipeline_graph_overhead if graphed else self.table.pipeline_overhead
        half = pipeline_overhead / 2
        return max(linear1 + half, cpu0) + max(linear0 + gpu0 + half, cpu1) + self.iteration_overhead

    def host_batch_time(self, linear: float, host: float) -> float:
        """Seconds of a host batch (async host pipeline) from its GPU stages' and its host
        attention's times."""
        return linear + host + self.table.host_batch_overhead

    @property
    def iteration_overhead(self) -> float:
        return self.table.iteration_overhead


class HostTimeCalibration:
    """A factor on the profiled host-attention time, learned from the engine's iterations.

    The profile times host attention in isolated iterations; in the engine's pipelined ones the
    same work took 0.67-1.0x as long on the H100 host (the CPU's threads stay busy from layer to
    layer there), and the ratio moves with the load. The factor is the measured over the
    profiled host time of the last ``window`` iterations with host decodes (sums, so long
    iterations weigh more), within ``bounds``.

    Before the first measurement it is ``prior`` (below 1: optimistic, the fastest ratio seen),
    so that a scheduler that would never offload on the profile alone tries host decodes where
    they would pay at that speed, measures them, and then follows the measurement. A lower
    prior explores more: at 0.5 the 8B memory-poor runs admitted requests to the host pool that
    then went back to the GPU undecoded (9% slower at output 50).
    """

    def __init__(self, prior: float = 0.67, window: int = 16, bounds: tuple[float, float] = (0.25, 4.0)):
        if not bounds[0] <= prior <= bounds[1]:
            raise ValueError(f"prior {prior} is outside the bounds {bounds}")
        self.bounds = bounds
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (profiled, measured)
        # Read for every host estimate the scheduler makes: kept up to date in ``observe``.
        self.scale = prior

    @property
    def samples(self) -> list[tuple[float, float]]:
        """The (profiled, measured) seconds of the iterations in the window, oldest first."""
        return list(self._samples)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def observe(self, profiled_seconds: float, measured_seconds: float) -> None:
        """One iteration's host attention: the profile's uncorrected estimate and the measured
        time (ignored unless both are positive)."""
        if profiled_seconds > 0 and measured_seconds > 0:
            self._samples.append((profiled_seconds, measured_seconds))
            profiled = sum(sample[0] for sample in self._samples)
            measured = sum(sample[1] for sample in self._samples)
            self.scale = min(max(measured / profiled, self.bounds[0]), self.bounds[1])


class HostBatchInterference:
    """How much slower the GPU's iterations run while a host batch is in flight, measured.

    A host batch (async host pipeline) costs the GPU's iterations more than its own stages'
    GPU time: its kernels share the SMs, and its host attention's threads share the host with
    the thread that launches the iterations. On the H100 host, decode iterations beside host
    batches took 1.10-1.11x their estimate alone on Qwen2.5-32B shapes and 1.02-1.11x on
    Llama-3.1-8B shapes. Each decode iteration gives the ratio of its measured to its estimated
    time alone; ``factor`` is the median ratio of the last ``window`` iterations beside a batch over
    that of those alone (1 while fewer than ``min_samples`` ran alone: the estimate itself),
    at least 1. None until ``min_samples`` iterations ran beside a batch.
    """

    def __init__(self, window: int = 64, min_samples: int = 8):
        self.min_samples = min_samples
        self._beside: deque[float] = deque(maxlen=window)
        self._alone: deque[float] = deque(maxlen=window)
        self.factor: float | None = None

    def observe(self, estimated_alone: float, measured: float, beside_host_batch: bool) -> None:
        """One decode iteration's estimate alone and measured seconds (ignored unless both
        are positive)."""
        if estimated_alone <= 0 or measured <= 0:
            return
        (self._beside if beside_host_batch else self._alone).append(measured / estimated_alone)
        if len(self._beside) >= self.min_samples:
            alone = statistics.median(self._alone) if len(self._alone) >= self.min_samples else 1.0
            self.factor = max(1.0, statistics.median(self._beside) / alone)
