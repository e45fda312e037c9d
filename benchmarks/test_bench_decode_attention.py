"""CPU decode attention: every CPU implementation of ``neo.paged_decode_attention`` and torch's
``scaled_dot_product_attention`` against the machine's read bandwidth, measured in one run.

Shapes: 32 query heads, 8 KV heads, head_dim 128, block size 16, shuffled block tables, over
(num_seqs, context_len) points with >= 64K context tokens per call and short points the size of
one layer's host attention in a small host batch (the batches that can hide under one sub-batch's
GPU work in the engine's pipeline); bf16 and fp16. Each result records the GB/s of K and V bytes read and its share of the ceiling (a float32
torch.sum over 1 GiB with all threads) in ``benchmark.extra_info``; a compact table is printed at
the end of the session (benchmarks/conftest.py).

K/V live in 2 MiB-aligned memory advised to use transparent huge pages (``neo.host_memory.huge_page_zeros``, as the engine's host KV pool),
the way a host KV cache should be allocated: blocks are scattered, so with 4 KiB pages nearly
every block costs a TLB miss. ``ispc/torch-alloc`` repeats the ISPC kernel on K/V from plain
``torch.empty`` (4 KiB pages, 64 bytes past a page boundary) to show what that costs.

SDPA reads the same K/V, stored contiguously as [num_seqs, num_kv_heads, context_len, head_dim]
with one query token: ``sdpa`` calls it with ``enable_gqa=True``; ``sdpa-grouped`` passes each KV
group's query heads as query rows against their KV head (the same result; the faster way to
call stock torch for decode).

Run: pytest benchmarks/test_bench_decode_attention.py --benchmark-only
"""

import math
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import neo.ops
from neo.kv.host_memory import huge_page_zeros

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# (num_seqs, context_len)
POINTS = [(64, 1024), (16, 4096), (8, 256), (1, 256), (8, 768)]
DTYPES = (torch.bfloat16, torch.float16)
# Rounds are chosen so that one benchmark takes about this long (within the bounds below).
TARGET_SECONDS = 1.5
MIN_ROUNDS, MAX_ROUNDS = 3, 50


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    copy = huge_page_zeros(tensor.shape, tensor.dtype)
    copy.copy_(tensor)
    return copy


@dataclass
class DecodeCase:
    """Inputs of one (num_seqs, context_len, dtype) point."""

    q: torch.Tensor            # [num_seqs, NUM_HEADS, HEAD_DIM]
    k_cache: torch.Tensor      # [num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [num_seqs, blocks_per_seq], a permutation of the blocks
    seq_lens: torch.Tensor     # int32 [num_seqs]
    scale: float

    @property
    def shape(self) -> str:
        return f"{self.q.shape[0]}x{int(self.seq_lens[0])}"

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the call reads."""
        tokens = int(self.seq_lens.sum())
        return 2 * tokens * NUM_KV_HEADS * HEAD_DIM * self.k_cache.element_size()

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as [num_seqs, NUM_KV_HEADS, context_len, HEAD_DIM] (what SDPA reads)."""
        num_seqs, context_len = self.q.shape[0], int(self.seq_lens[0])

        def gather(cache):
            blocks = cache[self.block_table.long()]  # [S, blocks_per_seq, KVH, BS, D]
            return in_huge_pages(blocks.transpose(1, 2).reshape(
                num_seqs, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :context_len])

        return gather(self.k_cache), gather(self.v_cache)

    def with_torch_allocated_caches(self) -> "DecodeCase":
        return DecodeCase(self.q, self.k_cache.clone(), self.v_cache.clone(), self.block_table,
                          self.seq_lens, self.scale)


def make_case(num_seqs: int, context_len: int, dtype: torch.dtype) -> DecodeCase:
    generator = torch.Generator().manual_seed(num_seqs * 100003 + context_len)
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    return DecodeCase(
        q=torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype),
        k_cache=in_huge_pages(torch.randn(cache_shape, generator=generator).to(dtype)),
        v_cache=in_huge_pages(torch.randn(cache_shape, generator=generator).to(dtype)),
        block_table=torch.randperm(num_blocks, generator=generator, dtype=torch.int32)
        .view(num_seqs, blocks_per_seq),
        seq_lens=torch.full((num_seqs,), context_len, dtype=torch.int32),
        scale=HEAD_DIM ** -0.5,
    )


@pytest.fixture(scope="module")
def decode_case():
    """``decode_case(num_seqs, context_len, dtype)``: the inputs, built once per module."""
    cases = {}

    def get(num_seqs, context_len, dtype):
        key = (num_seqs, context_len, dtype)
        if key not in cases:
            cases.clear()  # one point's caches at a time
            cases[key] = make_case(num_seqs, context_len, dtype)
        return cases[key]

    return get


def measure(benchmark, function) -> float:
    """Runs ``function`` under pytest-benchmark; returns the fastest round in seconds."""
    start = time.perf_counter()
    function()
    first = time.perf_counter() - start
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, math.ceil(TARGET_SECONDS / max(first, 1e-6))))
    benchmark.pedantic(function, rounds=rounds, warmup_rounds=1, iterations=1)
    return benchmark.stats.stats.min


def record(benchmark, benchmark_summary, name, case, seconds, kv_memory="huge pages") -> None:
    figures = benchmark_summary.add(name, case.shape, case.q.dtype, seconds, case.kv_bytes)
    benchmark.extra_info.update(implementation=name, shape=case.shape,
                                dtype=str(case.q.dtype), kv_bytes=case.kv_bytes,
                                kv_memory=kv_memory, threads=torch.get_num_threads(), **figures)


def time_paged_decode_attention(benchmark, implementation, case) -> float:
    out = torch.empty_like(case.q)
    function = implementation.function
    seconds = measure(benchmark, lambda: function(out, case.q, case.k_cache, case.v_cache,
                                                  case.block_table, case.seq_lens, case.scale))
    assert torch.isfinite(out).all(), f"{implementation.name} wrote non-finite values"
    return seconds


def implementation_params():
    params = []
    for implementation in neo.ops.implementations("paged_decode_attention", "cpu",
                                                  available_only=False):
        marks = [] if implementation.available else [
            pytest.mark.skip(reason=f"{implementation.name}: {implementation.note}")]
        params.append(pytest.param(implementation, marks=marks, id=implementation.name))
    return params


POINT_PARAMS = [pytest.param(point, id=f"{point[0]}x{point[1]}") for point in POINTS]
DTYPE_PARAMS = [pytest.param(dtype, id=str(dtype).removeprefix("torch.")) for dtype in DTYPES]


def test_read_bandwidth_probe(benchmark, benchmark_summary):
    """The ceiling itself, as a benchmark: float32 torch.sum over 1 GiB with all threads."""
    nbytes = benchmark_summary.probe_bytes
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    seconds = measure(benchmark, data.sum)
    figures = benchmark_summary.add("torch.sum probe", f"{nbytes >> 30} GiB", data.dtype,
                                    seconds, nbytes)
    benchmark.extra_info.update(implementation="torch.sum probe", bytes=nbytes,
                                threads=torch.get_num_threads(), **figures)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("point", POINT_PARAMS)
@pytest.mark.parametrize("implementation", implementation_params())
def test_paged_decode_attention(benchmark, benchmark_summary, decode_case, implementation, point,
                                dtype):
    case = decode_case(*point, dtype)
    seconds = time_paged_decode_attention(benchmark, implementation, case)
    record(benchmark, benchmark_summary, implementation.name, case, seconds)


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("point", POINT_PARAMS[:1])
@pytest.mark.parametrize("implementation", [
    param for param in implementation_params() if param.values[0].name == "ispc"])
def test_paged_decode_attention_torch_allocated_kv(benchmark, benchmark_summary, decode_case,
                                                   implementation, point, dtype):
    """The ISPC kernel on caches from plain torch allocations (4 KiB pages)."""
    case = decode_case(*point, dtype).with_torch_allocated_caches()
    seconds = time_paged_decode_attention(benchmark, implementation, case)
    record(benchmark, benchmark_summary, f"{implementation.name}/torch-alloc", case, seconds,
           kv_memory="torch allocation")


@pytest.mark.parametrize("dtype", DTYPE_PARAMS)
@pytest.mark.parametrize("point", POINT_PARAMS)
@pytest.mark.parametrize("variant", ["sdpa", "sdpa-grouped"])
def test_torch_sdpa(benchmark, benchmark_summary, decode_case, variant, point, dtype):
    case = decode_case(*point, dtype)
    keys, values = case.contiguous_kv()
    num_seqs = case.q.shape[0]
    if variant == "sdpa":
        query = case.q.unsqueeze(2)  # [S, H, 1, D]

        def function():
            return F.scaled_dot_product_attention(query, keys, values, scale=case.scale,
                                                  enable_gqa=True)
    else:
        query = case.q.view(num_seqs, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)

        def function():
            return F.scaled_dot_product_attention(query, keys, values, scale=case.scale)

    seconds = measure(benchmark, function)
    record(benchmark, benchmark_summary, variant, case, seconds)
