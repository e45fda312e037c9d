"""``/metrics``: engine state in the Prometheus text exposition format (version 0.0.4).

The request latency histograms carry vLLM's names under the ``neo:`` prefix
(``neo:time_to_first_token_seconds``, ``neo:inter_token_latency_seconds``,
``neo:e2e_request_latency_seconds``, ``neo:request_queue_time_seconds``), so dashboards
written for vLLM need only the prefix changed.
"""

import itertools
import time

from .async_engine import EngineStats
from .latency import HistogramSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# EngineMetrics field -> help text; each is exported as the counter neo_<field>_total.
COUNTER_HELP = {
    "iterations": "Engine iterations run.",
    "two_batch_iterations": "Iterations that ran two sub-batches (asymmetric pipeline).",
    "graph_iterations": "Iterations replayed from a captured CUDA graph.",
    "graph_swap_iterations": "Iterations replayed from a captured CUDA graph that also moved KV blocks.",
    "host_batches": "Host decode batches of the async host pipeline completed.",
    "graph_host_batches": "Host decode batches replayed from captured CUDA graphs.",
    "prefill_tokens": "Prompt tokens prefilled.",
    "gpu_decode_tokens": "Decode tokens whose attention ran on the compute device.",
    "host_decode_tokens": "Decode tokens whose attention ran on the host CPU.",
    "blocks_swapped_out": "KV blocks swapped from the compute-device pool to the host pool.",
    "blocks_swapped_in": "KV blocks swapped from the host pool back to the compute-device pool.",
    "preemptions": "Requests preempted.",
    "requests_finished": "Requests that finished (stop string/token, EOS or length).",
    "requests_aborted": "Requests aborted (client gone, shutdown or a failed iteration).",
    "output_tokens": "Output tokens generated.",
    "busy_seconds": "Seconds spent executing iterations.",
    "schedule_seconds": "Seconds spent scheduling iterations.",
}

# RequestLatencies.snapshot() key -> help text; each is exported as the histogram neo:<key>.
HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from a request's arrival to its first output token.",
    "inter_token_latency_seconds": "Time between two successive output tokens of a request.",
    "e2e_request_latency_seconds": "Time from a request's arrival to its last output token.",
    "request_queue_time_seconds": "Time from a request's arrival to the first iteration that "
                                  "scheduled it.",
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Exposition:
    def __init__(self):
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str,
               samples: list[tuple[dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{key}="{_escape(text)}"' for key, text in labels.items())
            self.lines.append(f"{name}{{{label_text}}} {value!r}" if labels else f"{name} {value!r}")

    def histogram(self, name: str, help_text: str, histogram: HistogramSnapshot) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        cumulative = list(itertools.accumulate(histogram.counts))
        for bound, count in zip(histogram.bounds, cumulative):
            self.lines.append(f'{name}_bucket{{le="{float(bound)!r}"}} {float(count)!r}')
        self.lines.append(f'{name}_bucket{{le="+Inf"}} {float(cumulative[-1])!r}')
        self.lines.append(f"{name}_sum {float(histogram.total)!r}")
        self.lines.append(f"{name}_count {float(cumulative[-1])!r}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(stats: EngineStats, info: dict[str, str], now: float | None = None) -> str:
    """The exposition text. info: labels of ``neo_engine_info`` (model, policy, device, ...).
    now: ``time.monotonic()`` for the token rate (default: now)."""
    now = time.monotonic() if now is None else now
    out = _Exposition()
    out.metric("neo_engine_info", "gauge", "The served model and engine settings (always 1).",
               [(info, 1.0)])
    out.metric("neo_requests_running", "gauge", "Requests being prefilled or decoded.",
               [({}, float(stats.running))])
    out.metric("neo_requests_waiting", "gauge", "Requests waiting to be prefilled.",
               [({}, float(stats.waiting))])
    out.metric("neo_requests_swapped", "gauge", "Preempted requests waiting in the host pool.",
               [({}, float(stats.swapped))])
    out.metric("neo_requests_in_kv_pool", "gauge",
               "Running requests by the pool their KV cache is in (gpu: compute device, "
               "host: host memory, decoded by the host CPU).",
               [({"pool": "gpu"}, float(stats.running_in_gpu_pool)),
                ({"pool": "host"}, float(stats.running_in_host_pool))])
    pools = {"gpu": (stats.gpu_blocks_used, stats.gpu_blocks_total),
             "host": (stats.host_blocks_used, stats.host_blocks_total)}
    out.metric("neo_kv_cache_usage_ratio", "gauge", "Fraction of the KV pool's blocks in use.",
               [({"pool": pool}, used / total if total else 0.0)
                for pool, (used, total) in pools.items()])
    out.metric("neo_kv_cache_blocks_used", "gauge", "KV blocks in use.",
               [({"pool": pool}, float(used)) for pool, (used, _) in pools.items()])
    out.metric("neo_kv_cache_blocks", "gauge", "KV blocks in the pool.",
               [({"pool": pool}, float(total)) for pool, (_, total) in pools.items()])
    iterations = stats.counters["iterations"]
    out.metric("neo_two_batch_iteration_ratio", "gauge",
               "Share of iterations since start that ran two sub-batches.",
               [({}, stats.counters["two_batch_iterations"] / iterations if iterations else 0.0)])
    out.metric("neo_generation_tokens_per_second", "gauge",
               f"Output tokens per second over the last {stats.window_seconds:g} s.",
               [({}, stats.tokens_per_second(now))])
    for field, value in stats.counters.items():
        out.metric(f"neo_{field}_total", "counter",
                   COUNTER_HELP.get(field, f"Engine counter {field}."), [({}, float(value))])
    for key, histogram in stats.histograms.items():
        out.histogram(f"neo:{key}", HISTOGRAM_HELP[key], histogram)
    return out.text()
