"""Cost of the host hand-off: one layer's host decode attention inside the engine vs alone.

For each host batch (requests x tokens) it times, on one engine (zero perf model, its own
model, pools and host functions):

- ``alone``: ``store_kv_cache`` + ``paged_decode_attention`` on the host cache of one layer,
  called back to back from this thread with the engine's host thread count (the kernels'
  own cost);
- ``engine``: the same host work as a plan through the executor: one sub-batch of host
  decodes, per layer the host function's time between events on the copy stream;
- ``pipelined``: the requests split over two sub-batches beside one GPU decode (the two-sub-
  batch pipeline), host time per layer and sub-batch, the iteration's wall time and the time
  the launching thread took to queue it (until ``execute``'s ``on_launched``), queued eagerly
  layer by layer and, where the engine has pipeline graphs, replayed from a CUDA graph;
- ``gpu pair``: the same two sub-batch sizes as GPU decodes of one block each (the pipeline's
  GPU work and launches with no host work), wall and launch time.

The ratio engine / alone is what the hand-off (CUDA host functions, thread wake-ups,
contention with the launching thread) adds to the kernels; pipelined minus gpu pair is what
the host work adds to a two-sub-batch iteration; a launch time near the wall time means the
launching thread, not the GPU, set the pace. CUDA only.

    python benchmarks/host_handoff.py --model qwen2.5-32b [--batches 1x256,8x256,16x1024] [--json out.json]
        [--trace-dir DIR]  # a torch.profiler trace (Chrome JSON, gzipped) of one pipelined iteration per batch
"""

import argparse
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from neo import EngineConfig, LLMEngine
from neo.bench import device_name
from neo.request import KVLocation
from neo.sched.scheduler_output import SchedulerOutput, SubBatch


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def time_alone(engine: LLMEngine, requests, repeats: int) -> float:
    """Seconds per layer of the host kernels called back to back on one layer's host cache."""
    config = engine.model_config
    count = len(requests)
    query = torch.randn(count, config.num_heads, config.head_dim, dtype=engine.dtype)
    key = torch.randn(count, config.num_kv_heads, config.head_dim, dtype=engine.dtype)
    output = torch.empty_like(query)
    block_size = engine.config.block_size
    width = max(len(r.block_table) for r in requests)
    table = torch.tensor([r.block_table + [0] * (width - len(r.block_table)) for r in requests], dtype=torch.int32)
    lengths = torch.tensor([r.num_tokens for r in requests], dtype=torch.int32)
    slots = torch.tensor([r.block_table[(r.num_tokens - 1) // block_size] * block_size + (r.num_tokens - 1) % block_size
                          for r in requests], dtype=torch.int64)
    k_cache, v_cache = engine.kv_cache.host_layers[0]
    kernels = engine.runner.executor.host_kernels
    threads = torch.get_num_threads()
    torch.set_num_threads(engine.worker.num_threads)
    try:
        samples = []
        for _ in range(repeats + 5):
            start = time.perf_counter()
            kernels.store.function(key, key, k_cache, v_cache, slots)
            kernels.attention.function(output, query, k_cache, v_cache, table, lengths, config.head_dim ** -0.5)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[5:])
    finally:
        torch.set_num_threads(threads)


def time_plan(engine: LLMEngine, plan: SchedulerOutput, repeats: int) -> tuple[float, float, float, bool]:
    """(host seconds, wall seconds, launch seconds) of one iteration of ``plan``, medians after
    a warm-up, and whether it replayed a graph."""
    host, wall, launch = [], [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        launched = []
        output = engine.runner.execute(plan, on_launched=lambda: launched.append(time.perf_counter()))
        wall.append(time.perf_counter() - start)
        launch.append(launched[0] - start)
        host.append(output.host_seconds)
    return (statistics.median(host[1:]), statistics.median(wall[1:]), statistics.median(launch[1:]),
            output.replayed_graph)


def write_trace(engine: LLMEngine, plan: SchedulerOutput, path: str) -> None:
    """One iteration of ``plan`` under torch.profiler (launches on the host, kernels, copies),
    as a gzipped Chrome trace."""
    engine.runner.execute(plan)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.HOST,
                                            torch.profiler.ProfilerActivity.CUDA]) as profile:
        engine.runner.execute(plan)
    with tempfile.TemporaryDirectory() as directory:
        raw = os.path.join(directory, "trace.json")
        profile.export_chrome_trace(raw)
        with open(raw, "rb") as source, gzip.open(path, "wb") as destination:
            shutil.copyfileobj(source, destination)


def measure(engine: LLMEngine, count: int, length: int, repeats: int, trace_path: str | None = None) -> dict:
    profiler = engine.profiler
    layers = engine.model_config.num_layers
    host = profiler.allocate_requests(KVLocation.HOST, [length] * count)
    gpu = profiler.allocate_requests(KVLocation.GPU, [length])
    half = max(1, count // 2)
    second = max(1, count - half)
    pair = profiler.allocate_requests(KVLocation.GPU, [engine.config.block_size] * (half + second))
    try:
        alone = time_alone(engine, host, repeats)
        engine_host, engine_wall, _, _ = time_plan(engine, SchedulerOutput(sub_batches=[SubBatch(host_decodes=host)]),
                                                   repeats)
        pipelined = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=gpu, host_decodes=host[:half]),
                                                 SubBatch(host_decodes=host[half:] or host[:1])])
        coverage = engine.runner.graph_coverage
        graphs = coverage.pipeline_max_requests
        coverage.pipeline_max_requests = 0  # eagerly
        try:
            pipelined_host, pipelined_wall, pipelined_launch, _ = time_plan(engine, pipelined, repeats)
        finally:
            coverage.pipeline_max_requests = graphs
        graphed = None
        if graphs:
            *graphed, replayed = time_plan(engine, pipelined, repeats)
            if not replayed:
                raise RuntimeError(f"the pipelined {count} x {length} plan did not replay a pipeline graph")
        gpu_pair = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=gpu + pair[:half]),
                                                SubBatch(gpu_decodes=pair[half:])])
        _, pair_wall, pair_launch, _ = time_plan(engine, gpu_pair, repeats)
        if trace_path is not None:  # last: launches stay slower for a while after profiling
            write_trace(engine, pipelined, trace_path)
    finally:
        for request in host + gpu + pair:
            engine.block_manager.free(request)
    return {
        "requests": count, "tokens_per_request": length,
        "alone_us_per_layer": alone * 1e6,
        "engine_us_per_layer": engine_host / layers * 1e6,
        "engine_over_alone": engine_host / layers / alone,
        "engine_iteration_ms": engine_wall * 1e3,
        "pipelined_us_per_layer_and_sub_batch": pipelined_host / (2 * layers) * 1e6,
        "pipelined_iteration_ms": pipelined_wall * 1e3,
        "pipelined_launch_ms": pipelined_launch * 1e3,
        "graphed_us_per_layer_and_sub_batch": graphed[0] / (2 * layers) * 1e6 if graphed else None,
        "graphed_iteration_ms": graphed[1] * 1e3 if graphed else None,
        "graphed_launch_ms": graphed[2] * 1e3 if graphed else None,
        "gpu_pair_iteration_ms": pair_wall * 1e3,
        "gpu_pair_launch_ms": pair_launch * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batches", default="1x256,8x256,16x1024", help="host batches as REQUESTSxTOKENS")
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-attention-threads", type=int, default=None, help="default: all cores but one")
    parser.add_argument("--cpu-attention-kernel", default="auto", help="the host's decode-attention kernel")
    parser.add_argument("--json", default=None)
    parser.add_argument("--trace-dir", default=None, help="write a profiler trace of one pipelined iteration per batch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_handoff.py measures CUDA host functions: it needs a CUDA device")
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", policy="neo",
                                    gpu_kv_cache_gib=1.0, cpu_kv_cache_gib=args.cpu_kv_cache_gib,
                                    perf_model="zero", max_model_len=4096,
                                    cpu_attention_threads=args.cpu_attention_threads,
                                    cpu_attention_kernel=args.cpu_attention_kernel))
    if not engine.runner.executor.stream_ordered_host_work:
        raise SystemExit("the host work runs on the worker thread here (a CPU attention kernel written in "
                         "Python, or no CUDA extension): nothing to measure")
    results = []
    try:
        for batch in args.batches.split(","):
            count, length = (int(part) for part in batch.split("x"))
            trace_path = None
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                trace_path = os.path.join(args.trace_dir, f"handoff-{args.model}-{batch}.json.gz")
            result = measure(engine, count, length, args.repeats, trace_path)
            results.append(result)
            print(f"{count:4d} x {length:5d}: alone {result['alone_us_per_layer']:7.0f} us/layer | engine "
                  f"{result['engine_us_per_layer']:7.0f} us/layer ({result['engine_over_alone']:.2f}x alone), "
                  f"iteration {result['engine_iteration_ms']:6.1f} ms | pipelined "
                  f"{result['pipelined_us_per_layer_and_sub_batch']:7.0f} us/layer/sub-batch, iteration "
                  f"{result['pipelined_iteration_ms']:6.1f} ms (launch {result['pipelined_launch_ms']:5.1f}) | "
                  f"gpu pair {result['gpu_pair_iteration_ms']:6.1f} ms (launch {result['gpu_pair_launch_ms']:5.1f})",
                  flush=True)
            if result["graphed_iteration_ms"] is not None:
                print(f"             graphed: {result['graphed_us_per_layer_and_sub_batch']:7.0f} us/layer/sub-batch, "
                      f"iteration {result['graphed_iteration_ms']:6.1f} ms (launch {result['graphed_launch_ms']:5.1f})",
                      flush=True)
    finally:
        engine.close()
    report = {"device": device_name(engine.device), "model": args.model,
              "host_threads": engine.worker.num_threads, "results": results}
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
