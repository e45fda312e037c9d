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

``--kernels`` also says where the forward's GPU time goes: the graph replays are recorded with
``torch.profiler`` (CUPTI sees the kernels a graph launches) and each kernel's time is summed by
kind (``kernel_breakdown``): the GEMMs against their weight bytes over the copy bandwidth, the
decode attention against the KV bytes over it, every other kernel by name, and the time the GPU
ran no kernel between the forward's first and last (launch gaps inside the graph); then each
projection's GEMMs over all layers alone at the batch's rows (``gemm_by_projection``).
"""

import argparse
import datetime
import json
import os
import re
import statistics
import tempfile
import time

import torch

from neo import EngineConfig, LLMEngine, SamplingParams
from neo.bench import device_name
from neo.models.causal_lm import count_parameters
from cuda_kernels import time_per_call


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


# Substrings of the names cuBLAS gives its GEMM kernels (and its split-K reduction).
GEMM_NAME_PARTS = ("gemm", "nvjet", "xmma", "cutlass", "gemv", "splitKreduce")


def kernel_kind(name: str) -> str:
    """A CUDA kernel's name -> what the breakdown sums it under: "GEMM", "decode attention", this
    project's or torch's kernel by its function name (torch's elementwise kernels by the functor
    they run, e.g. ``direct_copy_kernel_cuda``), or the name itself cut to 60 characters."""
    if any(part in name for part in GEMM_NAME_PARTS):
        return "GEMM"
    functions = re.findall(r"\w+_kernel(?:_cuda)?\b", name)
    if not functions:
        return name[:60]
    if functions[0] in ("paged_decode_attention_kernel", "paged_decode_attention_mma_kernel", "merge_kernel"):
        return "decode attention"
    torch_functors = [function for function in functions if function.endswith("_cuda")]
    return torch_functors[-1] if torch_functors else functions[0]


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """Kernel ``(start, end)`` intervals -> (time covered by at least one, first start to last
    end)."""
    intervals = sorted(intervals)
    covered, current_start, current_end = 0.0, intervals[0][0], intervals[0][1]
    for start, end in intervals[1:]:
        if start > current_end:
            covered += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    covered += current_end - current_start
    return covered, max(end for _, end in intervals) - intervals[0][0]


def summarize_kernels(events: list[dict], iterations: int, gap_between_forwards_us: float = 1000.0) -> dict:
    """Chrome-trace kernel events (``name``, ``ts``, ``dur`` in microseconds) of ``iterations``
    forwards run one after another with a pause of more than ``gap_between_forwards_us``
    between them -> ``{"kinds": {kind: {"calls", "seconds"}}, "busy_seconds",
    "span_seconds"}``, all per forward: calls and time of each ``kernel_kind``, the time some
    kernel ran and the time from a forward's first kernel start to its last kernel end."""
    if not events:
        raise RuntimeError("torch.profiler recorded no CUDA kernel: is CUPTI available?")
    kinds: dict[str, dict] = {}
    for event in events:
        kind = kinds.setdefault(kernel_kind(event["name"]), {"calls": 0, "seconds": 0.0})
        kind["calls"] += 1
        kind["seconds"] += event["dur"] * 1e-6
    for kind in kinds.values():
        kind["calls"] /= iterations
        kind["seconds"] /= iterations
    intervals = sorted((event["ts"], event["ts"] + event["dur"]) for event in events)
    busy, span, forward, latest_end = 0.0, 0.0, [], intervals[0][1]
    for interval in intervals:
        if forward and interval[0] - latest_end > gap_between_forwards_us:
            covered, length = busy_and_span(forward)
            busy, span, forward = busy + covered, span + length, []
        forward.append(interval)
        latest_end = max(latest_end, interval[1])
    covered, length = busy_and_span(forward)
    return {"kinds": kinds, "busy_seconds": (busy + covered) * 1e-6 / iterations,
            "span_seconds": (span + length) * 1e-6 / iterations}


def kernel_breakdown(engine: LLMEngine, batch: int, iterations: int) -> dict:
    """``summarize_kernels`` of ``iterations`` replays of the batch's decode graph and the logits
    GEMM, recorded with ``torch.profiler``; each forward is synchronized before the next, so the
    idle time counts only the gaps inside a forward."""
    graphs = engine.runner.decode_graphs
    size = next(size for size in graphs.sizes if size >= batch)
    graph, hidden = graphs.graphs[size], graphs.hidden[size]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(iterations):
            graph.replay()
            engine.model.compute_logits(hidden[:batch])
            torch.cuda.synchronize(engine.device)
            time.sleep(0.005)  # a pause that summarize_kernels reads as the end of a forward
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        profile.export_chrome_trace(path)
        with open(path) as file:
            events = [event for event in json.load(file)["traceEvents"]
                      if event.get("cat") == "kernel" and event.get("ph") == "X"]
    return summarize_kernels(events, iterations)


def gemm_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every weight a decode iteration's GEMMs read: each layer's projections and the
    logits GEMM's."""
    model = engine.model
    weights = [weight for layer in model.layers for weight, _ in layer.gemm_weights()]
    weights.append(model.logits_weight())
    return sum(weight.numel() * weight.element_size() for weight in weights)


PROJECTIONS = ("QKV", "O", "gate/up", "down")  # the order of DecoderLayer.gemm_weights()


def gemm_by_projection(engine: LLMEngine, batch: int, repeats: int = 10) -> dict:
    """Each projection's GEMMs over all layers, and the logits GEMM, run alone at ``batch`` rows
    (``F.linear`` on random activations, replayed from a CUDA graph so that launching does not
    bound them: ``cuda_kernels.time_per_call``):
    ``{projection: {"seconds": per iteration, "bytes": weight bytes}}``."""
    model = engine.model
    weights = {name: [] for name in PROJECTIONS}
    for layer in model.layers:
        for name, (weight, bias) in zip(PROJECTIONS, layer.gemm_weights()):
            weights[name].append((weight, bias))
    weights["logits"] = [(model.logits_weight(), None)]
    results = {}
    for name, pairs in weights.items():
        inputs = torch.randn(batch, pairs[0][0].shape[1], dtype=engine.dtype, device=engine.device)
        calls = [lambda weight=weight, bias=bias: torch.nn.functional.linear(inputs, weight, bias)
                 for weight, bias in pairs]
        results[name] = {"seconds": time_per_call(calls, repeats, graph_replay=True) * len(calls),
                         "bytes": sum(weight.numel() * weight.element_size() for weight, _ in pairs)}
    return results


def print_breakdown(row: dict, bandwidth: float) -> None:
    breakdown = row["kernels"]
    kinds = breakdown["kinds"]
    span = breakdown["span_seconds"]
    print(f"batch {row['batch']}: forward span {span * 1e3:.3f} ms, kernels busy "
          f"{breakdown['busy_seconds'] / span:.3f} of it")
    floors = {"GEMM": row["gemm_weight_bytes"] / bandwidth, "decode attention": row["kv_bytes"] / bandwidth}
    print(f"  {'kernel kind':<62} {'calls':>6} {'us':>9} {'share':>6} {'floor us':>9} {'of floor':>8}")
    for name, kind in sorted(kinds.items(), key=lambda item: -item[1]["seconds"]):
        floor = floors.get(name)
        print(f"  {name:<62} {kind['calls']:6.0f} {kind['seconds'] * 1e6:9.1f} {kind['seconds'] / span:6.3f} "
              + (f"{floor * 1e6:9.1f} {kind['seconds'] / floor:8.2f}" if floor else ""))
    print(f"  {'no kernel running (gaps)':<62} {'':>6} {(span - breakdown['busy_seconds']) * 1e6:9.1f} "
          f"{1 - breakdown['busy_seconds'] / span:6.3f}")
    print(f"  GEMMs alone (graph-replayed, {row['batch']} rows): "
          + ", ".join(f"{name} {gemm['seconds'] * 1e6:.0f} us = {gemm['bytes'] / gemm['seconds'] / bandwidth:.0%} of copy"
                      for name, gemm in row["gemms_alone"].items()))


def measure(engine: LLMEngine, batch: int, context: int, iterations: int, kernels: bool) -> dict:
    """Times ``iterations`` decode iterations of ``batch`` requests at ~``context`` tokens and
    their forward's GPU time; with ``kernels`` also its ``kernel_breakdown`` and the GEMMs alone
    (``gemm_by_projection``)."""
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
    row = {"batch": batch, "context": context, "contexts": contexts,
           "iteration_seconds": statistics.median(walls[3:]), "forward_gpu_seconds": forward_seconds}
    if kernels:
        row["gemm_weight_bytes"] = gemm_weight_bytes(engine)
        row["kernels"] = kernel_breakdown(engine, batch, iterations)
        row["gemms_alone"] = gemm_by_projection(engine, batch)
    engine.abort_all()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch-sizes", default="64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read each iteration's tokens before planning the next")
    parser.add_argument("--kernels", action="store_true",
                        help="also break each batch's forward down by kernel (torch.profiler)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.kernels and args.no_cuda_graphs:
        parser.error("--kernels breaks down the decode graph's replays: leave CUDA graphs on")
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
        row = measure(engine, batch, args.context, args.iterations, args.kernels)
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
    for row in rows:
        if "kernels" in row:
            print_breakdown(row, bandwidth)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
