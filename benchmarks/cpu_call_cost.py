"""What one call of each CPU decode-attention kernel costs beyond its K/V, at each thread count.

Two shapes, both in cache (one K/V set read on every call), 32/8 heads, head_dim 128, block 16,
bf16:

- ``1x16``: one sequence of one block, nothing to split. Its time is the call's fixed cost: the
  argument checks, the work plan, starting and joining the threads, and writing the output.
- ``8x256``: one layer of a small host batch. Against one thread's time, the time on ``n``
  threads shows how far splitting it pays.

Each point reports the median and the fastest of ``--calls`` calls, timed one by one after a
warm-up, in microseconds. The median shows what a host batch meets call after call; the fastest
what the kernel can do.

    python benchmarks/cpu_call_cost.py [--threads 1,2,4,8,16] [--calls 3000]
"""

import argparse
import os
import statistics
import time

import torch

import neo.ops

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SHAPES = {"1x16": (1, 16), "8x256": (8, 256)}
WARMUP_CALLS = 300


def arguments_for(num_seqs: int, context_len: int, generator: torch.Generator) -> tuple:
    """``paged_decode_attention``'s arguments for ``num_seqs`` sequences of ``context_len``
    tokens over their own blocks (out, q, k_cache, v_cache, block_table, seq_lens, scale)."""
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    shape = (num_seqs * blocks_per_seq, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    block_table = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), context_len, dtype=torch.int32)
    return torch.empty_like(q), q, k_cache, v_cache, block_table, seq_lens, HEAD_DIM ** -0.5


def call_microseconds(function, arguments: tuple, calls: int) -> tuple[float, float]:
    """(median, fastest) microseconds of ``calls`` calls after a warm-up."""
    for _ in range(WARMUP_CALLS):
        function(*arguments)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function(*arguments)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = os.cpu_count() or 1
    default_threads = sorted({count for count in (1, 2, 4, 8) if count < cores} | {max(1, cores - 1), cores})
    parser.add_argument("--threads", default=",".join(map(str, default_threads)),
                        help="comma-separated thread counts (default: 1, 2, 4, 8, all but one, all)")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per point")
    args = parser.parse_args()
    thread_counts = [int(count) for count in args.threads.split(",")]
    if args.calls < 1 or any(count < 1 for count in thread_counts):
        parser.error("--calls and every --threads value must be at least 1")

    # the kernels; the pure-torch reference is what they are checked against, not one of them
    implementations = [impl for impl in neo.ops.implementations("paged_decode_attention", "cpu")
                       if impl.name != "reference"]
    generator = torch.Generator().manual_seed(0)
    cases = {name: arguments_for(*shape, generator) for name, shape in SHAPES.items()}
    columns = [f"{impl.name} {name}" for impl in implementations for name in cases]
    print(f"CPU decode attention per call, median / fastest us over {args.calls} calls, in cache")
    print("threads  " + "  ".join(f"{column:>17}" for column in columns))
    for threads in thread_counts:
        torch.set_num_threads(threads)
        cells = []
        for implementation in implementations:
            for arguments in cases.values():
                median, fastest = call_microseconds(implementation.function, arguments, args.calls)
                cells.append(f"{median:8.1f} / {fastest:6.1f}")
        print(f"{threads:7d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
