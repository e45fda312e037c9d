"""Offline throughput of gpu-only, neo and full-offload side by side, same workloads and budgets.

Scenarios (dummy weights, bf16; see ``SCENARIOS``):

- ``32b-poor``: Qwen2.5-32B shapes, 2 GiB GPU KV pool, 64 GiB host pool, synthetic 500/500 and
  1000/300;
- ``8b-poor``: Llama-3.1-8B shapes, 2 GiB GPU KV pool, input 1000 with outputs 50 to 400;
- ``8b-full``: Llama-3.1-8B with the whole GPU, the Azure code trace and synthetic 1000/300;
- ``32b-threads``: the 32B memory-poor setting with 4, 8 and 15 host attention threads;
- ``70b-tp2``: Llama-3.1-70B shapes on two GPUs (tensor parallelism), the GPU pools what the
  weights leave of 95% of each GPU (the engine's default 90% leaves an 80 GB GPU almost no pool
  beside 70B's weights), a 40 GiB host pool per rank, synthetic 1000/300 and the Azure code
  trace (set the multi-GPU machine's variables, e.g. ``NCCL_NVLS_ENABLE=0``, in the
  environment: the ranks inherit it).

Each run submits all requests at once and reports the end-to-end throughput to completion and
the steady window's (``neo.bench``), each also as a ratio to gpu-only's; runs can be capped in
time (``--duration``, marked ``*`` in the table: their end-to-end figure covers what ran) so
that a sweep fits a session. The offloading policies
prefill every request that fits either pool up front, so a cap not much longer than that burst
measures mostly the burst (32B 1000/300: about 32 s for 300 requests; run 200 requests for
120 s to see the steady state). From the per-iteration
trace of the offloading policies it also reports the scheduler's accuracy (median
|predicted - measured| / measured iteration time), the median ratio of measured to profiled
host attention time (decode-only iterations: a check of the profiled table, which the
scheduler corrects online), and, for
two-sub-batch iterations, how much of the host attention hid under GPU work (1 - GPU idle /
host busy) and the GPU idle time; for the host batches of the async host pipeline
(``--host-pipelines lockstep,async`` runs each offloading policy both ways, ``--return-orders
oldest,most-remaining`` under both orders of ``EngineConfig.return_order``), their number,
prediction error, and how much of their host attention hid under GPU work (1 - the time steps
with no GPU work waited for them / host busy). For host batches it also reports the host side
against its bound: host decode tokens per second of host-batch time, and the bound, the host's
read bandwidth (a ``torch.sum`` probe over a rotated buffer of ``--read-probe-gib`` GiB on the
engine's host attention threads, ``read_probe.py``) over the K/V bytes a host decode read on
average (its context's K and V over every layer); and how the host batches' time splits: the
share in which the host functions ran (the host attending) and the K/V read rate while they ran;
and, right after each run to completion, the same CPU kernel alone on a sample of its host
batches' shapes, over the engine's host pool on its threads (``host_kernel_alone.py``): in the
engine over alone is the hand-off's cost to the host.
How much host batches slow the GPU's iterations beside them: the graph-replayed decodes' median
seconds and the prefills' median milliseconds per 1000 prompt tokens, planned beside a batch
and with none in flight.

    python benchmarks/offload.py --scenario 32b-poor --duration 60 --output-dir results/
"""

import argparse
import dataclasses
import datetime
import faulthandler
import gzip
import json
import logging
import os
import re
import signal
import statistics
import tempfile

from neo import EngineConfig, LLMEngine
from neo.bench import release_device_memory, run_offline_benchmark
from neo.config import RETURN_ORDERS
from neo.runner.host_worker import default_cpu_attention_threads
from host_kernel_alone import replay_host_batches
from read_probe import measure_read_bandwidth

POLICIES = ("gpu-only", "neo", "full-offload")

SCENARIOS = {
    "32b-poor": dict(model="qwen2.5-32b", gpu_kv_cache_gib=2.0, cpu_kv_cache_gib=64.0,
                     workloads=["synthetic:input=500,output=500", "synthetic:input=1000,output=300"]),
    "8b-poor": dict(model="llama-3.1-8b", gpu_kv_cache_gib=2.0, cpu_kv_cache_gib=64.0,
                    workloads=[f"synthetic:input=1000,output={output}" for output in (50, 100, 200, 300, 400)]),
    "8b-full": dict(model="llama-3.1-8b", gpu_kv_cache_gib=None, cpu_kv_cache_gib=64.0, max_model_len=8192,
                    workloads=["azure-code", "synthetic:input=1000,output=300"]),
    "70b-tp2": dict(model="llama-3.1-70b", gpu_kv_cache_gib=None, gpu_memory_utilization=0.95,
                    cpu_kv_cache_gib=40.0, max_model_len=4096, tensor_parallel_size=2,
                    workloads=["synthetic:input=1000,output=300", "azure-code"]),
    "32b-threads": dict(model="qwen2.5-32b", gpu_kv_cache_gib=2.0, cpu_kv_cache_gib=64.0,
                        workloads=["synthetic:input=500,output=500"], threads=(4, 8, 15),
                        policies=("gpu-only", "neo")),
}


def trace_statistics(trace: list[dict]) -> dict:
    """Scheduler accuracy and overlap from an engine's per-iteration trace (iterations, and the
    host batches of the async host pipeline)."""
    def prediction_errors(selected: list[dict]) -> list[float]:
        return [abs(r["predicted_seconds"] - r["measured_seconds"]) / r["measured_seconds"]
                for r in selected if r["predicted_seconds"] and r["measured_seconds"] > 0]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    records = [r for r in trace if not r["host_batch"]]
    host_batches = [r for r in trace if r["host_batch"]]
    errors = prediction_errors(records)
    # A host batch's prediction split: its host time, and the rest of it (GPU stages, hand-offs),
    # each measured over predicted; the rest of the batches that ran beside no prefill only, as
    # the scheduler's calibration takes it.
    batch_host_ratios = [r["host_busy_seconds"] / r["predicted_host_seconds"] for r in host_batches
                         if r["predicted_host_seconds"] and r["host_busy_seconds"] > 0]
    batch_rest_ratios = [(r["measured_seconds"] - r["host_busy_seconds"])
                         / (r["predicted_seconds"] - r["predicted_host_seconds"])
                         for r in host_batches if not r.get("host_batch_beside_prefill")
                         and r["predicted_seconds"] and r["predicted_host_seconds"] is not None
                         and r["predicted_seconds"] > r["predicted_host_seconds"]]
    two = [r for r in records if r["num_sub_batches"] == 2 and r["gpu_busy_seconds"] is not None]
    one = [r for r in records if r["num_sub_batches"] == 1 and r["gpu_busy_seconds"] is not None]

    def idle(record):
        return max(0.0, record["measured_seconds"] - record["gpu_busy_seconds"])

    host_busy = sum(r["host_busy_seconds"] for r in two)
    host_ratios = [r["host_busy_seconds"] / r["profiled_host_seconds"] for r in trace
                   if r["host_decodes"] and not r["prefill_tokens"] and r["profiled_host_seconds"] and r["host_busy_seconds"] > 0]
    gpu_idle_two = sum(idle(r) for r in two)

    def median_of(selected: list[dict], key: str) -> float | None:
        return statistics.median(r[key] for r in selected) if selected else None

    # Decode-only iterations without host work, split by how they ran: where two policies make
    # the same plans, these show whether their execution differs.
    decode_only = [r for r in records if r["num_sub_batches"] == 1 and not r["prefill_tokens"]
                   and not r["host_decodes"]]
    graphed = [r for r in decode_only if r["graph_replayed"]]
    eager = [r for r in decode_only if not r["graph_replayed"]]
    # Of those, the iterations that also moved blocks between the pools.
    swapping = [r for r in decode_only if r["blocks_swapped"]]
    # The same iterations, those that moved no blocks, while a host batch was in flight and
    # while none was (async host pipeline): how much the batches slow the GPU's iterations, as
    # the trace shows it.
    graphed_beside = [r for r in graphed if r.get("beside_host_batch") and not r["blocks_swapped"]]
    graphed_alone = [r for r in graphed if r.get("beside_host_batch") is False and not r["blocks_swapped"]]
    graph_errors = prediction_errors(graphed)
    # A host batch's attention hides under GPU work unless the engine had no GPU work and
    # waited for the batch.
    batch_host_busy = sum(r["host_busy_seconds"] for r in host_batches)
    batch_waits = sum(r["host_batch_wait_seconds"] for r in host_batches)
    # Prefill iterations, split into the step's phases: what the launching thread spent
    # beyond the GPU's busy time shows where it waited.
    prefills = [r for r in records if r["prefill_tokens"] and r["gpu_busy_seconds"] is not None]
    # Every prefill iteration planned beside a host batch and with none in flight (the GPU busy
    # time is not needed): measured milliseconds per 1000 prompt tokens, what host batches cost
    # prefills.
    prefill_ms_per_1k = {beside: [1e6 * r["measured_seconds"] / r["prefill_tokens"] for r in records
                                  if r["prefill_tokens"] and r.get("beside_host_batch") is beside]
                         for beside in (True, False)}
    freed = [r["device_segments_freed"] for r in records if r.get("device_segments_freed") is not None]
    return {
        "iterations": len(records),
        "two_batch_iterations": len(two),
        "median_relative_prediction_error": median(errors),
        "median_host_measured_over_profiled": median(host_ratios),
        "hidden_host_attention_share": (max(0.0, 1 - gpu_idle_two / host_busy) if host_busy else None),
        "host_batches": len(host_batches),
        "host_batch_median_relative_prediction_error": median(prediction_errors(host_batches)),
        "host_batch_median_host_measured_over_predicted": median(batch_host_ratios),
        "host_batch_median_rest_measured_over_predicted": median(batch_rest_ratios),
        "host_batches_beside_prefill": sum(bool(r.get("host_batch_beside_prefill")) for r in host_batches),
        "host_batch_hidden_share": max(0.0, 1 - batch_waits / batch_host_busy) if batch_host_busy else None,
        "median_host_batch_s": median([r["measured_seconds"] for r in host_batches]),
        "median_host_batch_requests": median([r["host_decodes"] for r in host_batches]),
        "gpu_idle_fraction_two_batch": gpu_idle_two / sum(r["measured_seconds"] for r in two) if two else None,
        "gpu_idle_fraction_one_batch": (sum(idle(r) for r in one) / sum(r["measured_seconds"] for r in one)
                                        if one else None),
        "mean_two_batch_iteration_s": statistics.mean(r["measured_seconds"] for r in two) if two else None,
        "schedule_seconds": sum(r["schedule_seconds"] for r in records),
        "graph_decode_iterations": len(graphed),
        "median_graph_decode_s": median_of(graphed, "measured_seconds"),
        "median_graph_decode_batch": median_of(graphed, "gpu_decodes"),
        "eager_decode_iterations": len(eager),
        "median_eager_decode_s": median_of(eager, "measured_seconds"),
        "swap_decode_iterations": len(swapping),
        "swap_decode_iterations_replayed": sum(r["graph_replayed"] for r in swapping),
        "median_swap_decode_s": median_of(swapping, "measured_seconds"),
        "median_swap_decode_blocks": median_of(swapping, "blocks_swapped"),
        "median_graph_decode_relative_error": statistics.median(graph_errors) if graph_errors else None,
        "median_graph_decode_beside_host_batch_s": median_of(graphed_beside, "measured_seconds"),
        "median_graph_decode_alone_s": median_of(graphed_alone, "measured_seconds"),
        "prefill_iterations": len(prefills),
        "median_prefill_s": median_of(prefills, "measured_seconds"),
        "median_prefill_gpu_busy_s": median_of(prefills, "gpu_busy_seconds"),
        "median_prefill_launch_s": median_of(prefills, "launch_seconds"),
        "median_prefill_queue_s": median_of(prefills, "queue_seconds"),
        "prefill_iterations_beside_host_batch": len(prefill_ms_per_1k[True]),
        "median_prefill_ms_per_1k_tokens_beside_host_batch": median(prefill_ms_per_1k[True]),
        "median_prefill_ms_per_1k_tokens_alone": median(prefill_ms_per_1k[False]),
        "device_segments_freed": sum(freed) if freed else None,
    }


def host_side(trace: list[dict], kv_bytes_per_token: int) -> dict | None:
    """The host batches' decode rate and K/V read rate (per second of host-batch time, one batch
    in flight at a time), and the K/V bytes a host decode read on average; None without host
    batches. The batches' time splits into the host attending (the host functions' time: KV
    store and attention kernels) and the rest, where the host waits for the batch's GPU stages
    and hand-off copies: ``host_attending_share``, and the K/V read rate while attending."""
    batches = [r for r in trace if r["host_batch"]]
    seconds = sum(r["measured_seconds"] for r in batches)
    tokens = sum(r["host_decodes"] for r in batches)
    if not tokens or seconds <= 0:
        return None
    kv_bytes = sum(r["host_context_tokens"] for r in batches) * kv_bytes_per_token
    attending = sum(r["host_busy_seconds"] for r in batches)
    return {"host_decode_tokens_per_s": tokens / seconds, "kv_bytes_per_host_token": kv_bytes / tokens,
            "host_kv_read_gbps": kv_bytes / seconds / 1e9, "host_batch_seconds": seconds,
            "host_attending_share": attending / seconds,
            "host_kv_read_gbps_attending": kv_bytes / attending / 1e9 if attending > 0 else None}


def policy_label(config: EngineConfig) -> str:
    """The policy with its host pipeline (``neo/async``, ``neo/lockstep``, ``neo/auto``), and
    the return order where it is not the default (``/oldest``): one label, and one trace file,
    per run of a benchmark."""
    if config.policy == "gpu-only":
        return config.policy
    return (f"{config.policy}/{config.host_pipeline}"
            + (f"/{config.return_order}" if config.return_order != EngineConfig.return_order else ""))


def save_trace(directory: str, config: EngineConfig, workload: str, records: list[dict]) -> str:
    name = f"trace-{policy_label(config)}-{config.cpu_attention_threads or 'all'}-{workload.replace('=', '')}"
    path = os.path.join(directory, re.sub(r"[^A-Za-z0-9.]+", "-", name) + ".json.gz")
    with gzip.open(path, "wt") as file:
        json.dump(records, file)
    return path


def run_policy(base: EngineConfig, workloads: list[str], num_requests: int, duration: float | None,
               traces_directory: str | None = None) -> list[dict]:
    """One engine for the policy, every workload in turn (the pools are empty between them).
    With ``traces_directory``, each run's per-iteration trace is written there (gzip JSON)."""
    results = []
    with tempfile.TemporaryDirectory() as directory:
        config = dataclasses.replace(base, trace_path=os.path.join(directory, "trace.json"))
        engine = LLMEngine(config)
        try:
            for workload in workloads:
                if engine.trace is not None:
                    engine.trace.records.clear()
                result = run_offline_benchmark(config, workload, num_requests, engine=engine,
                                               duration=duration, show_progress=True)
                records = [dataclasses.asdict(r) for r in engine.trace.records] if engine.trace else []
                result["trace"] = trace_statistics(records)
                interference = getattr(engine.scheduler.placement, "interference", None)  # async host pipeline
                result["trace"]["gpu_slowdown_beside_host_batches"] = interference.factor if interference else None
                layout = engine.kv_cache.layout
                result["host_side"] = host_side(records, layout.token_bytes)
                # A run cut short may leave a host batch attending: the replay waits for a whole run.
                result["kernel_alone"] = (replay_host_batches(engine, records)
                                          if result["host_side"] and not result["cut_short"] else None)
                if traces_directory is not None:
                    result["trace_file"] = save_trace(traces_directory, config, workload, records)
                result.pop("summary")
                ends = result["head_and_tail_s"]
                print(f"  {workload}: {result['output_tokens_per_s']:.1f} output tokens/s end to end"
                      f"{' (cut short)' if result['cut_short'] else ''}, "
                      f"{result['steady_output_tokens_per_s']:.1f} steady"
                      + (f"; first / last 10% of the tokens in {ends[0]:.2f} / {ends[1]:.2f} s" if ends else "")
                      + f"; trace {result['trace']}", flush=True)
                results.append(result)
        finally:
            engine.close()
            del engine
            release_device_memory()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--policies", default=None, help="comma-separated subset of gpu-only,neo,full-offload")
    parser.add_argument("--host-pipelines", default="async",
                        help="comma-separated host pipelines (lockstep, async) to run each offloading policy with")
    parser.add_argument("--return-orders", default=EngineConfig.return_order,
                        help="comma-separated return orders (oldest, most-remaining) to run each offloading "
                             "policy with")
    parser.add_argument("--workloads", default=None, help="';'-separated workloads instead of the scenario's")
    parser.add_argument("--threads", default=None,
                        help="comma-separated host attention thread counts instead of the scenario's")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--duration", type=float, default=None, help="seconds per run at most")
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the scenario's, else 4096")
    parser.add_argument("--perf-model", default="auto")
    parser.add_argument("--model", default=None, help="override the scenario's model")
    parser.add_argument("--gpu-kv-cache-gib", type=float, default=None, help="override the scenario's GPU pool")
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=None, help="override the scenario's host pool")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="the share of GPU memory the engine may use where the GPU pool is what the "
                             "weights leave (default: the scenario's, else the engine's)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="GPUs (ranks) per engine; default: the scenario's, else 1")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="replay captured CUDA graphs (--no-cuda-graphs: every iteration eagerly)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan each iteration before the previous one's tokens are read (default: the "
                             "engine's, on for CUDA devices)")
    parser.add_argument("--output-dir", default=".")
    parser.add_argument("--keep-traces", action="store_true",
                        help="also write each run's per-iteration trace (trace-*.json.gz)")
    parser.add_argument("--read-probe-gib", type=float, default=8.0,
                        help="buffer of the host read-bandwidth probe the host side is judged against (0: none)")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    scenario = SCENARIOS[args.scenario]
    policies = args.policies.split(",") if args.policies else list(scenario.get("policies", POLICIES))
    workloads = args.workloads.split(";") if args.workloads else scenario["workloads"]
    base = EngineConfig(model=args.model or scenario["model"], load_format="dummy", dtype="bfloat16",
                        gpu_kv_cache_gib=args.gpu_kv_cache_gib or scenario["gpu_kv_cache_gib"],
                        cpu_kv_cache_gib=args.cpu_kv_cache_gib or scenario["cpu_kv_cache_gib"],
                        gpu_memory_utilization=(args.gpu_memory_utilization or scenario.get("gpu_memory_utilization")
                                                or EngineConfig.gpu_memory_utilization),
                        max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len or scenario.get("max_model_len", 4096),
                        tensor_parallel_size=args.tensor_parallel_size or scenario.get("tensor_parallel_size", 1),
                        use_cuda_graphs=args.cuda_graphs,
                        async_scheduling=args.async_scheduling, perf_model=args.perf_model)
    report = {
        "scenario": args.scenario,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": None,
        "host_cpus": os.cpu_count(),
        "arguments": vars(args),
        "runs": [],
    }
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, f"offload-{args.scenario}.json")
    runs = report["runs"]
    # gpu-only runs no host attention: once, whatever the scenario's host thread counts.
    pipelines = args.host_pipelines.split(",")
    thread_counts = ([int(count) for count in args.threads.split(",")] if args.threads
                     else scenario.get("threads", (None,)))
    orders = args.return_orders.split(",")
    unknown = [order for order in orders if order not in RETURN_ORDERS]
    if unknown:
        parser.error(f"--return-orders: unknown {', '.join(unknown)}; choose from {', '.join(RETURN_ORDERS)}")
    runs_to_make = [(policy, threads, pipeline, order) for policy in policies
                    for threads in (thread_counts if policy != "gpu-only" else (None,))
                    for pipeline in (pipelines if policy != "gpu-only" else ["lockstep"])
                    for order in (orders if policy != "gpu-only" else [EngineConfig.return_order])]
    probes = {}  # host attention threads -> GB/s, measured before any engine holds memory
    if args.read_probe_gib > 0:
        for threads in {threads or default_cpu_attention_threads() for policy, threads, _, _ in runs_to_make
                        if policy != "gpu-only"}:
            probes[threads] = measure_read_bandwidth(int(args.read_probe_gib * (1 << 30)), threads)
            print(f"host read probe: {probes[threads]:.1f} GB/s on {threads} threads", flush=True)
    report["host_read_gbps"] = probes
    for policy, threads, pipeline, order in runs_to_make:
        config = dataclasses.replace(base, policy=policy, cpu_attention_threads=threads, host_pipeline=pipeline,
                                     return_order=order)
        label = policy_label(config)
        print(f"{args.scenario}: {label}" + (f", {threads} host threads" if threads else ""), flush=True)
        for result in run_policy(config, workloads, args.num_requests, args.duration,
                                 args.output_dir if args.keep_traces else None):
            probe = probes.get(threads or default_cpu_attention_threads())
            if result.get("host_side") and probe:
                bound = probe * 1e9 / result["host_side"]["kv_bytes_per_host_token"]
                result["host_side"] |= {"host_read_gbps": probe, "bound_tokens_per_s": bound,
                                        "share_of_bound": result["host_side"]["host_decode_tokens_per_s"] / bound}
            runs.append({**result, "policy": label, "threads": threads})
            report["device"] = result["device"]
            with open(path, "w") as file:  # after every run, so a cut-off sweep keeps its part
                json.dump(report, file, indent=1, default=str)
    print(f"\n{args.scenario} on {report['device']} ({report['date']})")
    print("output tokens/s end to end (* cut short at --duration: over what ran) and in the steady window, "
          "each also over gpu-only's")
    print(f"{'workload':<34} {'policy':<25} {'thr':>4} {'e2e tok/s':>11} {'vs g-o':>7} {'steady tok/s':>13} "
          f"{'vs g-o':>7} {'2-batch':>8} {'host b.':>8} {'pred err':>9} {'b. err':>7} {'host m/p':>9} {'hidden':>7}")
    for run in runs:
        baseline = next((r for r in runs if r["policy"] == "gpu-only" and r["workload"] == run["workload"]), None)

        def over_baseline(key: str) -> float:
            return run[key] / baseline[key] if baseline and baseline[key] else float("nan")

        end_to_end = f"{run['output_tokens_per_s']:.1f}{'*' if run['cut_short'] else ''}"
        trace = run["trace"]
        metrics = run["metrics"]
        share = metrics["two_batch_iterations"] / metrics["iterations"] if metrics["iterations"] else 0.0
        error = trace["median_relative_prediction_error"]
        batch_error = trace["host_batch_median_relative_prediction_error"]
        hidden = trace["hidden_host_attention_share"] if not trace["host_batches"] else trace["host_batch_hidden_share"]
        host_ratio = trace["median_host_measured_over_profiled"]

        def shown(value, digits):
            return "-" if value is None else f"{value:.{digits}f}"

        print(f"{run['workload']:<34} {run['policy']:<25} {run['threads'] or '-':>4} "
              f"{end_to_end:>11} {over_baseline('output_tokens_per_s'):7.2f} "
              f"{run['steady_output_tokens_per_s']:13.1f} {over_baseline('steady_output_tokens_per_s'):7.2f} "
              f"{share:8.2f} {trace['host_batches']:8d} "
              f"{shown(error, 3):>9} {shown(batch_error, 3):>7} {shown(host_ratio, 2):>9} {shown(hidden, 2):>7}")
    host_runs = [run for run in runs if run.get("host_side")]
    if host_runs:
        print("host side (per second of host-batch time): host decode tokens/s, the bound (host read GB/s over "
              "the K/V bytes of an average host decode) and the share of it")
        for run in host_runs:
            side = run["host_side"]
            bound = (f"{side['bound_tokens_per_s']:10.1f} {100 * side['share_of_bound']:5.0f}% "
                     f"({side['host_read_gbps']:.1f} GB/s / {side['kv_bytes_per_host_token'] / 1e6:.1f} MB)"
                     if "bound_tokens_per_s" in side else "  (no probe)")
            print(f"{run['workload']:<34} {run['policy']:<25} {run['threads'] or '-':>4} "
                  f"{side['host_decode_tokens_per_s']:10.1f} {bound}; K/V read {side['host_kv_read_gbps']:.1f} GB/s, "
                  f"attending {100 * side['host_attending_share']:.0f}% of the time"
                  + (f" at {side['host_kv_read_gbps_attending']:.1f} GB/s" if side["host_kv_read_gbps_attending"] else ""))
        print("host attention in the engine (the batches' host functions) over the same kernel alone on the "
              "same shapes, pool and threads right after the run, sampled batches, and their K/V read rates")
        for run in host_runs:
            alone = run.get("kernel_alone")
            print(f"{run['workload']:<34} {run['policy']:<25} {run['threads'] or '-':>4} "
                  + ("-" if alone is None else
                     f"{alone['engine_over_alone']:.2f}x over {alone['batches']} batches: "
                     f"{alone['kv_read_gbps_engine']:.1f} GB/s in the engine, {alone['kv_read_gbps_alone']:.1f} alone"))
        print("host batches' estimates, median measured over predicted: their host time, and the rest of them "
              "(GPU stages, hand-offs) in the batches beside no prefill")
        for run in host_runs:
            trace = run["trace"]
            host, rest = (trace["host_batch_median_host_measured_over_predicted"],
                          trace["host_batch_median_rest_measured_over_predicted"])
            print(f"{run['workload']:<34} {run['policy']:<25} {run['threads'] or '-':>4} "
                  f"host {'-' if host is None else f'{host:.3f}'}, rest {'-' if rest is None else f'{rest:.2f}'} "
                  f"({trace['host_batches'] - trace['host_batches_beside_prefill']} of {trace['host_batches']} batches)")
    print(f"written {path}")


if __name__ == "__main__":
    main()
