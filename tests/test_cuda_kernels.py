"""CUDA-only checks of the kernels in ``ops_cuda/`` (``torch.ops.neo_cuda``).

The per-op grids in ``tests/test_<op>.py`` already run every implementation, the CUDA one
included, against the reference. This file adds what only the GPU path has: swaps between the
GPU and pinned host memory on the caller's stream, non-contiguous rotary views, flash-attention
prefill in half precision, the partitioned (split-K) decode path at long contexts, every head
size and block size the decode kernel has a separate code path for, and the grid-padding
behaviour of sequences with seq_len 0. The decode checks run once per compiled decode kernel
variant (``ops_cuda/launchers.h``), selected through the environment variable the op reads.

Every test skips when CUDA is absent; with CUDA present, a missing build fails.
"""

import importlib
import itertools
import time
import warnings

import pytest
import torch

from neo.ops import implementations, reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="CUDA is not available (torch.cuda.is_available() is False)"),
]

# The decode kernel variants of ops_cuda/launchers.h, in launcher order; the first test below
# fails when the build's list differs.
DECODE_VARIANTS = ("w4_l8_p512", "w4_l8_p512_pv", "w4_l8_p1024_pv", "w4_l8_p512_pv_et", "w4_l16_p1024_pv_et",
                   "w4_l4_p512_pv_db_et", "w4_l8_p1024_pv_tc", "w4_l8_p1024_pv_tc_i1",
                   "w4_l8_p1024_pv_tc_i2", "w4_l8_p1024_pv_tc_i4")
DECODE_VARIANT_VARIABLE = "NEO_DECODE_ATTENTION_VARIANT"
# Block id of the unused block-table entries: rows through it lie far outside any cache.
UNUSED_BLOCK_ID = 2**31 - 1

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


@pytest.fixture(scope="module")
def cuda_ops():
    """``torch.ops.neo_cuda``, after checking that every op's CUDA kernel was built."""
    missing = []
    for op in ("paged_decode_attention", "store_kv_cache", "swap_blocks", "prefill_attention",
               "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"):
        cuda = [impl for impl in implementations(op, available_only=False) if impl.name == "cuda"]
        if not cuda or not cuda[0].available:
            missing.append(f"{op}: {cuda[0].note if cuda else 'not registered'}")
    assert not missing, "CUDA is available but the CUDA kernels are not: " + "; ".join(missing)
    return torch.ops.neo_cuda


@pytest.fixture(params=DECODE_VARIANTS)
def decode_variant(request, monkeypatch):
    """Selects one decode kernel variant for the test; returns its name."""
    monkeypatch.setenv(DECODE_VARIANT_VARIABLE, request.param)
    return request.param


def test_decode_variant_list_matches_the_build(cuda_ops):
    module = importlib.import_module("neo.ops._cuda_kernels")
    assert module.decode_variants == DECODE_VARIANTS
    assert module.decode_variant_variable == DECODE_VARIANT_VARIABLE
    assert module.decode_short_context_tokens == 256


def test_decode_unknown_variant_is_rejected(cuda_ops, monkeypatch):
    monkeypatch.setenv(DECODE_VARIANT_VARIABLE, "w3_l9")
    generator = torch.Generator(device="cuda").manual_seed(6)
    k_cache, v_cache, table, seq_lens = make_paged_cache([20], 2, 64, 16, torch.float16,
                                                         generator)
    q = torch.randn(1, 4, 64, generator=generator, device="cuda").half()
    with pytest.raises(ValueError, match=f"{DECODE_VARIANT_VARIABLE}=w3_l9 names no decode"):
        cuda_ops.paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, table,
                                        seq_lens, 0.125)


def make_paged_cache(lengths, num_kv_heads, head_dim, block_size, dtype, generator):
    """Random K/V caches with spare blocks and a shuffled block table for ``lengths``.

    Returns (k_cache, v_cache, block_table int32 [S, max_blocks], seq_lens int32 [S]). Slots past
    each sequence's length inside its last block hold NaN, so reading them shows up; table
    entries past each sequence's blocks hold an id far outside the cache, so a kernel may load
    them but faults if it reads a row through one.
    """
    device = "cuda"
    blocks_per_seq = [max(1, -(-length // block_size)) for length in lengths]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 7
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=generator, device=device).to(dtype)
    order = torch.randperm(num_blocks, generator=generator, device=device)
    table = torch.full((len(lengths), max_blocks), UNUSED_BLOCK_ID, dtype=torch.int32,
                       device=device)
    used = 0
    for row, (length, count) in enumerate(zip(lengths, blocks_per_seq)):
        table[row, :count] = order[used:used + count].int()
        used += count
        if length % block_size:
            last = int(table[row, count - 1])
            k_cache[last, :, length % block_size:] = float("nan")
            v_cache[last, :, length % block_size:] = float("nan")
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return k_cache, v_cache, table, seq_lens


def check_decode(cuda_ops, lengths, num_heads, num_kv_heads, head_dim, block_size, dtype,
                 seed=0, extra_columns=0):
    """The kernel against the reference on a fresh cache; ``extra_columns`` widens the block
    table with unused entries, as a CUDA graph's table is wider than its sequences."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    k_cache, v_cache, table, seq_lens = make_paged_cache(lengths, num_kv_heads, head_dim,
                                                         block_size, dtype, generator)
    if extra_columns:
        padding = torch.full((len(lengths), extra_columns), UNUSED_BLOCK_ID, dtype=torch.int32,
                             device="cuda")
        table = torch.cat((table, padding), dim=1)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator, device="cuda").to(dtype)
    scale = head_dim ** -0.5
    expected = torch.empty_like(q)
    reference.paged_decode_attention(expected, q, torch.nan_to_num(k_cache),
                                     torch.nan_to_num(v_cache), table, seq_lens, scale)
    out = torch.full_like(q, float("nan"))
    cuda_ops.paged_decode_attention(out, q, k_cache, v_cache, table, seq_lens, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_decode_every_head_dim_and_block_size(cuda_ops, decode_variant, head_dim, block_size):
    lengths = [1, block_size, block_size + 1, 300, 511, 512, 513, 1300]
    check_decode(cuda_ops, lengths, 8, 2, head_dim, block_size, torch.bfloat16, seed=head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (12, 4), (32, 8), (28, 4),
                                                    (16, 1), (40, 2), (6, 2)])
def test_decode_group_sizes(cuda_ops, decode_variant, dtype, num_heads, num_kv_heads):
    """MHA, GQA groups of 2/3/4/7/20 and MQA with 16 heads (blocks serve up to 8 heads); 6 heads
    leave the merge's last block of 4 heads half empty."""
    check_decode(cuda_ops, [1, 17, 700, 64], num_heads, num_kv_heads, 128, 16, dtype)


@pytest.mark.parametrize("num_seqs", [16, 100, 256])
def test_decode_default_variant_at_every_batch_size(cuda_ops, monkeypatch, num_seqs):
    """The default launch on batches from a few sequences to more than fill the GPU, where the
    tensor-core kernel runs from four warps per KV head down to one (choose_warps_per_item)."""
    monkeypatch.delenv(DECODE_VARIANT_VARIABLE, raising=False)
    lengths = [1 + (97 * seq) % 600 for seq in range(num_seqs)]
    check_decode(cuda_ops, lengths, 32, 8, 128, 16, torch.bfloat16, seed=num_seqs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_long_context_partitions(cuda_ops, decode_variant, dtype):
    """A 20K-token sequence is split over many partitions and merged; lengths at and just past
    each variant's partition size (256, 512, 1024) take the direct and the split path."""
    check_decode(cuda_ops, [20_000, 513, 1, 4096, 256, 257, 1024, 1025], 32, 8, 128, 16, dtype,
                 seed=7)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_decode_partition_tails(cuda_ops, decode_variant, block_size, head_dim, dtype):
    """Lengths around the points where a sequence's last partition stops taking its tail itself
    (a quarter partition past a whole number of partitions in the tensor-core kernel: 1280, 2304
    tokens with 1024-token partitions) and one more partition begins, in a table wider than the
    longest sequence."""
    lengths = [1025, 1100, 1279, 1280, 1281, 2304, 2305, 3333, 511, 513, 640, 641, 1]
    check_decode(cuda_ops, lengths, 32, 8, head_dim, block_size, dtype, seed=block_size + head_dim,
                 extra_columns=4096 // block_size)


def test_decode_wide_block_table(cuda_ops, decode_variant):
    """A block table wider than any sequence needs: extra partitions must stay idle."""
    generator = torch.Generator(device="cuda").manual_seed(3)
    k_cache, v_cache, table, seq_lens = make_paged_cache([40, 3], 2, 64, 16, torch.float16,
                                                         generator)
    wide = torch.full((2, 200), UNUSED_BLOCK_ID, dtype=torch.int32, device="cuda")
    wide[:, :table.shape[1]] = table
    q = torch.randn(2, 4, 64, generator=generator, device="cuda").half()
    expected = torch.empty_like(q)
    reference.paged_decode_attention(expected, q, torch.nan_to_num(k_cache),
                                     torch.nan_to_num(v_cache), table, seq_lens, 0.125)
    out = torch.full_like(q, float("nan"))
    cuda_ops.paged_decode_attention(out, q, k_cache, v_cache, wide, seq_lens, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float16])


def test_decode_zero_length_rows_are_zero(cuda_ops, decode_variant):
    """Padding rows (seq_len 0, e.g. in a padded CUDA-graph batch) get zeros, never NaN."""
    generator = torch.Generator(device="cuda").manual_seed(4)
    k_cache, v_cache, table, seq_lens = make_paged_cache([33, 1], 2, 128, 16, torch.bfloat16,
                                                         generator)
    seq_lens[1] = 0
    q = torch.randn(2, 8, 128, generator=generator, device="cuda").bfloat16()
    out = torch.full_like(q, float("nan"))
    cuda_ops.paged_decode_attention(out, q, k_cache, v_cache, table, seq_lens, 0.1)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out[0].float()).all()


def test_decode_opcheck_split_path(cuda_ops, decode_variant):
    generator = torch.Generator(device="cuda").manual_seed(5)
    k_cache, v_cache, table, seq_lens = make_paged_cache([1200, 5], 2, 128, 16, torch.bfloat16,
                                                         generator)
    q = torch.randn(2, 8, 128, generator=generator, device="cuda").bfloat16()
    out = torch.empty_like(q)
    torch.library.opcheck(cuda_ops.paged_decode_attention.default,
                          (out, q, k_cache, v_cache, table, seq_lens, 0.088))


# ---- swap_blocks ------------------------------------------------------------------------------

MAPPING_WITH_RUNS = [(0, 3), (1, 4), (2, 5), (7, 0), (9, 1), (10, 2), (4, 9), (6, 11)]


def cache_blocks(num_blocks, dtype=torch.bfloat16):
    """A random GPU cache layer [num_blocks, 4, 16, 64]."""
    return torch.randn(num_blocks, 4, 16, 64, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_round_trip_through_pinned_memory(cuda_ops, dtype):
    """GPU -> pinned CPU -> GPU with runs merged; unmapped destination blocks keep their data."""
    gpu = cache_blocks(12, dtype)
    host = torch.full((12, 4, 16, 64), -7.0, dtype=dtype).pin_memory()
    back = torch.full_like(gpu, float("nan"))
    mapping = torch.tensor(MAPPING_WITH_RUNS, dtype=torch.int64)
    cuda_ops.swap_blocks(gpu, host, mapping)
    reverse = mapping.flip(1).contiguous()
    cuda_ops.swap_blocks(host, back, reverse)
    torch.cuda.synchronize()
    for source, destination in MAPPING_WITH_RUNS:
        assert torch.equal(host[destination], gpu[source].cpu())
        assert torch.equal(back[source], gpu[source])
    untouched = sorted(set(range(12)) - {destination for _, destination in MAPPING_WITH_RUNS})
    assert (host[untouched] == -7.0).all()
    unread = sorted(set(range(12)) - {source for source, _ in MAPPING_WITH_RUNS})
    assert torch.isnan(back[unread].float()).all()


def test_swap_is_ordered_on_the_current_stream_without_host_sync(cuda_ops):
    """Copies queue on the caller's (side) stream behind earlier work and return at once."""
    gpu = cache_blocks(12)
    host = torch.zeros(12, 4, 16, 64, dtype=torch.bfloat16).pin_memory()
    mapping = torch.tensor(MAPPING_WITH_RUNS, dtype=torch.int64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(300_000_000)  # keeps the side stream busy for ~0.15-0.3 s
        gpu.fill_(3.0)  # must land before the copy that follows on the same stream
        started = time.perf_counter()
        cuda_ops.swap_blocks(gpu, host, mapping)
        elapsed = time.perf_counter() - started
    assert not side.query(), "the side stream finished too early for this check to mean anything"
    side.synchronize()
    assert elapsed < 0.05, f"swap_blocks blocked the host for {elapsed:.3f} s"
    for _, destination in MAPPING_WITH_RUNS:
        assert (host[destination] == 3.0).all()


def test_swap_pageable_memory_warns_and_still_copies(cuda_ops, capfd):
    gpu = cache_blocks(12)
    host = torch.zeros(12, 4, 16, 64, dtype=torch.bfloat16)
    mapping = torch.tensor(MAPPING_WITH_RUNS, dtype=torch.int64)
    previous = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cuda_ops.swap_blocks(gpu, host, mapping)
    finally:
        torch.set_warn_always(previous)
    torch.cuda.synchronize()
    # Depending on how the op was reached, torch turns the C++ warning into a Python warning
    # or prints it on stderr.
    printed = capfd.readouterr().err
    assert any("pinned" in str(warning.message) for warning in caught) or "pinned" in printed
    for source, destination in MAPPING_WITH_RUNS:
        assert torch.equal(host[destination], gpu[source].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_of_whole_pools_through_pinned_memory(cuda_ops, dtype):
    """Pools [layers, 2, B, ...] seen block-first: each run of blocks moves, every layer, K and
    V, in one pitched copy each way; the blocks of other ids keep their data in every layer."""
    gpu_pool = torch.randn(3, 2, 12, 4, 16, 64, device="cuda").to(dtype)
    host_pool = torch.full((3, 2, 14, 4, 16, 64), -7.0, dtype=dtype).pin_memory()
    back_pool = torch.full_like(gpu_pool, float("nan"))
    mapping = torch.tensor(MAPPING_WITH_RUNS, dtype=torch.int64)
    cuda_ops.swap_blocks(gpu_pool.movedim(2, 0), host_pool.movedim(2, 0), mapping)
    cuda_ops.swap_blocks(host_pool.movedim(2, 0), back_pool.movedim(2, 0), mapping.flip(1).contiguous())
    torch.cuda.synchronize()
    for source, destination in MAPPING_WITH_RUNS:
        assert torch.equal(host_pool[:, :, destination], gpu_pool[:, :, source].cpu())
        assert torch.equal(back_pool[:, :, source], gpu_pool[:, :, source])
    untouched = sorted(set(range(14)) - {destination for _, destination in MAPPING_WITH_RUNS})
    assert (host_pool[:, :, untouched] == -7.0).all()
    unread = sorted(set(range(12)) - {source for source, _ in MAPPING_WITH_RUNS})
    assert torch.isnan(back_pool[:, :, unread].float()).all()


def test_swap_with_a_pitch_past_the_2d_copy_limit(cuda_ops):
    """A host pool whose rows lie more than cudaDevAttrMaxPitch apart (2 GiB) is copied row by
    row. The host tensor is pageable and never written outside the mapped blocks, so only
    those pages are ever backed."""
    chunk = 4096
    num_host_blocks = 2**31 // chunk + 8  # cudaDevAttrMaxPitch is 2**31 - 1 on CUDA GPUs
    host_pool = torch.empty((2, num_host_blocks, chunk), dtype=torch.uint8)
    gpu_pool = torch.randint(0, 255, (2, 6, chunk), dtype=torch.uint8, device="cuda")
    mapping = torch.tensor([[0, 0], [1, 1], [4, num_host_blocks - 1]], dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the pageable-memory warning
        cuda_ops.swap_blocks(gpu_pool.movedim(1, 0), host_pool.movedim(1, 0), mapping)
    torch.cuda.synchronize()
    for source, destination in mapping.tolist():
        assert torch.equal(host_pool[:, destination], gpu_pool[:, source].cpu())


def test_swap_within_the_gpu(cuda_ops):
    src = cache_blocks(12)
    dst = torch.full_like(src, float("nan"))
    mapping = torch.tensor(MAPPING_WITH_RUNS, dtype=torch.int64)
    cuda_ops.swap_blocks(src, dst, mapping)
    expected = torch.full_like(src, float("nan"))
    reference.swap_blocks(src, expected, mapping)
    torch.testing.assert_close(dst, expected, equal_nan=True, atol=0, rtol=0)


def test_swap_rejects_overlapping_blocks_in_one_tensor(cuda_ops):
    cache = cache_blocks(8)
    with pytest.raises(ValueError, match="both a source and a destination"):
        cuda_ops.swap_blocks(cache, cache, torch.tensor([[0, 1], [1, 2]], dtype=torch.int64))


def test_swap_rejects_block_ids_out_of_range(cuda_ops):
    src = cache_blocks(4)
    host = torch.zeros(4, 4, 16, 64, dtype=torch.bfloat16).pin_memory()
    with pytest.raises(ValueError, match="outside"):
        cuda_ops.swap_blocks(src, host, torch.tensor([[0, 4]], dtype=torch.int64))


# ---- rotary embedding on views of a fused QKV output ------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [64, 128])
def test_rotary_on_fused_qkv_views(cuda_ops, dtype, rotary_dim):
    tokens, heads, kv_heads, head_dim = 37, 8, 2, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    assert not query.is_contiguous() and not key.is_contiguous()
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    exponents = torch.arange(0, rotary_dim, 2, device="cuda") / rotary_dim
    inverse_frequency = 1.0 / (500000.0 ** exponents)
    angles = torch.arange(4096, device="cuda").float()[:, None] * inverse_frequency[None]
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    expected_query, expected_key = query.clone(), key.clone()
    reference.rotary_embedding(positions, expected_query, expected_key, cos_sin_cache)
    values_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    cuda_ops.rotary_embedding(positions, query, key, cos_sin_cache)
    torch.testing.assert_close(query, expected_query, **TOLERANCES[dtype])
    torch.testing.assert_close(key, expected_key, **TOLERANCES[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], values_before)


# ---- prefill attention ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64),
                                            (torch.bfloat16, 256), (torch.float32, 96),
                                            (torch.float32, 128)])
def test_prefill_packed_prompts(cuda_ops, dtype, head_dim):
    """Flash attention (half precision) and our kernel (float32) on packed causal prompts."""
    lengths = [1, 17, 128, 300, 0, 65]
    cu_seqlens = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32,
                              device="cuda")
    tokens = int(cu_seqlens[-1])
    generator = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(tokens, 32, head_dim, generator=generator, device="cuda").to(dtype)
    k = torch.randn(tokens, 8, head_dim, generator=generator, device="cuda").to(dtype)
    v = torch.randn(tokens, 8, head_dim, generator=generator, device="cuda").to(dtype)
    scale = head_dim ** -0.5
    expected = torch.empty_like(q)
    reference.prefill_attention(expected, q, k, v, cu_seqlens, max(lengths), scale)
    out = torch.full_like(q, float("nan"))
    cuda_ops.prefill_attention(out, q, k, v, cu_seqlens, max(lengths), scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_prefill_on_fused_qkv_views(cuda_ops):
    lengths = [50, 14]
    cu_seqlens = torch.tensor([0, 50, 64], dtype=torch.int32, device="cuda")
    heads, kv_heads, head_dim = 16, 4, 128
    qkv = torch.randn(64, heads + 2 * kv_heads, head_dim, device="cuda").bfloat16()
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    expected = torch.empty(64, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    reference.prefill_attention(expected, q, k, v, cu_seqlens, max(lengths), 0.1)
    out = torch.full_like(expected, float("nan"))
    cuda_ops.prefill_attention(out, q, k, v, cu_seqlens, max(lengths), 0.1)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


def test_prefill_opcheck_flash_path(cuda_ops):
    cu_seqlens = torch.tensor([0, 9, 30], dtype=torch.int32, device="cuda")
    q = torch.randn(30, 8, 64, device="cuda").half()
    k = torch.randn(30, 2, 64, device="cuda").half()
    v = torch.randn(30, 2, 64, device="cuda").half()
    out = torch.empty_like(q)
    torch.library.opcheck(cuda_ops.prefill_attention.default, (out, q, k, v, cu_seqlens, 21, 0.125))


# ---- norms and activation on strided rows -----------------------------------------------------

@pytest.mark.parametrize("vector_friendly", [True, False])
def test_norms_and_silu_on_strided_rows(cuda_ops, vector_friendly):
    """Row strides and widths that allow 16-byte vectors, and ones that force the scalar path."""
    hidden = 4096 if vector_friendly else 4100
    buffer = torch.randn(9, hidden + 8, device="cuda").bfloat16()
    rows = buffer[:, :hidden]
    weight = torch.randn(hidden, device="cuda").bfloat16()
    expected = torch.empty_like(rows)
    reference.rms_norm(expected, rows, weight, 1e-5)
    out = torch.full_like(rows, float("nan"))
    cuda_ops.rms_norm(out, rows, weight, 1e-5)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])

    residual = torch.randn(9, hidden, device="cuda").bfloat16()
    expected_input, expected_residual = rows.clone(), residual.clone()
    reference.fused_add_rms_norm(expected_input, expected_residual, weight.float(), 1e-6)
    cuda_ops.fused_add_rms_norm(rows, residual, weight.float(), 1e-6)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(rows, expected_input, **TOLERANCES[torch.bfloat16])

    gate_up = torch.randn(9, 2 * hidden, device="cuda").bfloat16()
    expected = torch.empty(9, hidden, device="cuda", dtype=torch.bfloat16)
    reference.silu_and_mul(expected, gate_up)
    out = torch.full_like(expected, float("nan"))
    cuda_ops.silu_and_mul(out, gate_up)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


def test_store_kv_cache_from_fused_qkv_views(cuda_ops):
    tokens, heads, kv_heads, head_dim, block_size = 21, 8, 2, 64, 16
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device="cuda").half()
    _, key, value = qkv.split([heads, kv_heads, kv_heads], dim=1)
    k_cache = torch.full((6, kv_heads, block_size, head_dim), float("nan"), device="cuda").half()
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(6 * block_size, device="cuda")[:tokens]
    slots[3] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(key, value, expected_k, expected_v, slots)
    cuda_ops.store_kv_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, atol=0, rtol=0)
