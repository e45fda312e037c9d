"""Do two CUDA graphs of GEMMs give the right results when replayed at the same time?

The async host pipeline replays the GPU's decode graphs on the compute stream while a host
batch replays its pipeline graph on a stream of its own. A captured cuBLAS GEMM keeps the
workspace of the stream it was captured on (PyTorch keys cuBLAS workspaces by handle and
stream), and ``torch.cuda.graph`` captures on one shared stream unless told otherwise, so
graphs captured by different owners can share a workspace. GEMMs whose algorithms keep
partial sums or flags in the workspace then corrupt each other, or wait forever.

This script captures two families of graphs shaped like a model's linear stages (QKV, O,
gate/up, down per layer), each on fresh random data, either both on the default capture
stream (``shared``) or each on a capture stream of its own (``separate``, what neo does),
replays them concurrently on two streams (the second at high priority, as the host batches'),
and counts the replays whose outputs differ from the same graph replayed alone. Each mode runs
in a child process with a time limit, so a deadlock is reported as ``hung``. CUDA only.

    python benchmarks/concurrent_graphs.py [--model qwen2.5-32b] [--rows 16,256] [--replays 200]
        [--json out.json]
"""

import argparse
import json
import multiprocessing
import time

import torch

from neo.bench import device_name
from neo.models.loader import resolve_model_config

MODES = ("shared", "separate")


def _layer_weights(config, layers: int, dtype, device) -> list[list[torch.Tensor]]:
    """Per layer, [in, out] weights of the QKV, O, gate/up and down projections."""
    hidden, head_dim = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * head_dim
    shapes = [(hidden, qkv), (config.num_heads * head_dim, hidden), (hidden, 2 * config.intermediate_size),
              (config.intermediate_size, hidden)]
    return [[torch.randn(rows, cols, dtype=dtype, device=device) * rows ** -0.5 for rows, cols in shapes]
            for _ in range(layers)]


def _forward(x: torch.Tensor, weights: list[list[torch.Tensor]], config) -> torch.Tensor:
    """x [rows, hidden] through every layer's GEMMs (sliced so that each output feeds the next)."""
    attention_width = config.num_heads * config.head_dim
    for qkv, o, gate_up, down in weights:
        attention = (x @ qkv)[:, :attention_width]
        x = x + attention @ o
        gate, up = (x @ gate_up).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ down
        x = x / x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype)
    return x


class _Family:
    """One owner's graph: static input, captured output, and the output it gives alone."""

    def __init__(self, rows: int, weights, config, capture_stream, device):
        self.input = torch.randn(rows, config.hidden_size, dtype=weights[0][0].dtype, device=device)
        warmup = torch.cuda.Stream(device)
        warmup.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(warmup):
            _forward(self.input, weights, config)
        torch.cuda.current_stream(device).wait_stream(warmup)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=capture_stream):
            self.output = _forward(self.input, weights, config)
        self.graph.replay()
        torch.cuda.synchronize(device)
        self.expected = self.output.clone()

    def wrong(self) -> bool:
        return not torch.equal(self.output, self.expected)


def run_mode(mode: str, model: str, rows: list[int], layers: int, replays: int, queue) -> None:
    """Child process: capture the two families in ``mode``, replay them concurrently, and put
    a result dict on ``queue``."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = resolve_model_config(model)
    weights = _layer_weights(config, layers, torch.bfloat16, device)
    streams = [None, None] if mode == "shared" else [torch.cuda.Stream(device) for _ in rows]
    families = [_Family(count, weights, config, stream, device) for count, stream in zip(rows, streams)]
    replay_streams = [torch.cuda.Stream(device), torch.cuda.Stream(device, priority=-1)]
    wrong = [0] * len(families)
    start = time.perf_counter()
    for _ in range(replays):
        for family, stream in zip(families, replay_streams):
            with torch.cuda.stream(stream):
                family.graph.replay()
        torch.cuda.synchronize(device)
        for index, family in enumerate(families):
            wrong[index] += family.wrong()
    queue.put({"mode": mode, "wrong_replays": wrong, "seconds": time.perf_counter() - start})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b", help="a shipped shape or model directory")
    parser.add_argument("--rows", default="16,256", help="rows of the two graph families")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a mode counts as hung")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("concurrent_graphs.py needs a CUDA device")
    rows = [int(count) for count in args.rows.split(",")]
    if len(rows) != 2:
        raise SystemExit("--rows takes two counts")
    context = multiprocessing.get_context("spawn")
    results = []
    for mode in MODES:
        queue = context.Queue()
        child = context.Process(target=run_mode, args=(mode, args.model, rows, args.layers, args.replays, queue))
        child.start()
        child.join(args.timeout)
        if child.is_alive():
            child.kill()
            child.join()
            result = {"mode": mode, "hung": True}
        elif child.exitcode != 0:
            result = {"mode": mode, "failed": f"exit code {child.exitcode}"}
        else:
            result = {**queue.get(), "hung": False}
        results.append(result)
        print(json.dumps(result), flush=True)
    report = {"device": device_name(torch.device("cuda")), "model": args.model, "rows": rows, "layers": args.layers,
              "replays": args.replays, "results": results}
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
    print(f"{'mode':<10}{'outcome':<36}")
    for result in results:
        if result.get("hung"):
            outcome = f"hung (> {args.timeout:.0f} s)"
        elif "failed" in result:
            outcome = result["failed"]
        else:
            outcome = f"wrong replays {result['wrong_replays']} of {args.replays}"
        print(f"{result['mode']:<10}{outcome:<36}")


if __name__ == "__main__":
    main()
