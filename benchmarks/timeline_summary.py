"""Summarize the torch.profiler timelines of ``LLM.stop_profile()`` (``neo.engine.torch_profiler``).

For each rank's Chrome trace (``.json``, or ``.json.xz`` as ``gpu_session.sh tp-timeline``
leaves them) it reports where the time went, in four views:

- **GPU streams**: per stream, the busy time of the kernels and copies launched one by one (not
  from a graph) over the recorded span, split into NCCL collectives, GEMMs, attention, copies
  and the rest, with the NCCL kernels' count, mean and longest duration. A collective that
  waits for another rank shows as NCCL kernels far longer than their bytes need.
- **Graph replays**: a replayed CUDA graph of several branches has its work reported on streams
  the driver made for the branches, not on the stream it was launched on, so graph work is
  grouped by its launch instead (the GPU events that share a ``cudaGraphLaunch``'s correlation
  id), and the replays by their count of GPU operations (one captured graph each, as a rule):
  how many, the time from the launch call to the graph's first operation, the span from its
  first operation to its last, and the busy time by kind. A launch-to-start time far above what
  was queued before it means the stream waited: behind a host function of another stream in a
  shared hardware work queue (``neo.engine.hardware_queues``), for instance.
- **Host hand-offs**: in the replays of a host batch's layers (three copies to the host per
  layer, the query and the new key and value, and one back, the attention output), each layer's
  time splits into the host stage (from the last copy to the host to the copy back: the host
  function's wait and run) and the batch's GPU stage (from the copy back to the next layer's
  first copy to the host: its ``post`` and the next ``pre``), with the batch's own GPU busy time
  inside the GPU stages: a GPU stage much longer than its busy time waited for the GPU.
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
GRAPH_LAUNCH = "cudaGraphLaunch"
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


def correlation(event: dict):
    return event.get("args", {}).get("correlation")


def graph_work(events: list[dict]) -> tuple[dict, dict]:
    """The graph launches by correlation id, and the GPU events each launched (by the same id)."""
    launches = {correlation(event): event for event in events
                if event["name"] == GRAPH_LAUNCH and event.get("cat") in HOST_CALL_CATEGORIES
                and correlation(event) is not None}
    replays = defaultdict(list)
    for event in events:
        if event.get("cat") in GPU_CATEGORIES and correlation(event) in launches:
            replays[correlation(event)].append(event)
    return launches, replays


def busy_by_kind(gpu_events: list[dict]) -> dict[str, float]:
    busy = defaultdict(float)
    for event in gpu_events:
        busy[kind_of(event)] += event["dur"] / 1e3
    return dict(sorted(busy.items()))


def gpu_streams(events: list[dict], replays: dict) -> dict:
    """Per (device, stream), of the GPU events not launched by a graph replay (``replays``, as
    ``graph_work`` gives them): busy milliseconds by kind, over the span of all GPU events, and
    the NCCL kernels' count, mean and longest milliseconds."""
    gpu = [event for event in events if event.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return {}
    span_ms = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / 1e3
    streams = defaultdict(list)
    for event in gpu:
        if correlation(event) in replays:
            continue
        args = event.get("args", {})
        streams[f"device {args.get('device', event['pid'])} stream {args.get('stream', event['tid'])}"].append(event)
    summary = {}
    for stream, stream_events in sorted(streams.items()):
        busy = busy_by_kind(stream_events)
        nccl = [event["dur"] / 1e3 for event in stream_events if kind_of(event) == "nccl"]
        summary[stream] = {
            "span_ms": span_ms,
            "busy_ms": sum(busy.values()),
            "busy_ms_by_kind": busy,
            "nccl_kernels": len(nccl),
            "nccl_mean_ms": statistics.mean(nccl) if nccl else None,
            "nccl_max_ms": max(nccl) if nccl else None,
        }
    return summary


def graph_replays(launches: dict, replays: dict) -> dict:
    """Per count of GPU operations in a replay (``launches`` and ``replays`` as ``graph_work``
    gives them): the replays, the mean and longest milliseconds from the launch call's start to
    the first operation's, and the mean span (first operation's start to the last one's end)
    and busy milliseconds by kind."""
    by_size = defaultdict(list)
    for launch_id, operations in replays.items():
        by_size[len(operations)].append((launches[launch_id], operations))
    summary = {}
    for size, group in sorted(by_size.items(), key=lambda item: -len(item[1])):
        delays, spans, busy = [], [], defaultdict(float)
        for launch, operations in group:
            first = min(event["ts"] for event in operations)
            delays.append((first - launch["ts"]) / 1e3)
            spans.append((max(event["ts"] + event["dur"] for event in operations) - first) / 1e3)
            for kind, milliseconds in busy_by_kind(operations).items():
                busy[kind] += milliseconds / len(group)
        summary[f"graphs of {size} GPU operations"] = {
            "replays": len(group),
            "mean_start_delay_ms": statistics.mean(delays),
            "max_start_delay_ms": max(delays),
            "mean_span_ms": statistics.mean(spans),
            "mean_busy_ms": sum(busy.values()),
            "mean_busy_ms_by_kind": dict(sorted(busy.items())),
        }
    return summary


def is_copy(event: dict, direction: str) -> bool:
    return event["cat"] == "gpu_memcpy" and direction in event["name"]


def host_hand_offs(replays: dict) -> dict | None:
    """Of the graph replays whose copies are three to the host per copy back (a host batch's
    layers, ``replays`` as ``graph_work`` gives them): the layers' host and GPU stages (see the
    module docstring), as medians and as shares of the replays' summed span; None without such
    replays."""
    host_ms, gpu_ms, gpu_busy_ms, spans = [], [], [], []
    for operations in replays.values():
        to_host = sum(is_copy(event, "DtoH") for event in operations)
        back = sum(is_copy(event, "HtoD") for event in operations)
        if not back or to_host != 3 * back:
            continue
        ordered = sorted(operations, key=lambda event: event["ts"])
        spans.append((max(e["ts"] + e["dur"] for e in ordered) - ordered[0]["ts"]) / 1e3)
        last_to_host_end = last_back_end = None
        kernels_since_back = 0.0
        for event in ordered:
            end = event["ts"] + event["dur"]
            if is_copy(event, "DtoH"):
                if last_back_end is not None:  # the GPU stage between two hand-offs ends here
                    gpu_ms.append((event["ts"] - last_back_end) / 1e3)
                    gpu_busy_ms.append(kernels_since_back)
                    last_back_end = None
                last_to_host_end = max(end, last_to_host_end or end)
            elif is_copy(event, "HtoD") and last_to_host_end is not None:
                host_ms.append((event["ts"] - last_to_host_end) / 1e3)
                last_to_host_end, last_back_end, kernels_since_back = None, end, 0.0
            elif event["cat"] == "kernel" and last_back_end is not None:
                kernels_since_back += event["dur"] / 1e3
    if not host_ms:
        return None
    return {"replays": len(spans), "layers": len(host_ms),
            "median_host_stage_ms": statistics.median(host_ms),
            "median_gpu_stage_ms": statistics.median(gpu_ms) if gpu_ms else None,
            "median_gpu_stage_busy_ms": statistics.median(gpu_busy_ms) if gpu_busy_ms else None,
            "host_stage_share": sum(host_ms) / sum(spans), "gpu_stage_share": sum(gpu_ms) / sum(spans)}


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
    launches, replays = graph_work(events)
    return {"gpu_streams": gpu_streams(events, replays), "graph_replays": graph_replays(launches, replays),
            "host_hand_offs": host_hand_offs(replays), "host_calls": host_calls(events),
            "iterations": iterations(events)}


def format_summary(path: str, summary: dict) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [path]
    for stream, figures in summary["gpu_streams"].items():
        kinds = ", ".join(f"{kind} {value:.1f}" for kind, value in figures["busy_ms_by_kind"].items())
        lines.append(f"  {stream}: busy {figures['busy_ms']:.1f} of {figures['span_ms']:.1f} ms ({kinds}); "
                     f"NCCL kernels {figures['nccl_kernels']}, mean {ms(figures['nccl_mean_ms'])} ms, "
                     f"longest {ms(figures['nccl_max_ms'])} ms")
    for graph, figures in summary["graph_replays"].items():
        kinds = ", ".join(f"{kind} {value:.1f}" for kind, value in figures["mean_busy_ms_by_kind"].items())
        lines.append(f"  {graph}: {figures['replays']} replays, launch to start mean "
                     f"{ms(figures['mean_start_delay_ms'])} ms (longest {ms(figures['max_start_delay_ms'])}), "
                     f"span mean {ms(figures['mean_span_ms'])} ms, "
                     f"busy mean {ms(figures['mean_busy_ms'])} ms ({kinds})")
    hand_offs = summary["host_hand_offs"]
    if hand_offs:
        lines.append(f"  host hand-offs: {hand_offs['layers']} layers in {hand_offs['replays']} replays; per layer, "
                     f"median host stage {ms(hand_offs['median_host_stage_ms'])} ms, GPU stage "
                     f"{ms(hand_offs['median_gpu_stage_ms'])} ms (busy {ms(hand_offs['median_gpu_stage_busy_ms'])}); "
                     f"of the replays' span {100 * hand_offs['host_stage_share']:.0f}% host stages, "
                     f"{100 * hand_offs['gpu_stage_share']:.0f}% GPU stages")
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
