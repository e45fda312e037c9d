"""The host's attention kernel alone, on the shapes of a run's host batches.

A host batch of the async host pipeline attends in host functions, one per layer, between its
GPU stages; the trace records how long those functions ran (``host_busy_seconds``) and over how
many context tokens (``host_context_tokens``). ``replay_host_batches`` runs the engine's CPU
attention kernel on the same shapes alone, right after the run: every layer of a sample of the
batches, one call per layer, over random blocks of the engine's own host pool, on the engine's
host-attention thread and thread count. The engine's time over the kernel's alone is what the
hand-off costs the host: waking the host function, its place among the driver's callbacks and
the memory traffic of the GPU stages beside it (the host functions also store the batch's new
K/V, a small share of their time). The trace keeps the sum of a batch's context lengths, not
each one, so the replay gives the batch's requests equal lengths.
"""

import time

import torch

from neo.engine.build import host_kernels


def sample_batches(records: list[dict], count: int) -> list[dict]:
    """Up to ``count`` of the records' host batches with host work, spread evenly over the run."""
    batches = [r for r in records if r["host_batch"] and r["host_decodes"] and r["host_busy_seconds"] > 0]
    if len(batches) <= count:
        return batches
    return [batches[index * len(batches) // count] for index in range(count)]


def equal_lengths(total: int, count: int) -> list[int]:
    """``count`` lengths that differ by at most one and sum to ``total``."""
    base, extra = divmod(total, count)
    return [base + (index < extra) for index in range(count)]


def replay_host_batches(engine, records: list[dict], samples: int = 16, seed: int = 0) -> dict | None:
    """The sampled batches' host-function time in the run against the kernel's alone on their
    shapes (see the module docstring); None when the run made no host batch with host work, or
    the engine has no host-attention thread."""
    batches = sample_batches(records, samples)
    if not batches or engine.worker is None:
        return None
    layout = engine.kv_cache.layout
    kernel = host_kernels(engine.config.cpu_attention_kernel).attention.function
    num_heads = engine.model.rank_config.num_heads
    generator = torch.Generator().manual_seed(seed)

    def attend_every_layer(query, block_table, seq_lens) -> float:
        out = torch.empty_like(query)
        start = time.perf_counter()
        for key_cache, value_cache in engine.kv_cache.host_layers:
            kernel(out, query, key_cache, value_cache, block_table, seq_lens, layout.head_dim ** -0.5)
        return time.perf_counter() - start

    engine_seconds = alone_seconds = 0.0
    context_tokens = replayed = 0
    for batch in batches:
        lengths = equal_lengths(batch["host_context_tokens"], batch["host_decodes"])
        blocks_per_sequence = -(-max(lengths) // layout.block_size)
        if batch["host_decodes"] * blocks_per_sequence > layout.num_host_blocks:
            continue
        blocks = torch.randperm(layout.num_host_blocks, generator=generator)[:batch["host_decodes"] * blocks_per_sequence]
        block_table = blocks.to(torch.int32).view(batch["host_decodes"], blocks_per_sequence)
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        query = torch.randn(batch["host_decodes"], num_heads, layout.head_dim, generator=generator).to(layout.dtype)
        def replay():
            return attend_every_layer(query, block_table, seq_lens)

        if not replayed:  # the first call on the thread starts its pool's threads: not timed
            engine.worker.submit(replay).result()
        alone_seconds += engine.worker.submit(replay).result()
        engine_seconds += batch["host_busy_seconds"]
        context_tokens += batch["host_context_tokens"]
        replayed += 1
    if not replayed:
        return None
    kv_bytes = context_tokens * layout.token_bytes
    return {"batches": replayed, "engine_seconds": engine_seconds, "alone_seconds": alone_seconds,
            "engine_over_alone": engine_seconds / alone_seconds,
            "kv_read_gbps_engine": kv_bytes / engine_seconds / 1e9,
            "kv_read_gbps_alone": kv_bytes / alone_seconds / 1e9}
