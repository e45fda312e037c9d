"""Benchmarks of neo's CUDA kernels on one GPU, with the ceilings they are judged against.

Measures, in one run:

- the device-to-device copy bandwidth (a large tensor copy; bytes read + written per second),
  the ceiling of the memory-bound kernels;
- ``neo.paged_decode_attention`` (bf16, 32 query / 8 KV heads, head_dim 128, block 16, shuffled
  block tables) over decode points: time, KV bytes read per second, the share of the copy
  bandwidth, and torch ``scaled_dot_product_attention`` on the same shapes with contiguous KV
  (``enable_gqa=True``, and with the KV heads materialized per query head; the faster of the two
  is the baseline), with the ratio. A point is a batch of sequences of one context, or of
  several (a mixed batch, whose baseline is the sum of SDPA's times on each group of equal
  lengths), optionally in a block table wider than its longest sequence, as a CUDA graph's
  table spans the longest context it was captured for;
- the other kernels at a Llama-3-8B-like size against their pure-torch references.

Each timing is the median over repeats of a CUDA-event-timed loop that cycles through several
input sets, so the L2 cache cannot serve repeats of the decode inputs. A compact table is
printed last; ``--json PATH`` also writes every figure.

``--sweep`` measures instead every compiled variant of the decode kernel (the names in
``neo.ops._cuda_kernels.decode_variants``, selected through the environment variable it names)
at every decode point: the share of the copy bandwidth and the ratio to the best SDPA per
variant, each variant's largest deviation from the pure-torch reference on the first input set
(a variant outside the bf16 tolerance is marked and never counted as best), and the best variant
per point. Last come the two figures the launcher's heuristic is set from
(``kShortContextVariant`` and ``kLongContextVariant`` in ``ops_cuda/launchers.h``): per class
of points (table width up to the build's ``decode_short_context_tokens``, and wider), the variant
with the lowest geometric mean of its time over the best SDPA, among those correct at every
point of the class.

``--points 96x512,160x256`` measures other decode points (``63x1024+1x4096``: a mixed batch;
``64x1088@2112``: a table 2112 tokens wide), ``--variants A,B`` sweeps only those
variants, ``--graph-replay`` times the decode calls (neo's and SDPA's) replayed from one CUDA
graph per input cycle instead of launched from Python, and ``--block-order sequential`` puts
each sequence's blocks one after another in the cache instead of at random places.

Usage: python benchmarks/cuda_kernels.py [--json results.json] [--repeats 20] [--quick] [--sweep]
       [--points SxC[+SxC...][@TABLE],...] [--variants NAME,...] [--graph-replay]
       [--block-order shuffled|sequential]
"""

import argparse
import importlib
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from neo.ops import implementations, reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# Input sets rotate until they span this many times the L2 cache.
L2_SPAN = 3
# Largest |neo - reference| a variant may show on bf16 outputs (the CUDA tests' bf16 atol).
SWEEP_TOLERANCE = 1.6e-2
# Llama-3-8B-like sizes for the other kernels.
TOKENS, HIDDEN, INTERMEDIATE = 256, 4096, 14336


@dataclass(frozen=True)
class DecodePoint:
    """A decode batch: ``groups`` of (sequences, context), the block table's width in tokens
    (``table_tokens``; 0: as wide as the longest context) and where the sequences' blocks lie
    in the cache (``block_order``, one of ``BLOCK_ORDERS``)."""
    groups: tuple[tuple[int, int], ...]
    table_tokens: int = 0
    block_order: str = "shuffled"

    @classmethod
    def uniform(cls, num_seqs: int, context: int) -> "DecodePoint":
        return cls(((num_seqs, context),))

    @property
    def lengths(self) -> list[int]:
        return [context for count, context in self.groups for _ in range(count)]

    @property
    def blocks_per_seq(self) -> list[int]:
        """Each sequence's cache blocks, in order."""
        return [-(-length // BLOCK_SIZE) for length in self.lengths]

    @property
    def num_seqs(self) -> int:
        return sum(count for count, _ in self.groups)

    @property
    def kv_tokens(self) -> int:
        return sum(count * context for count, context in self.groups)

    @property
    def table_width(self) -> int:
        """The block table's width in tokens, whole blocks."""
        tokens = max(self.table_tokens, max(context for _, context in self.groups))
        return -(-tokens // BLOCK_SIZE) * BLOCK_SIZE

    @property
    def label(self) -> str:
        text = "+".join(f"{count}x{context}" for count, context in self.groups)
        return f"{text}@{self.table_tokens}" if self.table_tokens else text

    def fields(self) -> dict:
        """What a report row says of its point."""
        return {"point": self.label, "num_seqs": self.num_seqs, "table_tokens": self.table_width,
                "kv_tokens": self.kv_tokens, "block_order": self.block_order}


# Where a point's blocks lie in the cache: "shuffled", every block of every sequence at a random
# place (a pool long in use); "sequential", each sequence's blocks one after another in the order
# it reads them, and the sequences one after another (a pool that handed out its blocks in order).
BLOCK_ORDERS = ("shuffled", "sequential")


DECODE_POINTS = [DecodePoint.uniform(*point) for point in
                 ((256, 128), (256, 256), (256, 512), (64, 4096), (256, 1024), (16, 16384),
                  (128, 2048))]
QUICK_DECODE_POINTS = [DecodePoint.uniform(256, 128), DecodePoint.uniform(64, 4096)]


def time_per_call(calls, repeats: int, min_seconds: float = 0.01,
                  graph_replay: bool = False) -> float:
    """Median seconds per call of a loop over ``calls`` (callables cycled in order). With
    ``graph_replay`` the loop replays one CUDA graph that holds each call once, as the engine's
    decode iterations run: no launch from Python between the kernels."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    steps, calls_per_step = calls, 1
    if graph_replay:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        steps, calls_per_step = [graph.replay], len(calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed_loop(count: int) -> float:
        start.record()
        for index in range(count):
            steps[index % len(steps)]()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / count / calls_per_step

    estimate = timed_loop(len(steps))
    count = max(len(steps), math.ceil(min_seconds / max(estimate * calls_per_step, 1e-7)))
    count = math.ceil(count / len(steps)) * len(steps)
    return statistics.median(timed_loop(count) for _ in range(repeats))


def parse_points(text: str) -> list[DecodePoint]:
    """``"256x128,63x1024+1x4096@8192"`` -> decode points: groups of SEQUENCESxCONTEXT joined by
    ``+``, then optionally ``@TABLE``, the block table's width in tokens."""
    points = []
    for item in text.split(","):
        item = item.strip()
        batch, at, table = item.partition("@")
        groups = []
        for group in batch.split("+"):
            seqs, _, context = group.partition("x")
            if not (seqs.isdigit() and context.isdigit() and int(seqs) > 0 and int(context) > 0):
                raise argparse.ArgumentTypeError(
                    f"{item!r} is not a decode point: {group!r} is not SEQUENCESxCONTEXT with "
                    f"both > 0 (e.g. 256x128, 63x1024+1x4096, 64x1088@2112)")
            groups.append((int(seqs), int(context)))
        longest = max(context for _, context in groups)
        if at and not (table.isdigit() and int(table) >= longest):
            raise argparse.ArgumentTypeError(
                f"{item!r} is not a decode point: the table width after '@' must be a number "
                f"of tokens at least the longest context ({longest})")
        points.append(DecodePoint(tuple(groups), int(table) if at else 0))
    return points


def copy_bandwidth(repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write) of a 1 GiB tensor copy."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    seconds = time_per_call([lambda: destination.copy_(source)], repeats)
    return 2 * source.numel() / seconds


def input_sets(bytes_per_set: int) -> int:
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, math.ceil(L2_SPAN * l2_bytes / bytes_per_set))


def block_table(point: DecodePoint, generator: torch.Generator, device: str) -> torch.Tensor:
    """The point's block table [num_seqs, table_width / BLOCK_SIZE] over a cache of exactly its
    blocks: each sequence's blocks in the point's ``block_order`` (``BLOCK_ORDERS``), its entries
    past them naming block 0 (never read)."""
    blocks_per_seq = point.blocks_per_seq
    num_blocks = sum(blocks_per_seq)
    rows = torch.arange(point.num_seqs, device=device).repeat_interleave(
        torch.tensor(blocks_per_seq, device=device))
    columns = torch.cat([torch.arange(count, device=device) for count in blocks_per_seq])
    table = torch.zeros(point.num_seqs, point.table_width // BLOCK_SIZE, dtype=torch.int32,
                        device=device)
    order = (torch.randperm(num_blocks, generator=generator, device=device)
             if point.block_order == "shuffled" else torch.arange(num_blocks, device=device))
    table[rows, columns] = order.int()
    return table


def decode_inputs(point: DecodePoint, generator: torch.Generator):
    """Input sets for ``neo.paged_decode_attention`` at one point, enough of them to span
    L2_SPAN times the L2 cache, each with its own cache and ``block_table``. Returns (list of
    argument tuples, KV bytes read per call)."""
    dtype = torch.bfloat16
    num_blocks = sum(point.blocks_per_seq)
    kv_bytes = 2 * point.kv_tokens * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    scale = HEAD_DIM ** -0.5
    cache_shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    sets = []
    for _ in range(input_sets(kv_bytes)):
        k_cache = torch.randn(cache_shape, generator=generator, device="cuda", dtype=dtype)
        v_cache = torch.randn(cache_shape, generator=generator, device="cuda", dtype=dtype)
        table = block_table(point, generator, "cuda")
        seq_lens = torch.tensor(point.lengths, dtype=torch.int32, device="cuda")
        q = torch.randn(point.num_seqs, NUM_HEADS, HEAD_DIM, generator=generator, device="cuda",
                        dtype=dtype)
        sets.append((torch.empty_like(q), q, k_cache, v_cache, table, seq_lens, scale))
    return sets, kv_bytes


def neo_seconds(sets, repeats: int, graph_replay: bool) -> float:
    calls = [lambda arguments=arguments: torch.ops.neo.paged_decode_attention(*arguments)
             for arguments in sets]
    return time_per_call(calls, repeats, graph_replay=graph_replay)


def best_sdpa_seconds(num_seqs: int, context: int, repeats: int, generator: torch.Generator,
                      graph_replay: bool) -> dict:
    """torch SDPA on contiguous KV of the same shapes: {"enable_gqa": s, "expanded_kv": s}."""
    dtype = torch.bfloat16
    scale = HEAD_DIM ** -0.5
    kv_bytes = 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    seconds = {}
    group = NUM_HEADS // NUM_KV_HEADS
    for variant in ("enable_gqa", "expanded_kv"):
        calls = []
        heads = NUM_KV_HEADS if variant == "enable_gqa" else NUM_HEADS
        variant_sets = input_sets(kv_bytes * heads // NUM_KV_HEADS)
        for _ in range(variant_sets):
            shape = (num_seqs, NUM_KV_HEADS, context, HEAD_DIM)
            keys = torch.randn(shape, generator=generator, device="cuda", dtype=dtype)
            values = torch.randn(shape, generator=generator, device="cuda", dtype=dtype)
            if variant == "expanded_kv":
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            q = torch.randn(num_seqs, NUM_HEADS, 1, HEAD_DIM, generator=generator, device="cuda",
                            dtype=dtype)
            gqa = variant == "enable_gqa"
            calls.append(lambda q=q, k=keys, v=values, gqa=gqa:
                         F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa))
        seconds[variant] = time_per_call(calls, repeats, graph_replay=graph_replay)
        del calls
        torch.cuda.empty_cache()
    return seconds


def point_sdpa_seconds(point: DecodePoint, repeats: int, generator: torch.Generator,
                       graph_replay: bool) -> dict:
    """SDPA's seconds for a point, summed over its groups of equal lengths (one call each):
    {"enable_gqa": s, "expanded_kv": s, "best": the sum of each group's faster one}."""
    seconds = {"enable_gqa": 0.0, "expanded_kv": 0.0, "best": 0.0}
    for num_seqs, context in point.groups:
        group = best_sdpa_seconds(num_seqs, context, repeats, generator, graph_replay)
        for variant, value in group.items():
            seconds[variant] += value
        seconds["best"] += min(group.values())
    return seconds


def decode_point(point: DecodePoint, repeats: int, copy_bytes_per_second: float,
                 generator: torch.Generator, graph_replay: bool) -> dict:
    sets, kv_bytes = decode_inputs(point, generator)
    seconds = neo_seconds(sets, repeats, graph_replay)
    del sets
    torch.cuda.empty_cache()
    sdpa = point_sdpa_seconds(point, repeats, generator, graph_replay)
    return {
        **point.fields(),
        "input_sets": input_sets(kv_bytes),
        "neo_ms": seconds * 1e3,
        "kv_gb_per_s": kv_bytes / seconds / 1e9,
        "percent_of_copy_bandwidth": 100 * kv_bytes / seconds / copy_bytes_per_second,
        "sdpa_enable_gqa_ms": sdpa["enable_gqa"] * 1e3,
        "sdpa_expanded_kv_ms": sdpa["expanded_kv"] * 1e3,
        "neo_over_best_sdpa": seconds / sdpa["best"],
    }


def sweep_point(point: DecodePoint, variants, variable: str, repeats: int,
                copy_bytes_per_second: float, generator: torch.Generator,
                graph_replay: bool) -> dict:
    """Every decode variant at one point, each checked against the reference on the first
    input set. The variable is restored to its previous state on return."""
    sets, kv_bytes = decode_inputs(point, generator)
    expected = torch.empty_like(sets[0][1])
    reference.paged_decode_attention(expected, *sets[0][1:])
    previous = os.environ.get(variable)
    results = {}
    try:
        for variant in variants:
            os.environ[variable] = variant
            out = sets[0][0]
            out.fill_(float("nan"))
            torch.ops.neo.paged_decode_attention(*sets[0])
            error = (out.float() - expected.float()).abs().max().item()
            seconds = neo_seconds(sets, repeats, graph_replay)
            results[variant] = {
                "neo_ms": seconds * 1e3,
                "percent_of_copy_bandwidth": 100 * kv_bytes / seconds / copy_bytes_per_second,
                "max_abs_error": error,
                "correct": error <= SWEEP_TOLERANCE,  # NaN compares False
            }
        # The first variant once more: how far the timing drifted over the sweep of this point.
        os.environ[variable] = variants[0]
        again = neo_seconds(sets, repeats, graph_replay) * 1e3
        first = results[variants[0]]["neo_ms"]
        drift_percent = 100 * (again - first) / first
    finally:
        if previous is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = previous
    del sets, expected
    torch.cuda.empty_cache()
    sdpa = point_sdpa_seconds(point, repeats, generator, graph_replay)["best"]
    for row in results.values():
        row["neo_over_best_sdpa"] = row["neo_ms"] / 1e3 / sdpa
    correct = {name: row for name, row in results.items() if row["correct"]}
    best = min(correct, key=lambda name: correct[name]["neo_ms"]) if correct else None
    return {**point.fields(), "best_sdpa_ms": sdpa * 1e3, "variants": results, "best": best,
            "baseline_drift_percent": drift_percent}


def best_per_class(report: dict) -> dict:
    """{"short" | "long": {"variant": name, "geomean_over_sdpa": x}} over the sweep's points,
    split where the launcher splits them: by the block table's width
    (``report["short_context_tokens"]``)."""
    classes = {}
    short = report["short_context_tokens"]
    for label, is_member in (("short", lambda width: width <= short),
                             ("long", lambda width: width > short)):
        points = [point for point in report["sweep"] if is_member(point["table_tokens"])]
        if not points:
            continue
        means = {}
        for name in report["variants"]:
            rows = [point["variants"][name] for point in points]
            if all(row["correct"] for row in rows):
                means[name] = math.exp(statistics.fmean(
                    math.log(row["neo_over_best_sdpa"]) for row in rows))
        if means:
            best = min(means, key=means.get)
            classes[label] = {"variant": best, "geomean_over_sdpa": means[best],
                              "points": len(points)}
    return classes


def timing_label(report: dict) -> str:
    timing = ("decode calls replayed from CUDA graphs" if report["graph_replay"]
              else "decode calls launched from Python")
    return f"{timing}, {report['block_order']} blocks"


def print_sweep(report: dict) -> None:
    print(f"\n{report['device']} | torch {report['torch']} | device-to-device copy "
          f"{report['copy_gb_per_s']:.0f} GB/s (read + write) | {timing_label(report)}")
    print("\npaged_decode_attention variants, bf16, 32/8 heads, head_dim 128, block 16; per point "
          "(seqs x context): % of copy bandwidth and time over the best SDPA (X: outside "
          "tolerance)")
    points = report["sweep"]
    variants = report["variants"]
    width = max(len(name) for name in variants) + len(" drift")
    cell = max(15, 2 + max(len(point["point"]) for point in points))  # per point column
    print(f"{'':<{width}}" + "".join(point["point"].rjust(cell) for point in points))
    for name in variants:
        cells = []
        for point in points:
            row = point["variants"][name]
            mark = " " if row["correct"] else "X"
            cells.append(f"{row['percent_of_copy_bandwidth']:.1f}% "
                         f"{row['neo_over_best_sdpa']:.3f}x{mark}".rjust(cell))
        print(f"{name:<{width}}" + "".join(cells))
    print(f"{variants[0] + ' drift':<{width}}" + "".join(
        f"{point['baseline_drift_percent']:+.1f}% ".rjust(cell) for point in points))
    print(f"{'best SDPA ms':<{width}}" + "".join(f"{point['best_sdpa_ms']:.3f} ".rjust(cell)
                                                for point in points))
    print("best per point:")
    for point in points:
        best = point["variants"].get(point["best"])
        if best:
            print(f"  {point['point']:<14} {point['best']:<{width}} "
                  f"{best['percent_of_copy_bandwidth']:5.1f}% of copy, "
                  f"{best['neo_over_best_sdpa']:.3f}x best SDPA")
        else:
            print(f"  {point['point']:<14} no variant within tolerance")
    print(f"heuristic (ops_cuda/launchers.h; short: a table of at most "
          f"{report['short_context_tokens']} tokens):")
    for label, best in report["best_per_class"].items():
        index = variants.index(best["variant"])
        print(f"  {label:<5} {best['variant']} (index {index}): geometric mean "
              f"{best['geomean_over_sdpa']:.3f}x best SDPA over {best['points']} points")


def other_kernels(repeats: int, generator: torch.Generator) -> list[dict]:
    """The remaining ops at Llama-3-8B-like sizes: neo's CUDA kernel vs the torch reference."""
    dtype = torch.bfloat16
    device = "cuda"

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    weight = randn(HIDDEN)
    hidden_in, hidden_out, residual = (randn(TOKENS, HIDDEN) for _ in range(3))
    gate_up, activation = randn(TOKENS, 2 * INTERMEDIATE), randn(TOKENS, INTERMEDIATE)
    positions = torch.randint(0, 8192, (TOKENS,), generator=generator, device=device)
    angles = torch.rand(8192, HEAD_DIM // 2, generator=generator, device=device) * 6.28
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    query, key = randn(TOKENS, NUM_HEADS, HEAD_DIM), randn(TOKENS, NUM_KV_HEADS, HEAD_DIM)
    value = randn(TOKENS, NUM_KV_HEADS, HEAD_DIM)
    k_cache = randn(4096, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(4096 * BLOCK_SIZE, generator=generator, device=device)[:TOKENS]
    prompt_tokens = 2048
    cu_seqlens = torch.arange(0, prompt_tokens + 1, 512, dtype=torch.int32, device=device)
    prefill_q = randn(prompt_tokens, NUM_HEADS, HEAD_DIM)
    prefill_k = randn(prompt_tokens, NUM_KV_HEADS, HEAD_DIM)
    prefill_v = randn(prompt_tokens, NUM_KV_HEADS, HEAD_DIM)
    prefill_out = torch.empty_like(prefill_q)

    cases = {
        "rms_norm": (f"[{TOKENS}, {HIDDEN}]", (hidden_out, hidden_in, weight, 1e-5),
                     2 * hidden_in.nbytes),
        "fused_add_rms_norm": (f"[{TOKENS}, {HIDDEN}]", (hidden_in, residual, weight, 1e-5),
                               4 * hidden_in.nbytes),
        "rotary_embedding": (f"q [{TOKENS}, {NUM_HEADS}, {HEAD_DIM}], "
                             f"k [{TOKENS}, {NUM_KV_HEADS}, {HEAD_DIM}]",
                             (positions, query, key, cos_sin_cache),
                             2 * (query.nbytes + key.nbytes)),
        "silu_and_mul": (f"[{TOKENS}, 2 x {INTERMEDIATE}]", (activation, gate_up),
                         gate_up.nbytes + activation.nbytes),
        "store_kv_cache": (f"{TOKENS} tokens x {NUM_KV_HEADS} x {HEAD_DIM}",
                           (key, value, k_cache, v_cache, slots), 4 * key.nbytes),
        "prefill_attention": (f"4 x 512 tokens, {NUM_HEADS}/{NUM_KV_HEADS} heads",
                              (prefill_out, prefill_q, prefill_k, prefill_v, cu_seqlens, 512,
                               HEAD_DIM ** -0.5), None),
    }
    results = []
    for op, (shape, arguments, bytes_moved) in cases.items():
        cuda_op = getattr(torch.ops.neo_cuda, op)
        reference_op = getattr(torch.ops.neo_reference, op)
        neo_seconds = time_per_call([lambda: cuda_op(*arguments)], repeats)
        reference_seconds = time_per_call([lambda: reference_op(*arguments)], repeats)
        results.append({
            "kernel": op,
            "shape": shape,
            "neo_ms": neo_seconds * 1e3,
            "reference_ms": reference_seconds * 1e3,
            "speedup_over_reference": reference_seconds / neo_seconds,
            "gb_per_s": bytes_moved / neo_seconds / 1e9 if bytes_moved else None,
        })
    results.append(swap_case(repeats, generator))
    return results


def swap_case(repeats: int, generator: torch.Generator) -> dict:
    """swap_blocks of 512 one-layer blocks GPU -> pinned CPU: one merged run vs scattered."""
    gpu = torch.randn(1024, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=generator,
                      device="cuda", dtype=torch.bfloat16)
    host = torch.empty(gpu.shape, dtype=gpu.dtype).pin_memory()
    contiguous = torch.stack((torch.arange(512), torch.arange(512)), dim=1)
    scattered = torch.stack((torch.arange(0, 1024, 2), torch.arange(512)), dim=1)
    run_seconds = time_per_call([lambda: torch.ops.neo_cuda.swap_blocks(gpu, host, contiguous)],
                                repeats)
    scattered_seconds = time_per_call(
        [lambda: torch.ops.neo_cuda.swap_blocks(gpu, host, scattered)], repeats)
    reference_seconds = time_per_call(
        [lambda: torch.ops.neo_reference.swap_blocks(gpu, host, scattered)], repeats)
    block_bytes = gpu[0].nbytes
    return {
        "kernel": "swap_blocks",
        "shape": f"512 blocks of {block_bytes // 1024} KiB to pinned CPU (scattered)",
        "neo_ms": scattered_seconds * 1e3,
        "reference_ms": reference_seconds * 1e3,
        "speedup_over_reference": reference_seconds / scattered_seconds,
        "gb_per_s": 512 * block_bytes / scattered_seconds / 1e9,
        "one_run_gb_per_s": 512 * block_bytes / run_seconds / 1e9,
    }


def print_tables(report: dict) -> None:
    print(f"\n{report['device']} | torch {report['torch']} | device-to-device copy "
          f"{report['copy_gb_per_s']:.0f} GB/s (read + write) | {timing_label(report)}")
    print("\npaged_decode_attention, bf16, 32/8 heads, head_dim 128, block 16")
    label_width = max([len("seqs x context")] + [len(row["point"]) for row in report["decode"]])
    header = (f"{'seqs x context':>{label_width}} {'neo ms':>9} {'KV GB/s':>8} {'% copy':>7} "
              f"{'sdpa gqa ms':>12} {'sdpa exp ms':>12} {'neo/sdpa':>9}")
    print(header)
    for row in report["decode"]:
        print(f"{row['point']:>{label_width}} {row['neo_ms']:>9.3f} "
              f"{row['kv_gb_per_s']:>8.0f} {row['percent_of_copy_bandwidth']:>6.1f}% "
              f"{row['sdpa_enable_gqa_ms']:>12.3f} {row['sdpa_expanded_kv_ms']:>12.3f} "
              f"{row['neo_over_best_sdpa']:>9.2f}")
    print(f"\nother kernels, bf16, {TOKENS} tokens (Llama-3-8B sizes)")
    print(f"{'kernel':<20} {'neo ms':>9} {'ref ms':>9} {'speedup':>8} {'GB/s':>7}  shape")
    for row in report["kernels"]:
        bandwidth = f"{row['gb_per_s']:>7.0f}" if row["gb_per_s"] else f"{'-':>7}"
        print(f"{row['kernel']:<20} {row['neo_ms']:>9.4f} {row['reference_ms']:>9.4f} "
              f"{row['speedup_over_reference']:>8.1f} {bandwidth}  {row['shape']}")


def run_sweep(report: dict, points, variants, repeats: int, copy: float,
              generator: torch.Generator, graph_replay: bool, json_path: str | None) -> int:
    """``variants``: names of compiled decode variants, or None for every one."""
    module = importlib.import_module("neo.ops._cuda_kernels")
    built = list(module.decode_variants)
    unknown = [name for name in variants or [] if name not in built]
    if unknown:
        print(f"cuda_kernels: --variants names no compiled decode variant: {unknown}; this build "
              f"has {built}", file=sys.stderr)
        return 2
    variants = variants or built
    report["variants"] = variants
    report["short_context_tokens"] = module.decode_short_context_tokens
    report["sweep"] = []
    for point in points:
        row = sweep_point(point, variants, module.decode_variant_variable, repeats, copy,
                          generator, graph_replay)
        report["sweep"].append(row)
        best = row["variants"].get(row["best"])
        summary = (f"best {row['best']}: {best['percent_of_copy_bandwidth']:.1f}% of copy "
                   f"bandwidth, {best['neo_over_best_sdpa']:.2f}x best SDPA" if best
                   else "no variant within tolerance")
        print(f"sweep {point.label}: {summary}", flush=True)
    report["best_per_class"] = best_per_class(report)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    print_sweep(report)
    wrong = [(point["point"], name) for point in report["sweep"]
             for name, row in point["variants"].items() if not row["correct"]]
    if wrong:
        print(f"cuda_kernels: variants outside tolerance: {wrong}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per point")
    parser.add_argument("--quick", action="store_true",
                        help="only the decode points "
                             f"{','.join(point.label for point in QUICK_DECODE_POINTS)}, 5 repeats")
    parser.add_argument("--sweep", action="store_true",
                        help="every decode kernel variant at every decode point (and no other "
                             "kernels)")
    parser.add_argument("--points", type=parse_points, metavar="SxC[+SxC...][@TABLE],...",
                        help="decode points (sequences x context; groups joined by + make a "
                             "mixed batch; @TABLE: the block table's width in tokens) instead "
                             f"of {','.join(point.label for point in DECODE_POINTS)}")
    parser.add_argument("--variants", type=lambda text: text.split(","), metavar="NAME,...",
                        help="with --sweep: these compiled decode variants only")
    parser.add_argument("--graph-replay", action="store_true",
                        help="time the decode calls (neo's and SDPA's) replayed from a CUDA "
                             "graph, as the engine's decode iterations run, instead of launched "
                             "one by one from Python")
    parser.add_argument("--block-order", choices=BLOCK_ORDERS, default="shuffled",
                        help="where the decode points' blocks lie in the cache: shuffled (at "
                             "random places) or sequential (each sequence's blocks in a row)")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    if arguments.variants and not arguments.sweep:
        parser.error("--variants selects among the variants of --sweep")
    if not torch.cuda.is_available():
        print("cuda_kernels: no CUDA device; nothing to measure", file=sys.stderr)
        return 1
    unavailable = [impl for op in ("paged_decode_attention", "swap_blocks")
                   for impl in implementations(op, "cuda", available_only=False)
                   if impl.name == "cuda" and not impl.available]
    if unavailable:
        print(f"cuda_kernels: the CUDA kernels are not built: {unavailable[0].note}",
              file=sys.stderr)
        return 1
    repeats = 5 if arguments.quick else arguments.repeats
    points = [replace(point, block_order=arguments.block_order) for point in
              arguments.points or (QUICK_DECODE_POINTS if arguments.quick else DECODE_POINTS)]
    generator = torch.Generator(device="cuda").manual_seed(arguments.seed)
    copy = copy_bandwidth(repeats)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_gb_per_s": copy / 1e9,
        "graph_replay": arguments.graph_replay,
        "block_order": arguments.block_order,
        "decode": [],
        "kernels": [],
    }
    if arguments.sweep:
        return run_sweep(report, points, arguments.variants, repeats, copy, generator,
                         arguments.graph_replay, arguments.json)
    for point in points:
        row = decode_point(point, repeats, copy, generator, arguments.graph_replay)
        report["decode"].append(row)
        print(f"decode {point.label}: {row['neo_ms']:.3f} ms, "
              f"{row['percent_of_copy_bandwidth']:.1f}% of copy bandwidth, "
              f"{row['neo_over_best_sdpa']:.2f}x best SDPA", flush=True)
        torch.cuda.empty_cache()
    report["kernels"] = other_kernels(repeats, generator)
    if arguments.json:
        with open(arguments.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    print_tables(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
