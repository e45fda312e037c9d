"""Decode-only iteration time of the gpu-only engine against its roofline (CUDA).

For each batch size, ``batch`` requests with ~``context``-token prompts are prefilled, then
decode iterations are timed end to end (``LLMEngine.step``: scheduling, inputs, the forward —
a CUDA graph replay —, sampling, bookkeeping). The roofline of an iteration is

    (weight bytes read + KV bytes read) / device copy bandwidth + GEMM FLOPs / bf16 GEMM rate

with both rates measured in the same run (a 2 GiB device-to-device copy, bytes read plus
written; an 8192^3 bf16 matmul on random data). The GPU-busy fraction is the GPU time of the
forward (replays of the batch's CUDA graph and the logits GEMM, timed with events) over the iteration's wall time;
the rest is host work the GPU waits for (scheduling, inputs, sampling, bookkeeping).

The engine runs with async scheduling (``EngineConfig.async_scheduling``: the host plans and
launches iteration k+1 before reading iteration k's tokens, so its work overlaps the GPU's);
``--no-async-scheduling`` runs the synchronous loop, each iteration's tokens read before the next
is planned. Run both in one session to compare them on the same device:

    python benchmarks/engine_roofline.py --model llama-3.1-8b --batch-sizes 64,256 --context 1024
    python benchmarks/engine_roofline.py --model llama-3.1-8b --batch-sizes 64,256 --context 1024 --no-async-scheduling
"""

import argparse
import datetime
import json
import statistics
import time

import torch

from neo import EngineConfig, LLMEngine, SamplingParams
from neo.bench import device_name
from neo.models.causal_lm import count_parameters


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 20) -> float:
    """Bytes read plus written per second of a large device-to-device copy."""
    source = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    for _ in range(3):
        destination.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        destination.copy_(source)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * source.numel() * repeats / (start.elapsed_time(end) / 1e3)


def gemm_rate(device: torch.device, size: int = 8192, repeats: int = 10) -> float:
    """bf16 FLOP/s of a large matmul on random data."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3)


def roofline(engine: LLMEngine, batch: int, contexts: list[int], bandwidth: float, flops: float) -> dict:
    config = engine.model_config
    element = engine.dtype.itemsize
    embedding = config.vocab_size * config.hidden_size
    # Decode reads every weight except the embedding table (only ``batch`` rows of it), unless
    # the table is also the LM head.
    weight_parameters = count_parameters(config) - (0 if config.tie_word_embeddings else embedding)
    weight_bytes = weight_parameters * element
    kv_bytes = sum(contexts) * config.kv_bytes_per_token(engine.dtype)
    linear_parameters = weight_parameters - config.num_layers * 2 * config.hidden_size - config.hidden_size
    gemm_flops = 2 * batch * linear_parameters
    attention_flops = 4 * sum(contexts) * config.num_layers * config.num_heads * config.head_dim
    memory_seconds = (weight_bytes + kv_bytes) / bandwidth
    compute_seconds = (gemm_flops + attention_flops) / flops
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": gemm_flops + attention_flops,
            "memory_seconds": memory_seconds, "compute_seconds": compute_seconds,
            "roofline_seconds": memory_seconds + compute_seconds}


def measure(engine: LLMEngine, batch: int, context: int, iterations: int) -> dict:
    # Requests prefilled early decode while later ones prefill: leave room for those tokens too
    # (the engine's max_model_len is twice the context), so that none finishes while timed.
    params = SamplingParams(max_tokens=context, temperature=0, ignore_eos=True)
    for index in range(batch):
        engine.add_request([(index * 7 + position) % 1000 + 10 for position in range(context)], params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    device = engine.device
    walls = []
    for _ in range(iterations + 3):
        start = time.perf_counter()
        outputs = engine.step()  # ends with the sampled tokens on the host
        walls.append(time.perf_counter() - start)
        if len(outputs) != batch:
            raise RuntimeError(f"a decode iteration of batch {batch} returned {len(outputs)} tokens")
    contexts = [r.num_tokens for r in engine.scheduler.running]
    forward_seconds = None
    graphs = engine.runner.decode_graphs
    if graphs is not None:
        size = next(size for size in graphs.sizes if size >= batch)
        graph, hidden = graphs.graphs[size], graphs.hidden[size]
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        for _ in range(iterations):
            graph.replay()
            engine.model.compute_logits(hidden[:batch])
        end_event.record()
        torch.cuda.synchronize(device)
        forward_seconds = start_event.elapsed_time(end_event) / 1e3 / iterations
    engine.abort_all()
    return {"batch": batch, "context": context, "contexts": contexts,
            "iteration_seconds": statistics.median(walls[3:]), "forward_gpu_seconds": forward_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read each iteration's tokens before planning the next")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    device = torch.device("cuda")
    bandwidth, flops = copy_bandwidth(device), gemm_rate(device)
    engine = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", policy="gpu-only",
                                    max_num_seqs=max(sizes), max_model_len=2 * args.context + 64,
                                    max_num_batched_tokens=max(8192, args.context),
                                    use_cuda_graphs=not args.no_cuda_graphs,
                                    async_scheduling=not args.no_async_scheduling))
    rows = []
    for batch in sizes:
        row = measure(engine, batch, args.context, args.iterations)
        row.update(roofline(engine, batch, row.pop("contexts"), bandwidth, flops))
        row["ratio_to_roofline"] = row["iteration_seconds"] / row["roofline_seconds"]
        forward = row["forward_gpu_seconds"]
        row["gpu_busy_fraction"] = forward / row["iteration_seconds"] if forward else float("nan")
        rows.append(row)
    report = {"device": device_name(device), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "model": args.model, "copy_bandwidth_bytes_per_s": bandwidth, "bf16_gemm_flops": flops,
              "cuda_graphs": not args.no_cuda_graphs, "async_scheduling": not args.no_async_scheduling,
              "rows": rows}
    engine.close()
    print(f"{args.model} gpu-only decode iterations on {report['device']} (async scheduling "
          f"{'on' if report['async_scheduling'] else 'off'}): copy {bandwidth / 1e12:.2f} TB/s, "
          f"bf16 GEMM {flops / 1e12:.0f} TFLOP/s")
    print(f"{'batch':>6} {'ctx':>6} {'iter ms':>9} {'roofline ms':>12} {'ratio':>6} {'GPU busy':>9}")
    for row in rows:
        print(f"{row['batch']:>6} {row['context']:>6} {row['iteration_seconds'] * 1e3:9.2f} "
              f"{row['roofline_seconds'] * 1e3:12.2f} {row['ratio_to_roofline']:6.2f} {row['gpu_busy_fraction']:9.2f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
