"""``neo simulate``: the command line of the what-if simulator.

    neo simulate --model llama-3.1-8b --hardware g5.4xlarge --host-read-gbps 60 \\
        --workload synthetic:input=1000,output=300 --num-requests 200 --policies gpu-only,neo

Every ``Hardware`` field is an option (``--host-cores``, ``--host-read-gbps``, ``--hbm-gbps``,
...; ``--pcie-gbps`` sets both directions). ``--plot heatmap`` sweeps host read bandwidth and
GPU KV memory, ``--plot cores`` a list of machines (by default the A10G series), and writes
the gain over gpu-only as a PNG (``neo.sim.plots``).
"""

import argparse
import dataclasses
import json
import sys

from neo import cli_values
from neo.bench.workloads import WORKLOAD_FORMS
from neo.config import HOST_PIPELINES, POLICIES, RETURN_ORDERS, EngineConfig
from neo.sched.stage_order import HOST_BATCH_ORDERS, TWO_SUB_BATCH_ORDERS

from .hardware import FIELD_HELP, OVERRIDABLE, PRESETS, preset, with_overrides
from .scenario import ARRIVALS, Scenario, run_scenario
from .simulator import SimulationResult

G5_SERIES = "g5.2xlarge,g5.4xlarge,g5.8xlarge,g5.16xlarge"


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_simulate_command(subparsers) -> argparse.ArgumentParser:
    """Register ``simulate`` on an ``add_subparsers`` object."""
    parser = subparsers.add_parser("simulate", help="what-if throughput of the policies on a described machine")
    parser.add_argument("--model", required=True, help="a built-in model name or a model directory (its config)")
    parser.add_argument("--hardware", default="h100", help=f"a preset: {', '.join(PRESETS)}")
    machine = parser.add_argument_group("hardware overrides (the preset's figure otherwise)")
    for field in OVERRIDABLE:
        kind = cli_values.integer_at_least(1) if field == "host_cores" else cli_values.non_negative_number
        machine.add_argument(option_name(field), dest=f"hardware_{field}", type=kind, default=None, metavar="N",
                             help=FIELD_HELP[field])
    machine.add_argument("--pcie-gbps", type=cli_values.positive_number, default=None,
                         help="host-device copy bandwidth in both directions, GB/s")
    parser.add_argument("--profile", default=None,
                        help="a `neo profile` table (JSON) instead of synthesized stage times")
    parser.add_argument("--planning-profile", default=None,
                        help="a `neo profile` table the offloading policies plan with, while time follows "
                             "--profile (or the synthesized times): what a profile that is off costs")
    parser.add_argument("--tensor-parallel-size", type=cli_values.integer_at_least(1), default=1,
                        help="GPUs of the machine the model is split over, each with its own pools "
                             "(needs a --profile measured on a rank of that many)")
    parser.add_argument("--workload", default="synthetic:input=1000,output=300", help=WORKLOAD_FORMS)
    parser.add_argument("--num-requests", type=cli_values.integer_at_least(1), default=200,
                        help="requests of the workload, all run to completion")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of synthetic lengths")
    parser.add_argument("--arrivals", default="at-once", choices=ARRIVALS,
                        help="at-once: every request at the start, as `neo bench` submits them; trace: at "
                             "the workload's arrival times (azure-code, trace files with times)")
    parser.add_argument("--policies", default="gpu-only,neo,full-offload",
                        help=f"comma-separated: {', '.join(POLICIES)}")
    parser.add_argument("--host-pipeline", default="async", choices=HOST_PIPELINES,
                        help="how the offloading policies run host decodes beside the GPU's work")
    parser.add_argument("--stage-order", default="asymmetric", help=f"one of {', '.join(TWO_SUB_BATCH_ORDERS)}")
    parser.add_argument("--placement", default=None,
                        help="where host decodes go (default: the host pipeline's)")
    parser.add_argument("--host-batch-order", default=EngineConfig.host_batch_order, choices=HOST_BATCH_ORDERS,
                        help="the async host pipeline's order of a host batch through the layers")
    parser.add_argument("--return-order", default=EngineConfig.return_order, choices=RETURN_ORDERS,
                        help="which host-pool requests move back to the GPU pool first when it has room")
    parser.add_argument("--gpu-kv-cache-gib", type=cli_values.positive_number, default=None,
                        help="GPU KV pool, GiB (default: the GPU memory left by the weights)")
    parser.add_argument("--cpu-kv-cache-gib", type=cli_values.non_negative_number, default=None,
                        help="host KV pool, GiB (default: half the host's memory)")
    parser.add_argument("--max-model-len", type=cli_values.integer_at_least(2), default=None,
                        help="context length (default: the model's)")
    parser.add_argument("--gpu-memory-utilization", type=cli_values.fraction, default=0.9,
                        help="share of GPU memory the engine may use")
    parser.add_argument("--max-num-seqs", type=cli_values.integer_at_least(1), default=256,
                        help="requests in one iteration at most")
    parser.add_argument("--max-num-batched-tokens", type=cli_values.integer_at_least(1), default=8192,
                        help="tokens in one iteration at most")
    parser.add_argument("--duration", type=cli_values.positive_number, default=None,
                        help="stop each run after this many simulated seconds")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    plots = parser.add_argument_group("plots")
    plots.add_argument("--plot", choices=("heatmap", "cores"), default=None,
                       help="heatmap: gain over host read bandwidth x GPU KV pool; cores: gain "
                            "against host cores over --sweep-hardware")
    plots.add_argument("--plot-output", default=None, help="PNG path (default: simulate-PLOT.png)")
    plots.add_argument("--sweep-host-read-gbps", default="25,50,100,200", help="heatmap: host read bandwidths")
    plots.add_argument("--sweep-gpu-kv-cache-gib", default="1,2,4,8,16", help="heatmap: GPU KV pool sizes")
    plots.add_argument("--sweep-hardware", default=G5_SERIES, help="cores: presets to compare")
    parser.set_defaults(handler=simulate_command)
    return parser


def number_list(text: str, option: str) -> list[float]:
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated numbers, got {text!r}") from None
    if not values or any(value <= 0 for value in values):
        raise ValueError(f"{option} must list positive numbers, got {text!r}")
    return values


def hardware_from_args(args: argparse.Namespace, name: str | None = None):
    """The preset ``name`` (default ``--hardware``) with the command line's overrides."""
    overrides = {field: getattr(args, f"hardware_{field}") for field in OVERRIDABLE}
    if args.pcie_gbps is not None:
        for field in ("pcie_h2d_gbps", "pcie_d2h_gbps"):
            if overrides[field] is None:
                overrides[field] = args.pcie_gbps
    return with_overrides(preset(name or args.hardware), overrides)


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    policies = tuple(item.strip() for item in args.policies.split(",") if item.strip())
    unknown = [policy for policy in policies if policy not in POLICIES]
    if not policies or unknown:
        raise ValueError(f"--policies must list some of {', '.join(POLICIES)}, got {args.policies!r}")
    return Scenario(model=args.model, hardware=hardware_from_args(args), workload=args.workload,
                    num_requests=args.num_requests, policies=policies, host_pipeline=args.host_pipeline,
                    stage_order=args.stage_order, host_batch_order=args.host_batch_order, placement=args.placement,
                    return_order=args.return_order,
                    gpu_kv_cache_gib=args.gpu_kv_cache_gib,
                    cpu_kv_cache_gib=args.cpu_kv_cache_gib, max_model_len=args.max_model_len,
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    profile=args.profile, duration=args.duration, seed=args.workload_seed,
                    tensor_parallel_size=args.tensor_parallel_size, arrivals=args.arrivals,
                    planning_profile=args.planning_profile)


def results_table(scenario: Scenario, results: list[SimulationResult]) -> str:
    """The printable comparison of the policies (ratios to gpu-only where it ran)."""
    base = next((r for r in results if r.policy == "gpu-only"), None)
    hardware = scenario.hardware
    gpus = f"{scenario.tensor_parallel_size} GPUs of " if scenario.tensor_parallel_size > 1 else ""
    lines = [f"{scenario.model} on {gpus}{hardware.name} ({hardware.dtype}, {hardware.host_cores} host cores, "
             f"host read {hardware.host_read_bandwidth(hardware.host_attention_threads):.0f} GB/s), "
             f"{scenario.workload}, {scenario.num_requests} requests{_arrivals(scenario)}, "
             f"{'measured profile ' + scenario.profile if scenario.profile else 'synthesized stage times'}"
             f"{', planned with ' + scenario.planning_profile if scenario.planning_profile else ''}",
             f"{'policy':<13}{'out tok/s':>10}{'total tok/s':>12}{'steady':>9}{'ratio':>7}{'steady r':>9}"
             f"{'iters':>7}{'host %':>7}{'TTFT p50/p90 s':>17}{'TPOT p50/p90 ms':>17}{'head/tail s':>13}"]
    for result in results:
        ttft, tpot = result.summary()["ttft_s"], result.summary()["tpot_s"]
        ratio = result.output_tokens_per_s / base.output_tokens_per_s if base and base.output_tokens_per_s else None
        steady = (result.steady_output_tokens_per_s / base.steady_output_tokens_per_s
                  if base and base.steady_output_tokens_per_s else None)
        lines.append(
            f"{result.policy:<13}{result.output_tokens_per_s:>10.1f}{result.total_tokens_per_s:>12.1f}"
            f"{result.steady_output_tokens_per_s:>9.1f}{_ratio(ratio):>7}{_ratio(steady):>9}{result.iterations:>7}"
            f"{100 * result.host_decode_share:>7.1f}{_pair(ttft, 1):>17}{_pair(tpot, 1000):>17}"
            f"{_head_and_tail(result.head_and_tail_s):>13}")
        if result.note:
            lines.append(f"  {result.policy}: {result.note}")
        if result.finished_requests < result.num_requests:
            lines.append(f"  {result.policy}: {result.finished_requests} of {result.num_requests} requests finished"
                         + (" (cut at --duration)" if result.cut_short else ""))
    return "\n".join(lines)


def _arrivals(scenario: Scenario) -> str:
    return " at the trace's arrival times" if scenario.arrivals == "trace" else " submitted at once"


def _head_and_tail(seconds: tuple[float, float] | None) -> str:
    """The seconds of the first and the last 10% of the output tokens; "-" for a cut run."""
    return "-" if seconds is None else f"{seconds[0]:.2f}/{seconds[1]:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pair(stats: dict, scale: float) -> str:
    if stats["p50"] is None:
        return "-"
    return f"{stats['p50'] * scale:.2f}/{stats['p90'] * scale:.2f}"


def plot(args: argparse.Namespace, scenario: Scenario) -> int:
    from .plots import draw_cores, draw_heatmap
    path = args.plot_output or f"simulate-{args.plot}.png"
    if args.plot == "heatmap":
        draw_heatmap(scenario, number_list(args.sweep_host_read_gbps, "--sweep-host-read-gbps"),
                     number_list(args.sweep_gpu_kv_cache_gib, "--sweep-gpu-kv-cache-gib"), path)
    else:
        names = [name.strip() for name in args.sweep_hardware.split(",") if name.strip()]
        draw_cores(scenario, [hardware_from_args(args, name) for name in names], path)
    print(f"wrote {path}")
    return 0


def simulate_command(args: argparse.Namespace) -> int:
    scenario = scenario_from_args(args)
    if args.plot is not None:
        return plot(args, scenario)
    results = run_scenario(scenario, show_progress=not args.no_progress and sys.stderr.isatty())
    if args.json:
        settings = {**dataclasses.asdict(scenario), "hardware": dataclasses.asdict(scenario.hardware)}
        print(json.dumps({"scenario": settings, "results": [result.summary() for result in results]}, indent=1))
    else:
        print(results_table(scenario, results))
    return 0
