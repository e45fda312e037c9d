"""Block swaps between the GPU KV pool and the page-locked host pool, three ways, against one
contiguous copy of the same bytes (the ceiling), both directions.

A swap moves whole blocks of requests: each block has one chunk per layer and K/V
(``block_size x kv_heads x head_dim`` elements), and the pools are ``[layers, 2, blocks, ...]``,
so a block's chunks lie one pool-layer apart. The ways:

- ``per K/V``: one ``swap_blocks`` per layer and per K and V on ``[blocks, ...]`` views, one
  copy per run of consecutive blocks in each (``2 x layers`` calls);
- ``per layer``: ``KVCache.swap_layer``, K and V of a layer in one pitched copy per run
  (``layers`` calls; the eager walk overlaps these with the layers);
- ``all layers``: ``KVCache.swap``, every layer and K/V in one pitched copy per run (one call;
  what a plan that replays a graph runs before the replay).

Blocks are distinct random ids in both pools (no runs), or consecutive ids (``--consecutive``).
Times are CUDA-event medians on one stream; GB/s counts the bytes moved.

    python benchmarks/swap_copies.py --model llama-3.1-8b [--tensor-parallel-size 2]
        [--blocks 8,77,256] [--json out.json]
"""

import argparse
import json
import statistics
import sys

import torch

from neo.bench import device_name
from neo.kv.kv_cache import CacheLayout, KVCache
from neo.models.loader import resolve_model_config
from neo.models.parallel import rank_config

GIB = 1 << 30


def median_seconds(call, repeats: int) -> float:
    """Median over ``repeats`` of one ``call``'s time between CUDA events on the current stream."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def mappings(count: int, layout: CacheLayout, consecutive: bool, generator: torch.Generator):
    """(gpu_to_host, host_to_gpu) int64 ``[count, 2]`` block pairs."""
    if consecutive:
        gpu_ids, host_ids = torch.arange(count), torch.arange(count)
    else:
        gpu_ids = torch.randperm(layout.num_gpu_blocks, generator=generator)[:count]
        host_ids = torch.randperm(layout.num_host_blocks, generator=generator)[:count]
    return torch.stack((gpu_ids, host_ids), dim=1), torch.stack((host_ids, gpu_ids), dim=1)


def per_kv(cache: KVCache, gpu_to_host: torch.Tensor, host_to_gpu: torch.Tensor) -> None:
    """One ``swap_blocks`` per layer and per K and V."""
    for layer in range(cache.layout.num_layers):
        for kv in range(2):
            if gpu_to_host.numel():
                torch.ops.neo.swap_blocks(cache.gpu[layer, kv], cache.host[layer, kv], gpu_to_host)
            if host_to_gpu.numel():
                torch.ops.neo.swap_blocks(cache.host[layer, kv], cache.gpu[layer, kv], host_to_gpu)


def per_layer(cache: KVCache, gpu_to_host: torch.Tensor, host_to_gpu: torch.Tensor) -> None:
    for layer in range(cache.layout.num_layers):
        cache.swap_layer(layer, gpu_to_host, host_to_gpu)


WAYS = {"per K/V": per_kv, "per layer": per_layer,
        "all layers": lambda cache, out, into: cache.swap(out, into)}


def measure(cache: KVCache, count: int, consecutive: bool, repeats: int,
            generator: torch.Generator) -> dict:
    """One row: each way's time and GB/s per direction, and the contiguous copy's."""
    layout = cache.layout
    gpu_to_host, host_to_gpu = mappings(count, layout, consecutive, generator)
    empty = torch.empty((0, 2), dtype=torch.int64)
    moved = count * layout.block_bytes
    flat_gpu, flat_host = cache.gpu.view(-1), cache.host.view(-1)
    elements = moved // layout.dtype.itemsize
    row = {"blocks": count, "mib": moved / (1 << 20), "ways": {}}
    directions = {"to host": (gpu_to_host, empty), "to GPU": (empty, host_to_gpu)}
    ceilings = {"to host": lambda: flat_host[:elements].copy_(flat_gpu[:elements], non_blocking=True),
                "to GPU": lambda: flat_gpu[:elements].copy_(flat_host[:elements], non_blocking=True)}
    for direction, (out, into) in directions.items():
        ceiling = median_seconds(ceilings[direction], repeats)
        row[f"contiguous {direction} GB/s"] = moved / ceiling / 1e9
        for name, way in WAYS.items():
            seconds = median_seconds(lambda: way(cache, out, into), repeats)
            row["ways"][f"{name} {direction}"] = {
                "ms": seconds * 1e3, "gb_per_s": moved / seconds / 1e9,
                "of_contiguous": ceiling / seconds}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="built-in model name or directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="the pools of one rank of this many (its share of the KV heads)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", default="8,77,256", help="blocks per swap, comma-separated")
    parser.add_argument("--gpu-pool-gib", type=float, default=2.0)
    parser.add_argument("--host-pool-gib", type=float, default=4.0)
    parser.add_argument("--consecutive", action="store_true", help="consecutive block ids (one run)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", metavar="PATH")
    arguments = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("swap_copies: no CUDA device; nothing to measure", file=sys.stderr)
        return 1
    config = rank_config(resolve_model_config(arguments.model, arguments.dtype),
                         arguments.tensor_parallel_size)
    layout = CacheLayout.for_budgets(config, config.dtype, arguments.block_size,
                                     int(arguments.gpu_pool_gib * GIB), int(arguments.host_pool_gib * GIB))
    counts = [int(count) for count in arguments.blocks.split(",")]
    if max(counts) > min(layout.num_gpu_blocks, layout.num_host_blocks):
        parser.error(f"--blocks {max(counts)} exceeds the pools ({layout.num_gpu_blocks} GPU, "
                     f"{layout.num_host_blocks} host blocks of {layout.block_bytes / (1 << 20):.2f} MiB)")
    cache = KVCache(layout, torch.device("cuda"))
    generator = torch.Generator().manual_seed(0)
    report = {"device": device_name(torch.device("cuda")), "model": config.name,
              "tensor_parallel_size": arguments.tensor_parallel_size,
              "layers": layout.num_layers, "block_bytes": layout.block_bytes,
              "consecutive": arguments.consecutive, "rows": []}
    try:
        for count in counts:
            report["rows"].append(measure(cache, count, arguments.consecutive, arguments.repeats, generator))
    finally:
        cache.close()
    print(f"{report['device']} | {config.name}, {layout.num_layers} layers, blocks of "
          f"{layout.block_bytes / (1 << 20):.2f} MiB over all layers, "
          f"{'consecutive' if arguments.consecutive else 'random'} ids")
    print(f"{'blocks':>6} {'MiB':>7} {'way':<22} {'ms':>8} {'GB/s':>7} {'of contiguous':>14}")
    for row in report["rows"]:
        for name, way in row["ways"].items():
            direction = name.split()[-2] + " " + name.split()[-1]
            ceiling = row[f"contiguous {direction} GB/s"]
            print(f"{row['blocks']:>6} {row['mib']:>7.1f} {name:<22} {way['ms']:>8.3f} "
                  f"{way['gb_per_s']:>7.1f} {way['of_contiguous']:>13.0%}  (contiguous {ceiling:.1f} GB/s)")
    if arguments.json:
        with open(arguments.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
