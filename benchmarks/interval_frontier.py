"""Tokens per second against the time between a request's tokens: what host decodes can add.

Online, a user waits for every token, so the question for offloading is not only how many
tokens per second it makes but how far apart it puts each request's tokens. This benchmark
fills the GPU pool with decodes of ``--context`` tokens (the steady GPU batch of a memory-poor
engine) and measures, on one engine at a time (its own model, pools and host functions, a zero
perf model: the plans are built here, not by a scheduler):

- ``gpu-only``: the GPU decodes alone (a decode graph's replay), back to back;
- ``lockstep``: the same GPU decodes plus ``h`` host decodes of ``--context`` tokens in one
  two-sub-batch iteration (host decodes split between the sub-batches, the best split of a
  few), back to back: every request gets a token per iteration;
- ``async``: the GPU decodes as their own iterations while host batches of the ``h`` host
  decodes run beside them, the next batch launched at the first iteration after the last one
  completed, as the engine does: GPU requests get a token per GPU iteration, host requests
  one per host batch.

Each point gives output tokens per second, its ratio to ``gpu-only`` measured on the same
engine, the time between two tokens of a GPU request and of a host request (medians), and the
mean time between a request's tokens over all its requests: requests / tokens per second
(Little's law), what the online benchmark's mean per-token latency measures when no request
queues and no prefill runs. For each ``--intervals-ms`` bound it reports the best ratio among
the points whose mean interval is within it: the most these host-decode counts add at that
latency.

    python benchmarks/interval_frontier.py --model qwen2.5-32b --gpu-kv-cache-gib 2 --context 750 \\
        --host-requests 4,8,12,16,24,32,64 --intervals-ms 57.1,100,200 [--json out.json]
"""

import argparse
import json
import statistics
import sys
import time

from neo import EngineConfig, LLMEngine
from neo.bench import device_name, release_device_memory
from neo.request import KVLocation, Request
from neo.sched.scheduler_output import SchedulerOutput, SubBatch

# Fractions of the host decodes that go into sub-batch 0 (with the GPU decodes) in a lockstep
# iteration; the best is kept.
LOCKSTEP_SPLITS = (0.0, 0.25, 0.5)


def parse_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return counts


def parse_intervals(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive milliseconds separated by commas, got {text!r}")
    return values


def time_iterations(engine: LLMEngine, plan: SchedulerOutput, repeats: int) -> tuple[float, bool]:
    """Median seconds of one iteration of ``plan`` run back to back, after a warm-up (which
    captures the graph the plan replays), and whether it replayed a graph."""
    engine.runner.execute(plan)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        output = engine.runner.execute(plan)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), output.replayed_graph


def point(pipeline: str, host: int, gpu: int, seconds_per_token: dict, tokens_per_second: float,
          baseline: float | None) -> dict:
    return {"pipeline": pipeline, "host_requests": host, "gpu_requests": gpu,
            "gpu_interval_ms": seconds_per_token.get("gpu", 0.0) * 1e3,
            "host_interval_ms": seconds_per_token.get("host", 0.0) * 1e3,
            "max_interval_ms": max(seconds_per_token.values()) * 1e3,  # the slower kind of request
            "mean_interval_ms": (gpu + host) / tokens_per_second * 1e3,
            "tokens_per_second": tokens_per_second,
            "ratio_to_gpu_only": tokens_per_second / baseline if baseline else 1.0}


def measure_gpu_only(engine: LLMEngine, gpu: list[Request], repeats: int) -> dict:
    seconds, replayed = time_iterations(engine, SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=gpu)]), repeats)
    result = point("gpu-only", 0, len(gpu), {"gpu": seconds}, len(gpu) / seconds, None)
    result["replayed_graph"] = replayed  # as the engine's decodes are, where it has graphs
    return result


def measure_lockstep(engine: LLMEngine, gpu: list[Request], host: list[Request], repeats: int,
                     baseline: float) -> dict:
    """The best split of ``host`` between the two sub-batches beside the GPU decodes."""
    best = None
    for fraction in LOCKSTEP_SPLITS:
        in_first = min(len(host) - 1, round(fraction * len(host)))
        plan = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=gpu, host_decodes=host[:in_first]),
                                            SubBatch(host_decodes=host[in_first:])])
        seconds, replayed = time_iterations(engine, plan, repeats)
        if best is None or seconds < best[0]:
            best = (seconds, in_first, replayed)
    seconds, in_first, replayed = best
    result = point("lockstep", len(host), len(gpu), {"gpu": seconds, "host": seconds},
                   (len(gpu) + len(host)) / seconds, baseline)
    result["host_requests_in_sub_batch_0"] = in_first
    result["replayed_graph"] = replayed
    return result


def measure_async(engine: LLMEngine, gpu: list[Request], host: list[Request], batches: int,
                  baseline: float) -> dict:
    """GPU decode iterations back to back while ``batches`` host batches run beside them, each
    launched at the first iteration after the previous one completed (after a warm-up batch)."""
    runner = engine.runner
    gpu_plan = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=gpu)])
    host_batch = SubBatch(host_decodes=host)
    runner.launch_host_batch(host_batch)  # warm-up: captures the batch's pipeline graph
    runner.collect_host_batch(wait_seconds=float("inf"))
    iteration_seconds, host_periods, batch_seconds, launched_at = [], [], [], None
    start = time.perf_counter()
    while len(host_periods) < batches:
        if not runner.host_batch_in_flight:
            now = time.perf_counter()
            if launched_at is not None:
                host_periods.append(now - launched_at)
                if len(host_periods) == batches:
                    break
            launched_at = now
            runner.launch_host_batch(host_batch)
        began = time.perf_counter()
        runner.execute(gpu_plan)
        iteration_seconds.append(time.perf_counter() - began)
        completed = runner.collect_host_batch(wait_seconds=0.0)
        if completed is not None:
            batch_seconds.append(completed.seconds)
    window = time.perf_counter() - start
    if runner.host_batch_in_flight:
        runner.collect_host_batch(wait_seconds=float("inf"))
    tokens = len(gpu) * len(iteration_seconds) + len(host) * batches
    result = point("async", len(host), len(gpu),
                   {"gpu": statistics.median(iteration_seconds), "host": statistics.median(host_periods)},
                   tokens / window, baseline)
    result["gpu_iterations_per_host_batch"] = len(iteration_seconds) / batches
    # From launch until its tokens were on the host: the rest of the period waits for the
    # first iteration boundary after that.
    result["host_batch_ms"] = statistics.median(batch_seconds) * 1e3
    return result


def best_within(points: list[dict], bound_ms: float) -> dict | None:
    """The point with the highest ratio among those whose mean interval is within the bound."""
    within = [entry for entry in points if entry["mean_interval_ms"] <= bound_ms]
    return max(within, key=lambda entry: entry["ratio_to_gpu_only"], default=None)


def build_engine(args, pipeline: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=args.model, device=args.device, load_format="dummy", dtype=args.dtype,
                                  policy="neo", host_pipeline=pipeline, gpu_kv_cache_gib=args.gpu_kv_cache_gib,
                                  cpu_kv_cache_gib=args.cpu_kv_cache_gib, perf_model="zero",
                                  max_model_len=args.max_model_len, cpu_attention_threads=args.cpu_attention_threads))


def blocks_per_request(engine: LLMEngine, context: int) -> int:
    """Blocks of a request of ``context`` tokens with the slot of its next one."""
    return -(-(context + 1) // engine.config.block_size)


def fill_gpu_pool(engine: LLMEngine, profiler, context: int, limit: int | None) -> list[Request]:
    """As many GPU decodes of ``context`` tokens as the GPU pool holds (each with its next
    slot), at most ``limit``."""
    count = engine.layout.num_gpu_blocks // blocks_per_request(engine, context)
    if limit is not None:
        count = min(count, limit)
    if count < 1:
        raise SystemExit(f"the GPU pool ({engine.layout.num_gpu_blocks} blocks) holds no request of "
                         f"{context} tokens: raise --gpu-kv-cache-gib or lower --context")
    return profiler.allocate_requests(KVLocation.GPU, [context] * count)


def measure_pipeline(args, pipeline: str) -> tuple[list[dict], dict]:
    """The gpu-only point and every host count's point of one host pipeline, on one engine."""
    engine = build_engine(args, pipeline)
    try:
        profiler = engine.profiler
        gpu = fill_gpu_pool(engine, profiler, args.context, args.gpu_requests)
        needed = max(args.host_requests) * blocks_per_request(engine, args.context)
        if needed > engine.layout.num_host_blocks:
            raise SystemExit(f"{max(args.host_requests)} host requests of {args.context} tokens need "
                             f"{needed} host blocks; the host pool has {engine.layout.num_host_blocks}: "
                             f"raise --cpu-kv-cache-gib")
        host_all = profiler.allocate_requests(KVLocation.HOST, [args.context] * max(args.host_requests))
        info = {"device": device_name(engine.device), "host_threads": engine.worker.num_threads,
                "gpu_pool_blocks": engine.layout.num_gpu_blocks}
        try:
            baseline = measure_gpu_only(engine, gpu, args.repeats)
            points = [baseline]
            print(f"[{pipeline}] gpu-only: {len(gpu)} decodes, {baseline['gpu_interval_ms']:.1f} ms per "
                  f"iteration, {baseline['tokens_per_second']:.0f} tok/s", flush=True)
            for count in args.host_requests:
                host = host_all[:count]
                if pipeline == "lockstep":
                    result = measure_lockstep(engine, gpu, host, args.repeats, baseline["tokens_per_second"])
                else:
                    result = measure_async(engine, gpu, host, args.host_batches, baseline["tokens_per_second"])
                points.append(result)
                batch = f" (batch {result['host_batch_ms']:.1f} ms)" if "host_batch_ms" in result else ""
                print(f"[{pipeline}] {count:4d} host decodes: {result['tokens_per_second']:7.0f} tok/s "
                      f"({result['ratio_to_gpu_only']:.2f}x gpu-only), between tokens: mean "
                      f"{result['mean_interval_ms']:.1f} ms, GPU requests {result['gpu_interval_ms']:.1f} ms, "
                      f"host requests {result['host_interval_ms']:.1f} ms{batch}", flush=True)
        finally:
            for request in gpu + host_all:
                engine.block_manager.free(request)
        return points, info
    finally:
        engine.close()
        del engine
        release_device_memory()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b")
    parser.add_argument("--device", default=None, help="default: CUDA when available")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gpu-kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=16.0)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--context", type=int, default=750, help="tokens of every decode's context")
    parser.add_argument("--gpu-requests", type=int, default=None, help="GPU decodes (default: as many as the pool holds)")
    parser.add_argument("--host-requests", type=parse_counts, default=parse_counts("4,8,12,16,24,32,64"))
    parser.add_argument("--pipelines", default="lockstep,async")
    parser.add_argument("--intervals-ms", type=parse_intervals, default=parse_intervals("57.1,100,200"))
    parser.add_argument("--repeats", type=int, default=5, help="lockstep and gpu-only iterations timed per point")
    parser.add_argument("--host-batches", type=int, default=4, help="async host batches timed per point")
    parser.add_argument("--cpu-attention-threads", type=int, default=None, help="default: all cores but one")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    pipelines = [name.strip() for name in args.pipelines.split(",") if name.strip()]
    unknown = set(pipelines) - {"lockstep", "async"}
    if unknown or not pipelines:
        parser.error(f"--pipelines takes lockstep and/or async, got {args.pipelines!r}")
    report = {"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args).copy(), "pipelines": {}}
    for pipeline in pipelines:
        points, info = measure_pipeline(args, pipeline)
        report.update(info)
        report["pipelines"][pipeline] = points
    every_point = [entry for points in report["pipelines"].values() for entry in points]
    report["best_within"] = {}
    print(f"\n{report['device']}, {report['host_threads']} host threads, {args.model}, context {args.context}")
    for bound in args.intervals_ms:
        best = best_within(every_point, bound)
        report["best_within"][str(bound)] = best
        if best is None:
            print(f"  mean interval within {bound:g} ms: no point measured meets it")
        else:
            print(f"  mean interval within {bound:g} ms: best {best['ratio_to_gpu_only']:.2f}x gpu-only "
                  f"({best['pipeline']}, {best['host_requests']} host decodes, mean interval "
                  f"{best['mean_interval_ms']:.1f} ms, host requests {best['host_interval_ms']:.1f} ms)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
