"""Host time per engine iteration spent outside the model forward.

Runs decode-only iterations with 1, 64 and 256 running requests and times each phase of a step
separately, through the engine's own code paths: scheduling, building the batch inputs,
the forward (executor), sampling (with its device-to-host copy), and postprocessing.

    python benchmarks/engine_overhead.py [--model neo-tiny] [--batch-sizes 1,64,256] [--json out.json]
"""

import argparse
import json
import statistics
import time

import torch

from neo import EngineConfig, LLMEngine, SamplingParams
from neo.runner.batch_inputs import build_batch_inputs
from neo.sched.runner_output import IterationOutput
from neo.bench import device_name

PHASES = ("schedule", "inputs", "forward", "sample", "postprocess")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(engine: LLMEngine, batch_size: int, context: int, iterations: int) -> dict:
    params = SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True)
    ids = [engine.add_request([7] * context, params).request_id for _ in range(batch_size)]
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills
    runner = engine.runner
    samples = {phase: [] for phase in PHASES}
    for _ in range(iterations + 3):
        clock = [time.perf_counter()]
        plan = engine.scheduler.schedule()
        clock.append(time.perf_counter())
        batches = [build_batch_inputs(batch, runner.block_size, runner.device, runner.executor.pad_rows)
                   for batch in plan.sub_batches]
        clock.append(time.perf_counter())
        logits = runner.executor.run(batches, plan.stage_order, torch.empty(0, 2, dtype=torch.int64),
                                     torch.empty(0, 2, dtype=torch.int64))
        _synchronize(runner.device)
        clock.append(time.perf_counter())
        requests = [request for inputs in batches for request in inputs.requests]
        tokens = runner.sampler(logits, [r.sampling_params for r in requests], [r.generator for r in requests]).tolist()
        clock.append(time.perf_counter())
        engine._outputs(plan, engine.scheduler.update(plan, IterationOutput(tokens, 0.0, 0.0)))
        clock.append(time.perf_counter())
        for phase, start, end in zip(PHASES, clock, clock[1:]):
            samples[phase].append(end - start)
    for request_id in ids:
        engine.abort_request(request_id)
    medians = {phase: statistics.median(values[3:]) * 1e3 for phase, values in samples.items()}
    medians["outside_forward"] = sum(value for phase, value in medians.items() if phase != "forward")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="neo-tiny")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    # The phases of the synchronous step, each timed alone: every token read before the next plan.
    engine = LLMEngine(EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype,
                                    max_num_seqs=max(sizes), use_cuda_graphs=False, async_scheduling=False))
    results = {"device": device_name(engine.device), "model": args.model, "context": args.context,
               "milliseconds": {}}
    for size in sizes:
        results["milliseconds"][size] = measure(engine, size, args.context, args.iterations)
    engine.close()
    print(f"engine host time per decode iteration (ms, median) on {results['device']}, {args.model}")
    print(f"{'running':>8} " + " ".join(f"{phase:>12}" for phase in PHASES) + f" {'outside fwd':>12}")
    for size, row in results["milliseconds"].items():
        print(f"{size:>8} " + " ".join(f"{row[phase]:12.3f}" for phase in PHASES)
              + f" {row['outside_forward']:12.3f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
