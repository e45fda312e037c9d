"""The ``neo`` command: generate, bench, profile, serve."""

import argparse
import dataclasses
import json
import logging
import sys

from .config import HOST_PIPELINES, POLICIES, EngineConfig
from .sched.placement import PLACEMENTS
from .sched.stage_order import TWO_SUB_BATCH_ORDERS
from .server.arguments import add_server_arguments
from .sim.command import add_simulate_command


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field, with the same defaults."""
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=defaults.model,
                       help="neo-tiny, a shipped config name (with --load-format dummy), or a "
                            "Hugging Face model directory")
    group.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    group.add_argument("--dtype", default=defaults.dtype)
    group.add_argument("--policy", default=defaults.policy, choices=POLICIES)
    group.add_argument("--load-format", default=defaults.load_format, choices=("auto", "safetensors", "dummy"))
    group.add_argument("--block-size", type=int, default=defaults.block_size)
    group.add_argument("--gpu-kv-cache-gib", type=float, default=None)
    group.add_argument("--cpu-kv-cache-gib", type=float, default=defaults.cpu_kv_cache_gib)
    group.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    group.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--cpu-attention-threads", type=int, default=None)
    group.add_argument("--no-cuda-graphs", dest="use_cuda_graphs", action="store_false")
    group.add_argument("--host-pipeline", default=defaults.host_pipeline, choices=HOST_PIPELINES,
                       help="async: host decodes as their own batch beside the GPU's iterations; "
                            "lockstep: host decodes in each iteration's two sub-batches")
    group.add_argument("--pad-gemm-rows", action=argparse.BooleanOptionalAction, default=None,
                       help="pad GEMM rows to fixed buckets warmed up at start-up (default: on CUDA)")
    group.add_argument("--cpu-attention-kernel", default=defaults.cpu_attention_kernel,
                       help="CPU implementation of the host's decode attention: auto, or one that "
                            "`python -m neo.ops` lists (e.g. ispc, numba, reference)")
    group.add_argument("--stage-order", default=defaults.stage_order, choices=TWO_SUB_BATCH_ORDERS,
                       help="the lockstep pipeline's order of its two sub-batches through the layers")
    group.add_argument("--placement", default=None, choices=sorted(PLACEMENTS),
                       help="where host decodes go (default: the host pipeline's)")
    group.add_argument("--perf-model", default=defaults.perf_model,
                       help="stage-time table for the load-aware scheduler: auto (profile of this "
                            "machine, made on first use), zero, or a JSON path")
    group.add_argument("--trace", dest="trace_path", default=None,
                       help="write a per-iteration trace (JSON) here")
    group.add_argument("--seed", type=int, default=defaults.seed)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {field.name for field in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: value for name, value in vars(args).items() if name in names})


def _generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    llm = LLM(**vars(engine_config_from_args(args)))
    prompt = json.loads(args.prompt_token_ids) if args.prompt_token_ids else args.prompt
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    output = llm.generate(prompt, params)[0]
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
    llm.close()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_offline_benchmark

    result = run_offline_benchmark(engine_config_from_args(args), args.workload, args.num_requests,
                                   seed=args.workload_seed, show_progress=not args.json,
                                   duration=args.duration)
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
    parser = argparse.ArgumentParser(prog="neo", description="LLM serving with CPU offloading of decode attention")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate from one prompt")
    add_engine_arguments(generate)
    generate.add_argument("--prompt", default="Hello, my name is")
    generate.add_argument("--prompt-token-ids", default=None, help="JSON list of token ids (instead of --prompt)")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--sampling-seed", type=int, default=None)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--json", action="store_true")
    generate.set_defaults(handler=_generate)

    bench = commands.add_parser("bench", help="offline throughput: all requests at once")
    add_engine_arguments(bench)
    bench.add_argument("--workload", default="synthetic:input=1000,output=300",
                       help="synthetic:input=N,output=M or azure-code")
    bench.add_argument("--num-requests", type=int, default=200)
    bench.add_argument("--workload-seed", type=int, default=0)
    bench.add_argument("--duration", type=float, default=None,
                       help="stop after this many seconds (steady throughput is still reported)")
    bench.add_argument("--json", action="store_true")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"neo: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
