"""``PerfModel``: stage times of this machine, by linear interpolation in profiled tables.

Every time is for the whole model (all layers) and in seconds. Tables (from ``neo profile``):

- ``linear``: GPU time of the pre/post-attention stages vs tokens in the sub-batch
  (``pre_fraction`` of it in ``pre``: the QKV projection's share of the layer's weights).
- ``gpu_attention``: GPU decode-attention time vs context tokens of the GPU decodes.
- ``prefill_attention``: GPU prefill-attention time vs prompt length (one prompt).
- ``host_attention``: host decode-attention time vs (requests, context tokens): per request
  count a row of (context tokens, seconds) points, interpolated within each row, then
  across the rows.
- ``pipeline_overhead``: the launch overhead (``neo.sched.cost``) that makes the cost of a
  small two-sub-batch iteration of the engine's stage order meet its measured time (launches,
  hand-offs, copies), and ``iteration_overhead`` the fixed overhead of any iteration;
  ``pipeline_graph_overhead`` the same for a decode-only two-sub-batch iteration replayed from
  a CUDA graph (``PipelineGraphs``): no launches, so it may be negative (the replay runs
  faster than the eagerly timed stages add up to).
- ``host_batch_overhead``: the fixed overhead of a host batch of the async host pipeline over
  its stage order's cost: launches, hand-offs, the pipeline graph's replay.
- ``graph_decode``: a whole decode-only iteration replayed from the engine's CUDA graphs vs
  requests, each of ``graph_decode_context`` tokens (input copies, replay, logits, sampling;
  under async scheduling from one token read to the next with the next iteration launched
  ahead, so input preparation overlaps the device; empty where the engine has no graphs).
  Longer contexts add their extra GPU attention time.
  The stage tables are timed eagerly, and on a small model a decode iteration launched kernel
  by kernel takes much longer than its replay.

``iteration_seconds`` turns stage times into an iteration time with the cost function of
``neo.sched.cost`` and the table's overheads. ``PerfModel.zero()`` predicts zero for everything
(for tests: the scheduler then admits all host decodes and prefers the plan with more tokens).
"""

import bisect
import json
from dataclasses import asdict, dataclass, field

from .cost import StageTimes, iteration_seconds
from .stage_order import StageOrder


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
    pre_fraction: float = 0.5  # of the linear time, in pre (see the module docstring)

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

    def iteration_time(self, order: StageOrder, times: list[StageTimes], graphed: bool = False,
                       launch_overhead: float | None = None) -> float:
        """Seconds of an iteration of ``order`` from its sub-batches' stage times: the cost
        function with the table's overheads. A one-sub-batch order carries the iteration
        overhead alone; a two-sub-batch one also the pipeline's launch overhead (the graph
        replay's when ``graphed``), unless ``launch_overhead`` is given."""
        if launch_overhead is None:
            launch_overhead = 0.0
            if order.num_sub_batches > 1:
                launch_overhead = self.table.pipeline_graph_overhead if graphed else self.table.pipeline_overhead
        return iteration_seconds(order, times, self.table.pre_fraction, launch_overhead, self.iteration_overhead)

    def host_batch_time(self, order: StageOrder, sub_batches: list[tuple[int, int]],
                        host_scale: float = 1.0) -> tuple[float, float]:
        """(seconds, of which host attention) of a host batch (async host pipeline) in ``order``
        whose sub-batches hold ``(decodes, context tokens)`` each (``host_batch_sub_batches``);
        ``host_scale`` corrects the profile's host attention."""
        times = [StageTimes(self.linear(decodes), 0.0, self.host_attention(decodes, context) * host_scale)
                 for decodes, context in sub_batches]
        seconds = iteration_seconds(order, times, self.table.pre_fraction,
                                    fixed_overhead=self.table.host_batch_overhead)
        return seconds, sum(time.host_attention for time in times)

    @property
    def iteration_overhead(self) -> float:
        return self.table.iteration_overhead
