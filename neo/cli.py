"""The ``neo`` command: generate, bench, profile, serve.

Every flag's value is checked by the parser (``cli_values``), so a mistyped value ends with the
usage and one error line (status 2). Mistakes only the engine can see (an unknown model, a
pool that does not fit) print ``neo: error: ...`` (status 2); Ctrl-C prints ``neo: interrupted``
(status 130) after the engine has been closed.
"""

import argparse
import dataclasses
import gc
import json
import logging
import os
import sys

from . import cli_values
from .bench.workloads import WORKLOAD_FORMS
from .config import HOST_PIPELINES, POLICIES, RETURN_ORDERS, EngineConfig
from .sched.placement import PLACEMENTS
from .sched.stage_order import HOST_BATCH_ORDERS, TWO_SUB_BATCH_ORDERS
from .server.arguments import add_server_arguments
from .sim.command import add_simulate_command

DTYPES = ("auto", "float32", "float16", "bfloat16")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# neo bench's defaults per compute device: (requests, workload). The CPU's finish in seconds on
# neo-tiny; the CUDA ones are the paper's offline setting.
BENCH_DEFAULTS = {"cuda": (200, "synthetic:input=1000,output=300"),
                  "cpu": (32, "synthetic:input=128,output=32")}
INTERRUPTED_STATUS = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to each flag's help, except for switches and flags whose default
    is None (their help says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose help shows the defaults; its subcommands' parsers are of the same
    class, so they do too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def add_global_arguments(parser: argparse.ArgumentParser, default: object) -> None:
    """Flags taken before or after the subcommand. A subcommand's copy has the default
    ``argparse.SUPPRESS``, so it only sets the value when the flag is given there."""
    parser.add_argument("--log-level", type=cli_values.log_level, default=default,
                        help=f"logging level, any case: {', '.join(cli_values.LOG_LEVELS)}")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, with the same defaults."""
    defaults = EngineConfig()
    cores = os.cpu_count() or 1
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=defaults.model,
                       help="neo-tiny (built-in, random weights), a shipped config name (with "
                            "--load-format dummy), or a Hugging Face model directory")
    group.add_argument("--tensor-parallel-size", type=cli_values.integer_at_least(1),
                       default=defaults.tensor_parallel_size,
                       help="ranks (one process and device each) that split every layer's heads and MLP")
    group.add_argument("--device", type=cli_values.device, default=None,
                       help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    group.add_argument("--dtype", default=defaults.dtype, choices=DTYPES,
                       help="weights and KV dtype; auto: the checkpoint's on CUDA, float32 on the CPU")
    group.add_argument("--policy", default=defaults.policy, choices=POLICIES,
                       help="gpu-only: all KV on the compute device; neo: overflow requests decode "
                            "on the host CPU when it pays; full-offload: every decode on the host")
    group.add_argument("--load-format", default=defaults.load_format, choices=("auto", "safetensors", "dummy"),
                       help="auto: safetensors for a directory, built-in weights for neo-tiny; "
                            "dummy: random weights")
    group.add_argument("--block-size", type=int, default=defaults.block_size, choices=BLOCK_SIZES,
                       help="tokens per KV cache block")
    group.add_argument("--gpu-kv-cache-gib", type=cli_values.positive_number, default=None,
                       help="compute-device KV pool in GiB (default: what --gpu-memory-utilization "
                            "leaves on CUDA, 1 GiB on the CPU)")
    group.add_argument("--cpu-kv-cache-gib", type=cli_values.non_negative_number,
                       default=defaults.cpu_kv_cache_gib,
                       help="host KV pool in GiB (> 0 for the neo and full-offload policies)")
    group.add_argument("--gpu-memory-utilization", type=cli_values.fraction,
                       default=defaults.gpu_memory_utilization,
                       help="share of the GPU's memory neo may use, in (0, 1]")
    group.add_argument("--max-num-seqs", type=cli_values.integer_at_least(1), default=defaults.max_num_seqs,
                       help="most requests in one iteration")
    group.add_argument("--max-num-batched-tokens", type=cli_values.integer_at_least(1),
                       default=defaults.max_num_batched_tokens, help="most tokens in one iteration")
    group.add_argument("--max-model-len", type=cli_values.integer_at_least(2), default=None,
                       help="longest sequence, prompt and output (default: the model's context)")
    group.add_argument("--cpu-attention-threads", type=cli_values.integer_at_least(1, cores), default=None,
                       help="threads for host decode attention (default: all cores but one)")
    group.add_argument("--no-cuda-graphs", dest="use_cuda_graphs", action="store_false",
                       help="run every iteration eagerly (no CUDA graph replays)")
    group.add_argument("--host-pipeline", default=defaults.host_pipeline, choices=HOST_PIPELINES,
                       help="async: host decodes as their own batch beside the GPU's iterations; "
                            "lockstep: host decodes in each iteration's two sub-batches; "
                            "auto: per iteration, whichever of the two (or gpu-only) the scheduler "
                            "estimates makes more tokens per second")
    group.add_argument("--pad-gemm-rows", action=argparse.BooleanOptionalAction, default=None,
                       help="pad GEMM rows to fixed buckets warmed up at start-up (default: on CUDA)")
    group.add_argument("--cpu-attention-kernel", default=defaults.cpu_attention_kernel,
                       help="CPU implementation of the host's decode attention: auto, or one that "
                            "`python -m neo.ops` lists (e.g. ispc, numba, reference)")
    group.add_argument("--stage-order", default=defaults.stage_order, choices=TWO_SUB_BATCH_ORDERS,
                       help="the lockstep pipeline's order of its two sub-batches through the layers")
    group.add_argument("--host-batch-order", default=defaults.host_batch_order, choices=HOST_BATCH_ORDERS,
                       help="the async host pipeline's order of a host batch through the layers: whole "
                            "(host-batch), or in two halves the host and the GPU take turns on "
                            "(host-batch-pair)")
    group.add_argument("--placement", default=None, choices=sorted(PLACEMENTS),
                       help="where host decodes go (default: the host pipeline's)")
    group.add_argument("--return-order", default=defaults.return_order, choices=RETURN_ORDERS,
                       help="which host-pool requests move back to the GPU pool first when it has room: "
                            "oldest, or most-remaining (the most tokens left before max_tokens)")
    group.add_argument("--perf-model", default=defaults.perf_model,
                       help="stage-time table for the load-aware scheduler: auto (profile of this "
                            "machine, made on first use), zero, or a JSON path")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="plan and launch each iteration before the previous one's tokens reach the "
                            "host (the next input ids are taken on the device); default: on for CUDA "
                            "devices, off on the CPU")
    group.add_argument("--torch-profiler-dir", default=None,
                       help="where start/stop of profiling write each rank's torch.profiler timeline "
                            "(Chrome trace; default: profiling off)")
    group.add_argument("--trace", dest="trace_path", default=None,
                       help="write a per-iteration trace (JSON) here")
    group.add_argument("--seed", type=int, default=defaults.seed, help="seed of dummy weights")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {field.name for field in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: value for name, value in vars(args).items() if name in names})


def _generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**vars(engine_config_from_args(args)))
    try:
        output = llm.generate(args.prompt_token_ids or args.prompt, params)[0]
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": output.prompt, "prompt_token_ids": output.prompt_token_ids,
                              "text": completion.text, "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            if output.prompt is not None:
                print(f"prompt: {output.prompt!r}")
            print(f"prompt token ids: {output.prompt_token_ids}")
            print(f"output token ids: {completion.token_ids}")
            if llm.get_tokenizer() is not None:
                print(f"output text: {completion.text!r}")
            print(f"finish reason: {completion.finish_reason}")
    finally:
        llm.close()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_offline_benchmark
    from .engine import LLMEngine

    config = engine_config_from_args(args)
    if args.torch_profile_iterations and not config.torch_profiler_dir:  # before a model loads for nothing
        raise ValueError("--torch-profile-iterations needs --torch-profiler-dir: where to write the timelines")
    default_requests, default_workload = BENCH_DEFAULTS[config.compute_device.type]
    engine = LLMEngine(config)
    try:
        result = run_offline_benchmark(config, args.workload or default_workload,
                                       args.num_requests or default_requests, seed=args.workload_seed,
                                       show_progress=not args.json, engine=engine, duration=args.duration,
                                       profile_iterations=args.torch_profile_iterations)
    finally:
        engine.close()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(result["summary"])
    return 0


def _profile(args: argparse.Namespace) -> int:
    from .engine.profiling import profile_to_file

    path = profile_to_file(engine_config_from_args(args), args.output)
    print(f"perf model written to {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .server.app import serve
    from .server.arguments import server_settings_from_args

    serve(engine_config_from_args(args), server_settings_from_args(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="neo", description="LLM serving with CPU offloading of decode attention. The default policy "
        "is gpu-only (every request's KV cache and attention on the compute device); --policy neo moves "
        "the decode attention and KV of the requests that overflow the device pool to the host CPU when "
        "the scheduler estimates it pays, --policy full-offload moves every decode there.")
    add_global_arguments(parser, default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate from one prompt")
    add_engine_arguments(generate)
    generate.add_argument("--prompt", default="Hello, my name is", help="prompt text")
    generate.add_argument("--prompt-token-ids", type=cli_values.token_ids, default=None,
                          help="JSON list of token ids (instead of --prompt)")
    generate.add_argument("--max-tokens", type=cli_values.integer_at_least(1), default=32,
                          help="most tokens to generate")
    generate.add_argument("--temperature", type=cli_values.number, default=0.0,
                          help="0 for greedy, else at least 0.01")
    generate.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1: all")
    generate.add_argument("--top-p", type=cli_values.number, default=1.0,
                          help="keep the most likely tokens up to this probability mass, in (0, 1]")
    generate.add_argument("--sampling-seed", type=int, default=None,
                          help="seed of this request's sampling (default: unseeded)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    generate.add_argument("--json", action="store_true", help="print the output as one JSON object")
    generate.set_defaults(handler=_generate)

    bench = commands.add_parser("bench", help="offline throughput: all requests at once")
    add_engine_arguments(bench)
    bench.add_argument("--workload", default=None,
                       help=f"{WORKLOAD_FORMS} (default: "
                            f"{BENCH_DEFAULTS['cuda'][1]} on CUDA, {BENCH_DEFAULTS['cpu'][1]} on the CPU)")
    bench.add_argument("--num-requests", type=cli_values.integer_at_least(1), default=None,
                       help=f"requests submitted at once (default: {BENCH_DEFAULTS['cuda'][0]} on CUDA, "
                            f"{BENCH_DEFAULTS['cpu'][0]} on the CPU)")
    bench.add_argument("--workload-seed", type=int, default=0, help="seed of the prompts and their lengths")
    bench.add_argument("--duration", type=cli_values.positive_number, default=None,
                       help="stop after this many seconds; the headline then says the run was cut "
                            "short (default: run every request to completion)")
    bench.add_argument("--torch-profile-iterations", type=cli_values.iteration_range, default=None,
                       metavar="FIRST:LAST",
                       help="record a torch.profiler timeline of these iterations of the run on every rank, "
                            "into --torch-profiler-dir")
    bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench.set_defaults(handler=_bench)

    profile = commands.add_parser("profile", help="measure stage times for the load-aware scheduler")
    add_engine_arguments(profile)
    profile.add_argument("--output", default=None, help="table path (default: the per-user cache)")
    profile.set_defaults(handler=_profile)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    add_server_arguments(serve)
    serve.set_defaults(handler=_serve)
    add_simulate_command(commands)

    for command in commands.choices.values():
        add_global_arguments(command, default=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        pass  # reported below, once the interrupted frames (and progress bars) are gone
    except (ValueError, OSError) as error:
        print(f"neo: error: {error}", file=sys.stderr)
        return 2
    gc.collect()
    print("neo: interrupted", file=sys.stderr)
    return INTERRUPTED_STATUS


if __name__ == "__main__":
    sys.exit(main())
