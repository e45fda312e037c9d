"""Summarize the torch.profiler timelines of ``LLM.stop_profile()`` (``neo.engine.torch_profiler``).

For each rank's Chrome trace (``.json``, or ``.json.xz`` as ``gpu_session.sh tp-timeline``
leaves them) it reports where the time went, in three views:

- **GPU streams**: per stream, the kernels' and copies' busy time over the recorded span, split
  into NCCL collectives, GEMMs, attention, copies and the rest, with the NCCL kernels' count,
  mean and longest duration. A collective that waits for another rank shows as NCCL kernels far
  longer than their bytes need.
- **CUDA calls on the host**: per thread, the runtime and driver calls that held it longest
  (a graph launch that waits for the driver's queue of host functions, a synchronization).
- **Iterations**: the ``neo.iteration`` ranges (each iteration's launch): their count and mean
  and longest duration on the host, and the mean time from the start of one to the next.

    python benchmarks/timeline_summary.py DIR/trace-1-rank0.json.xz DIR/trace-1-rank1.json.xz [--json]
"""

import argparse
import json
import lzma
import statistics
from collections import defaultdict

from neo.runner.model_runner import ITERATION_LABEL

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALL_CATEGORIES = ("cuda_runtime", "cuda_driver")
TOP_HOST_CALLS = 5


def load_events(path: str) -> list[dict]:
    """The complete ("X") events of a Chrome trace file."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    return [event for event in events if event.get("ph") == "X" and "dur" in event]


def kind_of(event: dict) -> str:
    """What a GPU event is: nccl, gemm, attention, copy or other."""
    name = event["name"].lower()
    if event["cat"] != "kernel":
        return "copy"
    if "nccl" in name:
        return "nccl"
    if any(part in name for part in ("gemm", "cutlass", "xmma", "nvjet", "cublas")):
        return "gemm"
    if "attention" in name or "flash" in name:
        return "attention"
    return "other"


def gpu_streams(events: list[dict]) -> dict:
    """Per (device, stream): busy milliseconds by kind, over the span of all GPU events, and the
    NCCL kernels' count, mean and longest milliseconds."""
    gpu = [event for event in events if event.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return {}
    span_ms = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / 1e3
    streams = defaultdict(list)
    for event in gpu:
        args = event.get("args", {})
        streams[f"device {args.get('device', event['pid'])} stream {args.get('stream', event['tid'])}"].append(event)
    summary = {}
    for stream, stream_events in sorted(streams.items()):
        busy = defaultdict(float)
        for event in stream_events:
            busy[kind_of(event)] += event["dur"] / 1e3
        nccl = [event["dur"] / 1e3 for event in stream_events if kind_of(event) == "nccl"]
        summary[stream] = {
            "span_ms": span_ms,
            "busy_ms": sum(busy.values()),
            "busy_ms_by_kind": dict(sorted(busy.items())),
            "nccl_kernels": len(nccl),
            "nccl_mean_ms": statistics.mean(nccl) if nccl else None,
            "nccl_max_ms": max(nccl) if nccl else None,
        }
    return summary


def host_calls(events: list[dict]) -> dict:
    """Per host thread: total milliseconds in CUDA runtime and driver calls, and the calls that
    took longest in all (name: count, total and longest milliseconds)."""
    threads = defaultdict(lambda: defaultdict(list))
    for event in events:
        if event.get("cat") in HOST_CALL_CATEGORIES:
            threads[f"thread {event['tid']}"][event["name"]].append(event["dur"] / 1e3)
    summary = {}
    for thread, calls in sorted(threads.items()):
        ranked = sorted(calls.items(), key=lambda item: -sum(item[1]))[:TOP_HOST_CALLS]
        summary[thread] = {
            "total_ms": sum(sum(durations) for durations in calls.values()),
            "longest_calls": {name: {"count": len(durations), "total_ms": sum(durations), "max_ms": max(durations)}
                              for name, durations in ranked},
        }
    return summary


def iterations(events: list[dict]) -> dict:
    """The ``neo.iteration`` ranges on the host: count, mean and longest milliseconds, and the
    mean milliseconds from one's start to the next's."""
    ranges = sorted((e for e in events if e["name"] == ITERATION_LABEL and e.get("cat") == "user_annotation"),
                    key=lambda e: e["ts"])
    if not ranges:
        return {"count": 0}
    durations = [event["dur"] / 1e3 for event in ranges]
    starts = [event["ts"] for event in ranges]
    gaps = [(later - earlier) / 1e3 for earlier, later in zip(starts, starts[1:])]
    return {"count": len(ranges), "mean_ms": statistics.mean(durations), "max_ms": max(durations),
            "mean_start_to_start_ms": statistics.mean(gaps) if gaps else None}


def summarize(path: str) -> dict:
    events = load_events(path)
    return {"gpu_streams": gpu_streams(events), "host_calls": host_calls(events), "iterations": iterations(events)}


def format_summary(path: str, summary: dict) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [path]
    for stream, figures in summary["gpu_streams"].items():
        kinds = ", ".join(f"{kind} {value:.1f}" for kind, value in figures["busy_ms_by_kind"].items())
        lines.append(f"  {stream}: busy {figures['busy_ms']:.1f} of {figures['span_ms']:.1f} ms ({kinds}); "
                     f"NCCL kernels {figures['nccl_kernels']}, mean {ms(figures['nccl_mean_ms'])} ms, "
                     f"longest {ms(figures['nccl_max_ms'])} ms")
    for thread, figures in summary["host_calls"].items():
        calls = "; ".join(f"{name} x{call['count']} {call['total_ms']:.1f} ms (longest {call['max_ms']:.2f})"
                          for name, call in figures["longest_calls"].items())
        lines.append(f"  {thread}: {figures['total_ms']:.1f} ms in CUDA calls; longest in all: {calls}")
    steps = summary["iterations"]
    if steps["count"]:
        lines.append(f"  iterations: {steps['count']} launches, mean {ms(steps['mean_ms'])} ms, longest "
                     f"{ms(steps['max_ms'])} ms, start to start {ms(steps['mean_start_to_start_ms'])} ms")
    else:
        lines.append("  iterations: none recorded")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", help="Chrome trace files (.json or .json.xz), one per rank")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    summaries = {path: summarize(path) for path in args.traces}
    if args.json:
        print(json.dumps(summaries, indent=1))
    else:
        print("\n".join(format_summary(path, summary) for path, summary in summaries.items()))


if __name__ == "__main__":
    main()
