"""Whether a CPU decode-attention kernel is bound by each core's own work or by what the cores
share (DRAM, the last-level cache, the mesh).

Each point starts ``n`` processes at once, one thread each, each pinned to its own CPU, and each
calls the kernel on its own K/V for ``--seconds``; the point reports the K/V GB/s a process (mean,
slowest, fastest) and their sum. Three sources:

- ``L2``: one sequence of ``--context`` tokens (1 MiB of bf16 K/V at 8 KV heads of 128 dims for
  256 tokens), read on every call, so it stays in the core's private L2 cache. A rate a process
  that does not fall as processes are added is the core's own work: its arithmetic, loads and
  call overhead, with nothing shared in the way.
- ``DRAM``: a ring of ``--ring-mib`` MiB a process, the next sequence's blocks (shuffled within
  it) on each call, long evicted from every cache by the time they come round again.
- ``sum``: ``torch.sum`` over float32 of the same bytes, in L2: what one core loads when it does
  almost nothing else.

Shapes: query heads / KV heads from ``--heads`` (32/8 is Llama-3.1-8B, 40/8 Qwen2.5-32B), head_dim
128, block 16, bf16.

    python benchmarks/cpu_core_rate.py [--processes 1,8,16] [--heads 32/8,40/8] [--implementation ispc]
"""

import argparse
import multiprocessing
import os
import queue
import time

import torch

import neo.ops

HEAD_DIM, BLOCK_SIZE = 128, 16
SCALE = HEAD_DIM ** -0.5
WARMUP_CALLS = 20


def kv_bytes(num_kv_heads: int, context: int) -> int:
    """Bytes of bf16 K and V in the blocks of one sequence of ``context`` tokens."""
    blocks = -(-context // BLOCK_SIZE)
    return 2 * blocks * num_kv_heads * BLOCK_SIZE * HEAD_DIM * torch.bfloat16.itemsize


def kernel_call(function, num_heads: int, num_kv_heads: int, context: int, ring_bytes: int,
                generator: torch.Generator):
    """(call, K/V bytes a call reads, sequences in turn): a sequence of ``context`` tokens over
    its own shuffled blocks; with ``ring_bytes`` > 0, as many such sequences as fit in it, one
    per call in turn."""
    blocks = -(-context // BLOCK_SIZE)
    sequence_bytes = kv_bytes(num_kv_heads, context)
    num_sequences = max(1, ring_bytes // sequence_bytes)
    shape = (blocks * num_sequences, num_kv_heads, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    q = torch.randn(1, num_heads, HEAD_DIM, generator=generator).to(torch.bfloat16)
    out = torch.empty_like(q)
    tables = [(torch.randperm(blocks, generator=generator) + index * blocks)
              .to(torch.int32).view(1, -1) for index in range(num_sequences)]
    seq_lens = torch.tensor([context], dtype=torch.int32)
    position = [0]

    def call():
        table = tables[position[0]]
        position[0] = (position[0] + 1) % num_sequences
        function(out, q, k_cache, v_cache, table, seq_lens, SCALE)

    return call, sequence_bytes, num_sequences


def run_process(cpu: int, source: str, heads: tuple[int, int], context: int, ring_bytes: int,
                implementation: str, seconds: float, barrier, results) -> None:
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(cpu)
    function = next(impl.function for impl in
                    neo.ops.implementations("paged_decode_attention", "cpu")
                    if impl.name == implementation)
    if source == "sum":
        nbytes = kv_bytes(heads[1], context)
        buffer = torch.randn(nbytes // 4, generator=generator)
        call, rounds = buffer.sum, 1
    else:
        call, nbytes, rounds = kernel_call(function, *heads, context,
                                           ring_bytes if source == "DRAM" else 0, generator)
    for _ in range(2 * rounds + WARMUP_CALLS):
        call()
    barrier.wait()
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < seconds:
        call()
        calls += 1
    results.put(nbytes * calls / (time.perf_counter() - start) / 1e9)


def measure(cpus: list[int], *arguments) -> list[float]:
    """GB/s of each of the processes pinned to ``cpus``, all started together."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(len(cpus))
    results = context.Queue()
    processes = [context.Process(target=run_process, args=(cpu, *arguments, barrier, results))
                 for cpu in cpus]
    for process in processes:
        process.start()
    rates = []
    try:
        while len(rates) < len(processes):
            try:
                rates.append(results.get(timeout=1.0))
            except queue.Empty:
                # A process that died leaves the others at the barrier: stop them all.
                failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a measuring process exited with code {failed[0]}")
    finally:
        for process in processes:
            if len(rates) < len(processes):
                process.terminate()
            process.join()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cpus = sorted(os.sched_getaffinity(0))
    default_processes = sorted({1, max(1, len(cpus) // 2), len(cpus)})
    parser.add_argument("--processes", default=",".join(map(str, default_processes)),
                        help="comma-separated process counts, each on the first n allowed CPUs "
                             "(default: 1, half, all)")
    parser.add_argument("--heads", default="32/8,40/8",
                        help="comma-separated query heads / KV heads (default 32/8,40/8)")
    parser.add_argument("--sources", default="L2,DRAM,sum", help="comma-separated: L2, DRAM, sum")
    parser.add_argument("--implementation", default="ispc",
                        help="the CPU implementation of paged_decode_attention (default ispc)")
    parser.add_argument("--context", type=int, default=256, help="tokens a call (default 256)")
    parser.add_argument("--ring-mib", type=int, default=96,
                        help="MiB of K/V a process rotates through from DRAM (default 96)")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds a point")
    args = parser.parse_args()

    names = [impl.name for impl in neo.ops.implementations("paged_decode_attention", "cpu")]
    if args.implementation not in names:
        parser.error(f"--implementation {args.implementation!r} is not one of {names}")
    counts = [int(count) for count in args.processes.split(",")]
    if any(not 1 <= count <= len(cpus) for count in counts):
        parser.error(f"every --processes value must be between 1 and the {len(cpus)} allowed CPUs")
    sources = args.sources.split(",")
    if any(source not in ("L2", "DRAM", "sum") for source in sources):
        parser.error(f"--sources {args.sources!r}: each must be L2, DRAM or sum")
    heads = [tuple(int(part) for part in pair.split("/")) for pair in args.heads.split(",")]
    if args.context < 1 or args.seconds <= 0:
        parser.error("--context and --seconds must be positive")

    kv_kib = 2 * args.context * 8 * HEAD_DIM * 2 / 1024
    variant = neo.ops.ispc_bf16_decode_variant() if args.implementation == "ispc" else None
    print(f"{args.implementation}{f' ({variant} variant)' if variant else ''}, {args.context} "
          f"tokens a call ({kv_kib:.0f} KiB of K/V at 8 KV heads), one thread a process, each "
          f"process pinned to its own CPU; DRAM: a ring of {args.ring_mib} MiB a process")
    print(f"{'source':6s} {'heads':>6s} {'processes':>9s} {'GB/s a process':>15s} "
          f"{'slowest-fastest':>16s} {'total':>8s}")
    for source in sources:
        for query_heads, kv_heads in heads if source != "sum" else heads[:1]:
            for count in counts:
                rates = measure(cpus[:count], source, (query_heads, kv_heads), args.context,
                                args.ring_mib << 20, args.implementation, args.seconds)
                mean = sum(rates) / len(rates)
                label = f"{query_heads}/{kv_heads}" if source != "sum" else "-"
                print(f"{source:6s} {label:>6s} {count:9d} {mean:15.2f} "
                      f"{min(rates):7.2f}-{max(rates):<8.2f} {sum(rates):8.2f}", flush=True)


if __name__ == "__main__":
    main()
