"""Online serving benchmark: latency and goodput against request rate, one ``neo serve`` per
policy, reported as vLLM's ``vllm bench serve`` reports them.

For each policy (gpu-only, neo, full-offload by default) a server is started with the engine
options given after the benchmark's own (``--`` may separate them); for each request rate the
client sends streaming requests over HTTP with Poisson arrivals (``--burstiness``: gamma
arrivals, as vLLM's; or the trace's own or scaled arrival times), at most
``--max-concurrency`` in flight, forcing each request's output length, and times every token.
Every policy sees the same requests (same seeds).

Per policy and rate: TTFT, TPOT, ITL and end-to-end latency (E2EL), each mean / median / p90 /
p99 over the finished requests, with the count of unfinished ones (not done by the drain
timeout, or failed) beside them; request and output token throughput; and with ``--goodput
ttft:MS tpot:MS`` (also ``e2el:MS``) the fraction of requests meeting every objective, the
unfinished ones counting as misses. Over the sweep: each policy's goodput rate, the highest
rate at which ``--goodput-target`` of requests meet the objectives, and its ratio to
gpu-only's. The per-token latency knee analysis follows, second. Definitions in
``online_stats``.

Results in ``--output-dir``: ``online[-TAG]-sweep.json`` (every request's record, per-rate
summaries with the engine counters of that load, the goodput rates, the knee analysis,
command, device and date), ``online[-TAG]-latency-goodput-vs-rate.png``,
``online[-TAG]-latency-vs-rate.png``, ``online[-TAG]-latency-cdf.png``, one server log per
policy; the tables are printed last.

Goodput vs load (Qwen2.5-32B shapes, 2 GiB GPU KV pool)::

    python benchmarks/online.py --rates 0.25,0.5,0.75,1,1.5 --duration-per-rate 300 \\
        --workload synthetic:input=500,output=500 --goodput ttft:2000 tpot:100 -- \\
        --model qwen2.5-32b --load-format dummy --dtype bfloat16 --gpu-kv-cache-gib 2 \\
        --cpu-kv-cache-gib 64

A trace of one's own (``file:PATH``, CSV or JSONL: see ``neo.bench.trace_files``), re-timed
to each rate::

    python benchmarks/online.py --workload file:requests.jsonl --arrivals scaled --rates 1,2,4 \\
        --goodput ttft:1000 tpot:50 -- --model llama-3.1-8b --load-format dummy --dtype bfloat16

One policy per command (``--append`` merges into the same JSON, then plots all policies)::

    python benchmarks/online.py --tag 32b --append --policies neo ... -- <same engine options>

Azure code trace, re-timed to each rate::

    python benchmarks/online.py --workload azure-code --arrivals scaled --rates 1,2,4,8 \\
        --repeats 3 -- --model llama-3.1-8b --load-format dummy --dtype bfloat16

Policies measured in separate calls (other machine starts): analyze and plot them together
again, without running a server (also sweeps written before ITL and goodput were reported:
their records hold every other figure; ``--goodput`` sets the objectives afresh)::

    python benchmarks/online.py --mode report --output-dir DIR --tag 8b-azure \\
        --merge OTHER_DIR/online-8b-azure-sweep.json --goodput ttft:2000 tpot:100

Server overhead (one streaming request through HTTP vs ``LLM.generate`` in this process)::

    python benchmarks/online.py --mode overhead --policies gpu-only -- --model llama-3.1-8b \\
        --load-format dummy --dtype bfloat16
"""

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
import traceback

from online_client import ARRIVALS, PlannedRequest, plan_requests, run_load, single_request_token_times
from online_plots import plot_field_metrics, plot_latency_cdf, plot_latency_vs_rate
from online_server import ServerProcess, metric_value
from online_stats import (compare_to_reference, goodput_rates, knee_value, knees, level_position,
                          parse_goodput, summarize)

from neo.bench import release_device_memory
from neo.cli import build_parser, engine_config_from_args
from neo.config import POLICIES
from neo.models.loader import resolve_model_config
from neo.bench.workloads import WORKLOAD_FORMS, parse_workload, random_prompt

REFERENCE_POLICY = "gpu-only"
DEFAULT_GOODPUT_TARGET = 0.9
RESERVED_ENGINE_OPTIONS = ("--policy", "--host", "--port")
# Engine counters whose change over a load level goes into its summary.
ENGINE_COUNTERS = ("iterations", "two_batch_iterations", "prefill_tokens", "gpu_decode_tokens",
                   "host_decode_tokens", "preemptions", "blocks_swapped_out", "blocks_swapped_in")


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Latency against load over HTTP, one neo serve per policy; arguments the "
                    "benchmark does not know (or all after --) go to neo serve.",
        allow_abbrev=False)
    parser.add_argument("--mode", choices=("sweep", "overhead", "report"), default="sweep",
                        help="sweep: latency vs request rate; overhead: one request through "
                             "HTTP vs LLM.generate; report: analyze and plot the sweep already in "
                             "--output-dir (--tag) again, with --merge's policies, no server")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policies (default: %(default)s)")
    parser.add_argument("--rates", default="0.5,1,2,4",
                        help="comma-separated request rates (requests/s)")
    parser.add_argument("--workload", default="synthetic:input=500,output=500",
                        help=f"{WORKLOAD_FORMS} (synthetic lengths +-10%%)")
    parser.add_argument("--arrivals", choices=ARRIVALS, default="poisson",
                        help="poisson at each rate, the trace's own times (trace: one load "
                             "level), or the trace re-timed to each rate (scaled)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="poisson arrivals: gamma-distributed gaps of this shape and mean "
                             "1/rate (1: Poisson; below 1: burstier)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="at most this many requests in flight (default: no limit)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="latency objectives a request must meet to count as good, e.g. "
                             "ttft:2000 tpot:100 (NAME: ttft, tpot, e2el; milliseconds)")
    parser.add_argument("--goodput-target", type=float, default=None,
                        help="fraction of requests that must meet the objectives for a rate to "
                             f"count in the goodput rate (default: the sweep's, else "
                             f"{DEFAULT_GOODPUT_TARGET:g})")
    parser.add_argument("--rate-axis", choices=("offered", "achieved"), default="offered",
                        help="where a load level sits in the goodput and knee analyses: the rate "
                             "asked for, or the arrival rate its requests were actually sent at "
                             "(a short level's Poisson sample can be 20%% off the rate asked for)")
    parser.add_argument("--duration-per-rate", type=float, default=120.0,
                        help="seconds of arrivals per load level")
    parser.add_argument("--max-requests-per-rate", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per load level (different seeds), to measure the noise")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="seconds to wait after the last arrival before cancelling the rest")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a request may wait for its next token")
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--knee-factor", type=float, default=2.0,
                        help="knee threshold: this times gpu-only's lowest-rate mean per-token latency")
    parser.add_argument("--slo-ms", type=float, default=None,
                        help="knee threshold as an explicit per-token latency (ms)")
    parser.add_argument("--cdf-rate", type=float, default=None,
                        help="rate of the latency distribution plot (default: the highest "
                             "tested rate not above gpu-only's knee)")
    parser.add_argument("--overhead-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds to wait for a server to become healthy (profiling "
                             "included)")
    parser.add_argument("--output-dir", default=None,
                        help="default: results/raw/online-<mode>-<date>")
    parser.add_argument("--tag", default="",
                        help="name part of the output files (online-<tag>-sweep.json, ...), to "
                             "keep several runs in one directory")
    parser.add_argument("--merge", nargs="+", default=[], metavar="SWEEP_JSON",
                        help="report: fold in the load levels of these sweep files (same workload, "
                             "arrivals and engine options; other policies, or other rates of a policy "
                             "already there: runs of other machine starts or calls)")
    parser.add_argument("--append", action="store_true",
                        help="sweep: keep the other policies' results already in the sweep's "
                             "JSON file (same workload, arrivals and engine options), so "
                             "policies can be run one command at a time")
    args, engine_args = parser.parse_known_args(argv)
    engine_args = [arg for arg in engine_args if arg != "--"]
    try:
        parse_goodput(args.goodput or [])
    except ValueError as error:
        parser.error(str(error))
    if args.goodput_target is not None and not 0 < args.goodput_target <= 1:
        parser.error(f"--goodput-target must be in (0, 1], got {args.goodput_target:g}")
    if args.mode == "report":
        if args.output_dir is None or engine_args:
            parser.error("--mode report reads --output-dir's sweep and takes no engine options")
        return args, engine_args
    if args.merge:
        parser.error("--merge is for --mode report")
    for option in RESERVED_ENGINE_OPTIONS:
        if any(arg == option or arg.startswith(option + "=") for arg in engine_args):
            parser.error(f"{option} is set by the benchmark; leave it out of the engine options")
    args.policies = [policy.strip() for policy in args.policies.split(",") if policy.strip()]
    unknown = [policy for policy in args.policies if policy not in POLICIES]
    if unknown or not args.policies:
        parser.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    args.rates = [None] if args.arrivals == "trace" else sorted(
        float(rate) for rate in args.rates.split(","))
    if any(rate is not None and rate <= 0 for rate in args.rates):
        parser.error("rates must be positive")
    if args.repeats < 1 or args.overhead_repeats < 1 or args.max_requests_per_rate < 1:
        parser.error("--repeats, --overhead-repeats and --max-requests-per-rate must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        parser.error(f"--burstiness must be > 0, got {args.burstiness:g}")
    if args.burstiness != 1.0 and args.arrivals != "poisson":
        parser.error(f"--burstiness applies to poisson arrivals, not --arrivals {args.arrivals}")
    try:
        first = parse_workload(args.workload, 1, seed=args.seed)[0]
    except ValueError as error:
        parser.error(f"--workload: {error}")
    if args.arrivals != "poisson" and first.arrival_offset is None:
        parser.error(f"--arrivals {args.arrivals} needs a workload with arrival times (azure-code, "
                     f"or a trace file with TIMESTAMP / arrival_s), got {args.workload!r}")
    return args, engine_args


def engine_config(engine_args: list[str], policy: str):
    """The ``EngineConfig`` ``neo serve`` builds from these options (validates them early)."""
    return engine_config_from_args(build_parser().parse_args(["serve", *engine_args,
                                                              "--policy", policy]))


def output_path(args, name: str) -> str:
    """``<output dir>/online[-<tag>]-<name>``."""
    prefix = "-".join(part for part in ("online", args.tag) if part)
    return os.path.join(args.output_dir, f"{prefix}-{name}")


def rate_label(rate: float | None) -> str:
    return "trace timing" if rate is None else f"{rate:g} req/s"


def save_json(path: str, results: dict) -> None:
    temporary = path + ".part"
    with open(temporary, "w") as file:
        json.dump(results, file, indent=1)
    os.replace(temporary, path)


# -- sweep ---------------------------------------------------------------------------------------


def counters(server: ServerProcess) -> dict[str, float]:
    families = server.metrics()
    return {name: metric_value(families, f"neo_{name}_total") for name in ENGINE_COUNTERS}


def engine_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    delta = {name: after[name] - before[name] for name in ENGINE_COUNTERS}
    decodes = delta["gpu_decode_tokens"] + delta["host_decode_tokens"]
    delta["two_batch_share"] = (delta["two_batch_iterations"] / delta["iterations"]
                                if delta["iterations"] else None)
    delta["host_decode_share"] = delta["host_decode_tokens"] / decodes if decodes else None
    return delta


def warm_up(server: ServerProcess, args, model: str, vocab_size: int, max_model_len: int) -> None:
    if args.warmup_requests == 0:
        return
    items = plan_requests(args.workload, "poisson", 1.0, math.inf, args.warmup_requests,
                          args.seed + 1000, max_model_len)
    planned = [PlannedRequest(item.index, 0.0, item.prompt_len, min(item.output_len, 16))
               for item in items]
    records = asyncio.run(run_load(server.url, model, planned, vocab_size, args.seed + 1000,
                                   args.request_timeout, args.drain_timeout))
    failed = [record.error for record in records if record.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[0]}")


def sweep_policy(policy: str, args, engine_args: list[str], vocab_size: int, results: dict,
                 json_path: str) -> None:
    log_path = output_path(args, f"server-{policy}.log")
    with ServerProcess(policy, engine_args, log_path, startup_timeout=args.startup_timeout) as server:
        card = server.model_card()
        info = server.metrics()["neo_engine_info"][0][0]
        results["policies"][policy] = {"engine_info": info, "server_log": log_path}
        results.setdefault("device", info.get("device"))
        print(f"[{policy}] serving {card['id']} on {info.get('device')} ({server.url})", flush=True)
        warm_up(server, args, card["id"], vocab_size, card["max_model_len"])
        server.wait_until_idle()
        for rate in args.rates:
            level_records = []
            before = counters(server)
            for repeat in range(args.repeats):
                seed = args.seed + repeat
                planned = plan_requests(args.workload, args.arrivals, rate, args.duration_per_rate,
                                        args.max_requests_per_rate, seed, card["max_model_len"],
                                        args.burstiness)
                records = asyncio.run(run_load(server.url, card["id"], planned, vocab_size, seed,
                                               args.request_timeout, args.drain_timeout,
                                               args.max_concurrency))
                server.wait_until_idle()
                level_records += [record.as_dict() | {"policy": policy, "rate": rate, "repeat": repeat}
                                  for record in records]
            summary = summarize(level_records, rate, parse_goodput(args.goodput or [])) | {"policy": policy}
            summary["engine"] = engine_summary(before, counters(server))
            results["summaries"].append(summary)
            results["records"] += level_records
            save_json(json_path, results)
            fraction = summary["goodput"]["fraction"]
            print(f"[{policy}] {rate_label(rate)}: {summary['completed']}/{summary['sent']} done, "
                  f"TTFT median {_ms(summary['ttft']['median'])} ms p99 {_ms(summary['ttft']['p99'])} ms, "
                  f"TPOT median {_ms(summary['tpot']['median'])} ms p99 {_ms(summary['tpot']['p99'])} ms"
                  + ("" if fraction is None else f", {fraction:.1%} within the goodput objectives"),
                  flush=True)


def new_sweep_results(args, engine_args: list[str], json_path: str) -> dict:
    """A fresh results dict, holding the other policies' results of an earlier run when
    ``--append`` is given."""
    run = {"command": shlex.join([sys.executable, *sys.argv]),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "policies": args.policies}
    results = run | {"host": platform.node(), "mode": "sweep", "settings": vars(args),
                     "engine_args": engine_args, "runs": [run], "policies": {},
                     "summaries": [], "records": []}
    if not (args.append and os.path.exists(json_path)):
        return results
    with open(json_path) as file:
        previous = json.load(file)
    check_same_setup(previous, results, json_path, "--append")
    kept = [policy for policy in previous["policies"] if policy not in args.policies]
    results["runs"] = previous["runs"] + [run]
    results["device"] = previous.get("device")
    results["policies"] = {policy: previous["policies"][policy] for policy in kept}
    results["summaries"] = [entry for entry in previous["summaries"] if entry["policy"] in kept]
    results["records"] = [entry for entry in previous["records"] if entry["policy"] in kept]
    return results


# Settings a merged sweep must share, with the value of sweeps written before the setting existed.
SHARED_SETTINGS = {"workload": None, "arrivals": None, "burstiness": 1.0, "max_concurrency": None}


def check_same_setup(previous: dict, current: dict, path: str, option: str) -> None:
    """Sweeps merged into one must share workload, arrivals (and their burstiness), the
    concurrency limit and engine options."""
    for key, default in SHARED_SETTINGS.items():
        before, now = previous["settings"].get(key, default), current["settings"].get(key, default)
        if before != now:
            raise SystemExit(f"{option}: {path} was measured with {key} {before!r}, not {now!r}")
    if previous["engine_args"] != current["engine_args"]:
        raise SystemExit(f"{option}: {path} was measured with engine options "
                         f"{previous['engine_args']}, not {current['engine_args']}")


def run_sweep(args, engine_args: list[str], vocab_size: int) -> None:
    json_path = output_path(args, "sweep.json")
    results = new_sweep_results(args, engine_args, json_path)
    num_levels = len(args.rates) * args.repeats
    print(f"sweep: {len(args.policies)} policies x {num_levels} load levels of "
          f"{args.duration_per_rate:g} s (+ up to {args.drain_timeout:g} s drain each), "
          f"output in {args.output_dir}", flush=True)
    for policy in args.policies:
        try:
            sweep_policy(policy, args, engine_args, vocab_size, results, json_path)
        except Exception as error:  # the other policies still run; the table reports it
            traceback.print_exc()
            results["policies"].setdefault(policy, {})["error"] = f"{type(error).__name__}: {error}"
    report_sweep(results, args, json_path)


def run_report(args) -> None:
    """Analyze and plot a finished sweep again, folding in the policies of ``--merge``'s files."""
    json_path = output_path(args, "sweep.json")
    if not os.path.exists(json_path):
        raise SystemExit(f"--mode report: no sweep at {json_path}")
    with open(json_path) as file:
        results = json.load(file)
    for path in args.merge:
        with open(path) as file:
            other = json.load(file)
        check_same_setup(other, results, path, "--merge")
        levels = {(summary["policy"], summary["rate"]) for summary in results["summaries"]}
        shared = sorted(level for level in ((summary["policy"], summary["rate"]) for summary in other["summaries"])
                        if level in levels)
        if shared:
            raise SystemExit(f"--merge: {path} holds load levels (policy, rate) {shared} that {json_path} has too")
        results["runs"] += other["runs"]
        results["policies"] = other["policies"] | results["policies"]
        results["summaries"] += other["summaries"]
        results["records"] += other["records"]
        results.setdefault("device", other.get("device"))
    report_sweep(results, args, json_path)


def objectives_and_target(args, results: dict) -> tuple[dict[str, float], float]:
    """The goodput objectives (seconds) and target: the command's, else the sweep's."""
    settings = results["settings"]
    objectives = parse_goodput(args.goodput or settings.get("goodput") or [])
    target = args.goodput_target or settings.get("goodput_target") or DEFAULT_GOODPUT_TARGET
    return objectives, target


def resummarize(results: dict, objectives: dict[str, float]) -> list[dict]:
    """Every load level's summary computed again from its records (with ``objectives``),
    keeping the engine counters measured with it."""
    records: dict[tuple, list[dict]] = {}
    for record in results["records"]:
        records.setdefault((record["policy"], record["rate"]), []).append(record)
    return [summarize(records.get((summary["policy"], summary["rate"]), []), summary["rate"], objectives)
            | {"policy": summary["policy"], "engine": summary["engine"]}
            for summary in results["summaries"]]


def report_sweep(results: dict, args, json_path: str) -> None:
    """Summaries from the records, goodput rates, knees, the comparison with gpu-only, the
    plots and the tables; saves the JSON."""
    objectives, target = objectives_and_target(args, results)
    results["summaries"] = resummarize(results, objectives)
    def position(level: dict) -> float | None:
        return level_position(level, args.rate_axis)
    by_policy: dict[str, list[dict]] = {}
    for summary in results["summaries"]:
        by_policy.setdefault(summary["policy"], []).append(summary)
    results["goodput"] = None
    if objectives:
        fractions = {policy: [(position(level), level["goodput"]["fraction"]) for level in levels
                              if position(level) is not None and level["goodput"]["fraction"] is not None]
                     for policy, levels in by_policy.items()}
        results["goodput"] = goodput_rates(fractions, REFERENCE_POLICY, target) | {
            "objectives_s": objectives, "rate_axis": args.rate_axis}
    curves = {policy: [(position(level), knee_value(level)) for level in levels
                       if position(level) is not None]
              for policy, levels in by_policy.items()}
    slo = args.slo_ms / 1000 if args.slo_ms is not None else None
    results["knee"] = knees(curves, REFERENCE_POLICY, args.knee_factor, slo)
    results["comparison"] = compare_to_reference(results["summaries"], REFERENCE_POLICY)
    save_json(json_path, results)
    settings = results["settings"]
    burstiness = settings.get("burstiness", 1.0)
    concurrency = settings.get("max_concurrency")
    title = (f"{' '.join(results['engine_args'])} | {settings['workload']}, {settings['arrivals']} arrivals"
             + (f" (burstiness {burstiness:g})" if burstiness != 1.0 else "")
             + (f", at most {concurrency} in flight" if concurrency else ""))
    plot_field_metrics(by_policy, results["goodput"], title,
                       output_path(args, "latency-goodput-vs-rate.png"), args.rate_axis)
    plot_latency_vs_rate(by_policy, results["knee"], title,
                         output_path(args, "latency-vs-rate.png"), args.rate_axis)
    tested = sorted({summary["rate"] for summary in results["summaries"]
                     if summary["rate"] is not None})
    cdf_rate = choose_cdf_rate(args.cdf_rate, tested, results["knee"])
    cdf_records = {policy: [record for record in results["records"]
                            if record["policy"] == policy and record["rate"] == cdf_rate
                            and record["error"] is None]
                   for policy in by_policy}
    plot_latency_cdf(cdf_records, rate_label(cdf_rate), title,
                     output_path(args, "latency-cdf.png"))
    print_field_table(results)
    print_goodput_rates(results["goodput"])
    print_knee_table(results, cdf_rate)


def choose_cdf_rate(wanted: float | None, tested: list[float], knee: dict) -> float | None:
    """The rate of the distribution plot: ``wanted`` (or the nearest tested rate), else the
    highest tested rate not above gpu-only's knee; None for the trace's own timing."""
    if not tested:
        return None
    if wanted is not None:
        nearest = min(tested, key=lambda rate: abs(rate - wanted))
        if nearest != wanted:
            print(f"--cdf-rate {wanted:g} was not tested; using {nearest:g}", file=sys.stderr)
        return nearest
    reference = knee.get("at_reference", {}).get(REFERENCE_POLICY)
    if reference and reference["rate"] is not None:
        below = [rate for rate in tested if rate <= reference["rate"]]
        if below:
            return below[-1]
    return tested[len(tested) // 2]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def rate_text(rate: float | None) -> str:
    return "trace" if rate is None else f"{rate:g}"


def _per_second(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_field_table(results: dict) -> None:
    """TTFT, TPOT, ITL, E2EL, throughput and goodput per policy and rate."""
    goodput = results["goodput"]
    objectives = ("none (--goodput)" if goodput is None else ", ".join(
        f"{name} <= {limit * 1000:g} ms" for name, limit in goodput["objectives_s"].items()))
    print(f"\nlatency in ms over the finished requests (done/sent: the others did not finish by the "
          f"drain timeout or failed; goodput counts them as misses); {results.get('device')}")
    print(f"goodput objectives: {objectives}")
    header = (f"{'policy':<13}{'rate':>7}{'achieved':>9}{'done/sent':>11}"
              f"{'ttft mean':>10}{'p50':>8}{'p99':>8}{'tpot mean':>10}{'p50':>7}{'p99':>7}"
              f"{'itl mean':>9}{'p99':>7}{'e2el mean':>10}{'p99':>8}{'req/s':>8}{'out tok/s':>10}"
              f"{'good':>7}")
    print(header)
    print("-" * len(header))
    for summary in results["summaries"]:
        ttft, tpot, itl, e2el = (summary[name] for name in ("ttft", "tpot", "itl", "e2el"))
        fraction = summary["goodput"]["fraction"]
        print(f"{summary['policy']:<13}{rate_text(summary['rate']):>7}"
              f"{_per_second(summary['achieved_rate'], 3):>9}"
              f"{str(summary['completed']) + '/' + str(summary['sent']):>11}"
              f"{_ms(ttft['mean']):>10}{_ms(ttft['median']):>8}{_ms(ttft['p99']):>8}"
              f"{_ms(tpot['mean']):>10}{_ms(tpot['median']):>7}{_ms(tpot['p99']):>7}"
              f"{_ms(itl['mean']):>9}{_ms(itl['p99']):>7}{_ms(e2el['mean']):>10}{_ms(e2el['p99']):>8}"
              f"{_per_second(summary['requests_per_s'], 3):>8}"
              f"{_per_second(summary['output_tokens_per_s'], 0):>10}{_percent(fraction):>7}")


def print_goodput_rates(goodput: dict | None) -> None:
    """Each policy's goodput rate and its ratio to the reference policy's."""
    if goodput is None:
        return
    axis = "arrival rate achieved" if goodput.get("rate_axis") == "achieved" else "request rate"
    print(f"\ngoodput rate: the highest {axis} at which >= {goodput['target']:.0%} of requests "
          f"meet the objectives (linear between the tested rates around the crossing)")
    meaning = {"exact": "", "at least": " (at least: met at every tested rate)",
               "below": " (below the lowest tested rate, which already misses the target)"}
    for policy, entry in goodput["policies"].items():
        rate = "-" if entry["rate"] is None else f"{entry['rate']:.3f} req/s"
        ratio = entry.get("ratio_to_reference")
        ratio_text = ("" if ratio is None else
                      f", {'' if entry['ratio_bound'] == 'exact' else entry['ratio_bound'] + ' '}"
                      f"{ratio:.2f}x {goodput['reference']}")
        print(f"  {policy:<13} {rate}{meaning.get(entry['bound'], '')}{ratio_text}")


def print_knee_table(results: dict, cdf_rate: float | None) -> None:
    header = (f"{'policy':<13}{'rate':>7}{'achieved':>9}{'done/sent':>11}{'ptl mean':>10}"
              f"{'ptl p90':>9}{'ptl p99':>9}{'ttft':>9}{'tpot':>8}{'tok/s':>8}{'2-batch':>8}"
              f"{'cpu-dec':>8}{'spread':>8}")
    print(f"\nknee analysis, per-token latency (ptl) = request latency / output tokens; times in ms; "
          f"{results.get('device')}")
    print(header)
    print("-" * len(header))
    for summary in results["summaries"]:
        ptl = summary["per_token_latency"]
        engine = summary["engine"]
        rate = rate_text(summary["rate"])
        achieved = "-" if summary["achieved_rate"] is None else f"{summary['achieved_rate']:.3f}"
        throughput = ("-" if summary["output_tokens_per_s"] is None
                      else f"{summary['output_tokens_per_s']:.0f}")
        spread = _percent(summary["repeat_spread"])
        print(f"{summary['policy']:<13}{rate:>7}{achieved:>9}"
              f"{str(summary['completed']) + '/' + str(summary['sent']):>11}{_ms(ptl['mean']):>10}"
              f"{_ms(ptl['p90']):>9}{_ms(ptl['p99']):>9}{_ms(summary['ttft']['mean']):>9}"
              f"{_ms(summary['tpot']['mean']):>8}{throughput:>8}"
              f"{_share(engine['two_batch_share']):>8}{_share(engine['host_decode_share']):>8}"
              f"{spread:>8}")
    knee = results["knee"]
    if "reference_threshold_s" in knee:
        basis = (f"SLO {knee['slo_s'] * 1000:g} ms" if knee["slo_s"] is not None
                 else f"{knee['factor']:g} x {REFERENCE_POLICY}'s lowest-rate mean")
        print(f"\nknee threshold: mean per-token latency {_ms(knee['reference_threshold_s'])} ms "
              f"({basis})")
        for policy, entry in knee["at_reference"].items():
            ratio = entry.get("ratio_to_reference")
            ratio_text = "" if ratio is None else f", {ratio:.2f}x {REFERENCE_POLICY}"
            rate = "-" if entry["rate"] is None else f"{entry['rate']:.3f}"
            print(f"  {policy:<13} sustains {rate} req/s ({entry['bound']}){ratio_text}")
        for policy, entry in knee["own"].items():
            print(f"  own knee of {policy:<13} {entry['rate']:.3f} req/s ({entry['bound']}) at "
                  f"{_ms(entry['threshold_s'])} ms")
    if results["comparison"]:
        print(f"\nmean per-token latency over {REFERENCE_POLICY}'s at the same rate "
              f"(spread = (max - min) / mean of the per-repeat means)")
        for row in results["comparison"]:
            ratio = "-" if row["mean_ratio"] is None else f"{row['mean_ratio']:.3f}"
            spreads = [_percent(row["spread"]), _percent(row["reference_spread"])]
            print(f"  {row['policy']:<13} {rate_text(row['rate']):>7}: {ratio}  (spread "
                  f"{spreads[0]} vs {spreads[1]})")
    for policy, entry in results["policies"].items():
        if "error" in entry:
            print(f"  {policy}: FAILED: {entry['error'].splitlines()[0]}")
    print(f"latency distribution plotted at {rate_label(cdf_rate)}")


# -- server overhead -----------------------------------------------------------------------------


def time_per_output_token(first: float, last: float, tokens: int) -> float:
    return (last - first) / (tokens - 1)


def run_overhead(args, engine_args: list[str], vocab_size: int) -> None:
    """Time per output token of one streaming request through HTTP (a fresh server, nothing
    else in flight) and of the same request through ``LLM.generate`` in this process."""
    from neo import LLM, SamplingParams

    json_path = output_path(args, "overhead.json")
    item = parse_workload(args.workload, 1, seed=args.seed)[0]
    if item.output_len < 2:
        raise SystemExit(f"the overhead request needs >= 2 output tokens; {args.workload!r} gives "
                         f"{item.output_len}")
    prompt_ids = random_prompt(item.prompt_len, vocab_size, random.Random(args.seed))
    results = {"command": shlex.join([sys.executable, *sys.argv]),
               "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               "host": platform.node(), "mode": "overhead", "settings": vars(args),
               "engine_args": engine_args, "prompt_tokens": item.prompt_len,
               "output_tokens": item.output_len, "policies": {}}
    # Every server first: this process touches the GPU only afterwards.
    for policy in args.policies:
        log_path = output_path(args, f"server-{policy}.log")
        with ServerProcess(policy, engine_args, log_path, startup_timeout=args.startup_timeout) as server:
            info = server.metrics()["neo_engine_info"][0][0]
            results.setdefault("device", info.get("device"))
            model = server.model_card()["id"]
            http = []
            for attempt in range(args.overhead_repeats + 1):  # the first one warms up
                times = asyncio.run(single_request_token_times(server.url, model, prompt_ids,
                                                               item.output_len, args.request_timeout))
                if attempt:
                    http.append(time_per_output_token(times[0], times[-1], item.output_len))
        results["policies"][policy] = {"engine_info": info, "http_tpot_s": http}
        save_json(json_path, results)
    params = SamplingParams(max_tokens=item.output_len, temperature=0, ignore_eos=True)
    for policy in args.policies:
        llm = LLM(**dataclasses.asdict(engine_config(engine_args, policy)))
        in_process = []
        for attempt in range(args.overhead_repeats + 1):
            metrics = llm.generate(prompt_ids, params)[0].metrics
            if attempt:
                in_process.append(time_per_output_token(metrics.first_token_time,
                                                        metrics.finish_time, item.output_len))
        llm.close()
        del llm
        release_device_memory()
        entry = results["policies"][policy]
        entry["generate_tpot_s"] = in_process
        entry["http_tpot_median_s"] = statistics.median(entry["http_tpot_s"])
        entry["generate_tpot_median_s"] = statistics.median(in_process)
        entry["ratio"] = entry["http_tpot_median_s"] / entry["generate_tpot_median_s"]
        save_json(json_path, results)
    print(f"\nserver overhead: one streaming request, {item.prompt_len} prompt + {item.output_len} "
          f"output tokens, median of {args.overhead_repeats}; {results.get('device')}")
    print(f"{'policy':<13}{'HTTP tpot (ms)':>16}{'generate tpot (ms)':>20}{'ratio':>8}")
    for policy, entry in results["policies"].items():
        print(f"{policy:<13}{_ms(entry['http_tpot_median_s']):>16}"
              f"{_ms(entry['generate_tpot_median_s']):>20}{entry['ratio']:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    args, engine_args = parse_arguments(sys.argv[1:] if argv is None else argv)
    if args.mode == "report":
        run_report(args)
        return 0
    config = engine_config(engine_args, args.policies[0])
    vocab_size = resolve_model_config(config.model).vocab_size
    args.output_dir = args.output_dir or os.path.join(
        "results", "raw", f"online-{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(args.output_dir, exist_ok=True)
    if args.mode == "sweep":
        run_sweep(args, engine_args, vocab_size)
    else:
        run_overhead(args, engine_args, vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
