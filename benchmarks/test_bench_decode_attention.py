"""CPU decode attention: every CPU implementation of ``neo.paged_decode_attention`` and torch's
``scaled_dot_product_attention`` against the machine's read bandwidth from DRAM, measured in one
run, on all cores and on all but one.

Shapes: 32 query heads, 8 KV heads, head_dim 128, block size 16, shuffled block tables, over
(num_seqs, context_len) points with >= 64K context tokens per call and short points the size of
one layer's host attention in a small host batch (the batches that can hide under one sub-batch's
GPU work in the engine's pipeline); bf16 and fp16.

From DRAM: K and V are slices of one working set of ``--kv-working-set-gib`` GiB (benchmarks/
conftest.py: at least four times the last-level cache), read as a ring: each call reads the next
slice, and each benchmark continues where the previous one stopped, so every slice read is the
one read least recently, long evicted from the caches. Each result records the GB/s of K and V
bytes read and its share of the read probe (a float32 torch.sum that reads a buffer of the same
size in the same rotation), timed right after it at the same thread count, in
``benchmark.extra_info``; a compact table is printed at the end of the session, with each other
kernel's time also as a multiple of ISPC's at the same point.

In cache: the small host-batch points again, with one K/V set read on every call, as a host
batch's attention reads a layer's K/V that it may have touched recently. These rows are
labelled as such: part of the bytes come from the last-level cache.

Thread scaling: one long point from DRAM and, in cache, one sequence per thread, at 1, 2, 4, 8,
all-but-one and all threads; the summary lists GB/s per thread. Where the rate from cache is no
higher than the rate from DRAM, the threads' own work bounds the kernel, not the memory.

K/V live in 2 MiB-aligned memory advised to use transparent huge pages
(``neo.kv.host_memory.huge_page_zeros``, as the engine's host KV pool), the way a host KV cache
should be allocated: blocks are scattered, so with 4 KiB pages nearly every block costs a TLB
miss. ``ispc/torch-alloc`` repeats the ISPC kernel on K/V from plain
torch allocations (a copy of the working set) to show what that costs.

SDPA reads the same working set as contiguous slices [num_seqs, num_kv_heads, context_len,
head_dim] with one query token: ``sdpa`` calls it with ``enable_gqa=True``; ``sdpa-grouped``
passes each KV group's query heads as query rows against their KV head (the same result; the
faster way to call stock torch for decode).

Run: pytest benchmarks/test_bench_decode_attention.py --benchmark-only
(``--kv-working-set-gib 2 --seconds-per-benchmark 0.5`` for a quick run on a small machine; the
defaults suit a host with tens of GiB).
"""

import contextlib
import math
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import neo.ops
from neo.kv.host_memory import huge_page_zeros

from conftest import DRAM, IN_CACHE, THREAD_COUNTS, require_memory
from read_probe import ReadProbe

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
# (num_seqs, context_len): >= 64K tokens per call
LONG_POINTS = [(16, 4096), (64, 1024), (256, 512)]
# one layer's attention of a small host batch
HOST_BATCH_POINTS = [(8, 256), (8, 768), (1, 256)]
# Thread scaling: this point from DRAM, and in cache one sequence of SCALING_CACHED_CONTEXT
# tokens per thread (2 MiB of 16-bit K/V each: about what one core's L2 holds).
SCALING_POINT = (64, 1024)
SCALING_CACHED_CONTEXT = 512
SCALING_THREADS = sorted({count for count in (1, 2, 4, 8, *THREAD_COUNTS) if count <= max(THREAD_COUNTS)})
DTYPES = (torch.bfloat16, torch.float16)
# Rounds are chosen so that one benchmark takes about --seconds-per-benchmark, within these bounds.
MIN_ROUNDS, MAX_ROUNDS = 3, 50
# Before them, after the first call, a benchmark warms up for at least this many calls and this
# share of its time.
WARMUP_CALLS, WARMUP_SHARE = 3, 0.1
# The working set is filled by tiling one random chunk of this many elements.
FILL_CHUNK_ELEMENTS = 1 << 22


def random_huge_page_buffer(num_elements: int, dtype: torch.dtype,
                            generator: torch.Generator) -> torch.Tensor:
    """A flat ``[num_elements]`` tensor in huge pages holding normal random values (one random
    chunk repeated: the values only need to be finite and varied)."""
    buffer = huge_page_zeros((num_elements,), dtype)
    chunk = torch.randn(min(num_elements, FILL_CHUNK_ELEMENTS), generator=generator).to(dtype)
    for start in range(0, num_elements, chunk.numel()):
        piece = buffer[start:start + chunk.numel()]
        piece.copy_(chunk[:piece.numel()])
    return buffer


@dataclass
class KVWorkingSet:
    """Flat K and V buffers ``[elements]`` that the benchmarks read slice by slice, as a ring.

    ``position`` is the element where the next read starts: each call continues where the last
    one stopped, including the first call of the next benchmark, whatever its slice size. The
    slice a call reads is then the one read least recently; starting every benchmark at the
    ring's start would read what the previous benchmark just read, still in the last-level cache.
    """

    k: torch.Tensor  # [elements]
    v: torch.Tensor  # [elements]
    position: int = 0

    @classmethod
    def allocate(cls, elements: int, dtype: torch.dtype, seed: int) -> "KVWorkingSet":
        generator = torch.Generator().manual_seed(seed)
        return cls(random_huge_page_buffer(elements, dtype, generator),
                   random_huge_page_buffer(elements, dtype, generator))

    def take_slice(self, slice_elements: int) -> int:
        """Index of the next slice of ``slice_elements`` to read (slices laid end to end from
        the start, as many as fit); moves the position past it."""
        num_slices = self.k.numel() // slice_elements
        index = -(-self.position // slice_elements) % num_slices
        self.position = (index + 1) * slice_elements
        return index

    def with_torch_allocated_copy(self) -> "KVWorkingSet":
        """A copy in plain torch allocations; its ring starts at its least recently written
        part, the start."""
        return KVWorkingSet(self.k.clone(), self.v.clone())


@dataclass
class DecodeCase:
    """Inputs of one (num_seqs, context_len, dtype) point over a working set's slices.

    Slice ``s`` is the blocks ``[s * n, (s + 1) * n)`` of the caches (``n`` blocks per call),
    shuffled; each call reads the slice the working set hands out next. A working set of one
    slice is read whole on every call.
    """

    q: torch.Tensor             # [num_seqs, NUM_HEADS, HEAD_DIM]
    working_set: KVWorkingSet
    k_cache: torch.Tensor       # [num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_slices, num_seqs, blocks_per_seq]
    seq_lens: torch.Tensor      # int32 [num_seqs]
    scale: float

    @property
    def shape(self) -> str:
        return f"{self.q.shape[0]}x{int(self.seq_lens[0])}"

    @property
    def num_slices(self) -> int:
        return self.block_tables.shape[0]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V one call reads."""
        tokens = int(self.seq_lens.sum())
        return 2 * tokens * NUM_KV_HEADS * HEAD_DIM * self.k_cache.element_size()

    def next_block_table(self) -> torch.Tensor:
        """int32 [num_seqs, blocks_per_seq]: the block table of the next slice."""
        slice_elements = self.block_tables[0].numel() * self.k_cache[0].numel()
        return self.block_tables[self.working_set.take_slice(slice_elements)]

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The working set as K and V slices ``[num_slices, num_seqs, NUM_KV_HEADS,
        context_len, HEAD_DIM]`` (what SDPA reads; the values differ from the paged view's)."""
        num_seqs, context_len = self.q.shape[0], int(self.seq_lens[0])
        shape = (num_seqs, NUM_KV_HEADS, context_len, HEAD_DIM)
        slice_elements = math.prod(shape)
        num_slices = self.working_set.k.numel() // slice_elements

        def view(flat):
            return flat[:num_slices * slice_elements].view(num_slices, *shape)

        return view(self.working_set.k), view(self.working_set.v)


def make_case(num_seqs: int, context_len: int, working_set: KVWorkingSet) -> DecodeCase:
    """The point over as many slices as the working set holds (at least one)."""
    generator = torch.Generator().manual_seed(num_seqs * 100003 + context_len)
    blocks_per_seq = math.ceil(context_len / BLOCK_SIZE)
    blocks_per_call = num_seqs * blocks_per_seq
    block_elements = NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM
    num_slices = working_set.k.numel() // (blocks_per_call * block_elements)
    if num_slices < 1:
        raise ValueError(f"{num_seqs}x{context_len} reads {blocks_per_call} blocks, the working "
                         f"set holds {working_set.k.numel() // block_elements}")
    num_blocks = num_slices * blocks_per_call
    cache_shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    shuffled = torch.rand(num_slices, blocks_per_call, generator=generator).argsort(dim=1)
    offsets = torch.arange(num_slices).unsqueeze(1) * blocks_per_call
    return DecodeCase(
        q=torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=generator)
        .to(working_set.k.dtype),
        working_set=working_set,
        k_cache=working_set.k[:num_blocks * block_elements].view(cache_shape),
        v_cache=working_set.v[:num_blocks * block_elements].view(cache_shape),
        block_tables=(shuffled + offsets).to(torch.int32)
        .view(num_slices, num_seqs, blocks_per_seq),
        seq_lens=torch.full((num_seqs,), context_len, dtype=torch.int32),
        scale=HEAD_DIM ** -0.5,
    )


def in_cache_case(num_seqs: int, context_len: int, dtype: torch.dtype) -> DecodeCase:
    """The point over one K/V set of exactly one call's size, read on every call."""
    elements = num_seqs * math.ceil(context_len / BLOCK_SIZE) * NUM_KV_HEADS * BLOCK_SIZE \
        * HEAD_DIM
    return make_case(num_seqs, context_len, KVWorkingSet.allocate(elements, dtype, seed=1))


@pytest.fixture(scope="module", params=DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def dtype(request):
    """The cache dtype; module-scoped so that tests run grouped by it (one working set alive)."""
    return request.param


@pytest.fixture(scope="module")
def kv_working_set(dtype, working_set_bytes) -> KVWorkingSet:
    """K and V of ``dtype``, half of the working set each, in huge pages."""
    require_memory(working_set_bytes, "the K/V working set")
    return KVWorkingSet.allocate(working_set_bytes // 2 // dtype.itemsize, dtype, seed=0)


def rotated_case(working_set: KVWorkingSet, point) -> DecodeCase:
    """The point over the working set's slices; skips if it holds fewer than two."""
    case = make_case(*point, working_set)
    if case.num_slices < 2:
        pytest.skip(f"{case.shape} reads {case.kv_bytes / (1 << 30):.2f} GiB per call: rotating "
                    f"needs a working set of at least twice that (--kv-working-set-gib)")
    return case


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op thread count set to ``count`` for the block, restored after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield count
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(params=THREAD_COUNTS, ids=lambda threads: f"{threads}threads")
def threads(request):
    """Runs the test on this many torch threads (all cores, and all but one)."""
    with torch_threads(request.param):
        yield request.param


@pytest.fixture
def measure(benchmark, seconds_per_benchmark):
    """``measure(function)`` warms ``function`` up, then runs it under pytest-benchmark for about
    ``seconds_per_benchmark``; returns the fastest round in seconds.

    The first call of a kernel in a process compiles or loads it, and the calls after it can
    stay slow for tens of milliseconds while thread pools settle (numba's, beside torch's threads
    still spinning after the probe). So the first call is followed by at least WARMUP_CALLS
    calls and WARMUP_SHARE of the benchmark's time, and the number of rounds follows from the
    last of them.
    """

    def run(function) -> float:
        function()
        calls, warmup_start = 0, time.perf_counter()
        while calls < WARMUP_CALLS or \
                time.perf_counter() - warmup_start < WARMUP_SHARE * seconds_per_benchmark:
            call_start = time.perf_counter()
            function()
            last = time.perf_counter() - call_start
            calls += 1
        rounds = max(MIN_ROUNDS, min(MAX_ROUNDS,
                                     math.ceil(seconds_per_benchmark / max(last, 1e-6))))
        benchmark.pedantic(function, rounds=rounds, iterations=1)
        return benchmark.stats.stats.min

    return run


def record(benchmark, benchmark_summary, source, name, case, seconds,
           kv_memory="huge pages") -> None:
    figures = benchmark_summary.add(source, name, case.shape, case.q.dtype, seconds,
                                    case.kv_bytes)
    benchmark.extra_info.update(implementation=name, shape=case.shape,
                                dtype=str(case.q.dtype), kv_bytes=case.kv_bytes,
                                kv_slices=case.num_slices, kv_memory=kv_memory,
                                threads=torch.get_num_threads(), **figures)


def time_paged_decode_attention(measure, implementation, case) -> float:
    """Times ``implementation`` on ``case``, each call on the next slice."""
    out = torch.empty_like(case.q)
    function = implementation.function

    def call_next_slice():
        function(out, case.q, case.k_cache, case.v_cache, case.next_block_table(), case.seq_lens,
                 case.scale)

    seconds = measure(call_next_slice)
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


def point_params(points):
    return [pytest.param(point, id=f"{point[0]}x{point[1]}") for point in points]


def test_read_bandwidth_probe(benchmark, measure, benchmark_summary, working_set_bytes,
                              threads):
    """The probe itself, as a benchmark: float32 torch.sum over the next slice of its buffer."""
    require_memory(working_set_bytes, "the read probe's rotated buffer")
    probe = ReadProbe.allocate(working_set_bytes)
    seconds = measure(probe.read_next)
    figures = benchmark_summary.add(DRAM, "torch.sum probe",
                                    f"{probe.slice_bytes / (1 << 30):.2f} GiB", torch.float32,
                                    seconds, probe.slice_bytes)
    benchmark.extra_info.update(implementation="torch.sum probe", bytes=probe.slice_bytes,
                                working_set_bytes=working_set_bytes, threads=threads, **figures)


@pytest.mark.parametrize("point", point_params(LONG_POINTS + HOST_BATCH_POINTS))
@pytest.mark.parametrize("implementation", implementation_params())
def test_paged_decode_attention(benchmark, measure, benchmark_summary, kv_working_set, threads,
                                implementation, point):
    case = rotated_case(kv_working_set, point)
    seconds = time_paged_decode_attention(measure, implementation, case)
    record(benchmark, benchmark_summary, DRAM, implementation.name, case, seconds)


@pytest.mark.parametrize("point", point_params(HOST_BATCH_POINTS))
@pytest.mark.parametrize("implementation", implementation_params())
def test_paged_decode_attention_in_cache(benchmark, measure, benchmark_summary, dtype, threads,
                                         implementation, point):
    """The same K/V on every call: what a kernel reaches when its data is partly cached."""
    case = in_cache_case(*point, dtype)
    seconds = time_paged_decode_attention(measure, implementation, case)
    record(benchmark, benchmark_summary, IN_CACHE, implementation.name, case, seconds)


@pytest.fixture(params=SCALING_THREADS, ids=lambda threads: f"{threads}threads")
def scaling_threads(request):
    """Runs the test on this many torch threads (1, 2, 4, 8, all cores but one, all)."""
    with torch_threads(request.param):
        yield request.param


@pytest.mark.parametrize("source", [DRAM, IN_CACHE])
@pytest.mark.parametrize("implementation", implementation_params())
def test_paged_decode_attention_thread_scaling(benchmark, measure, benchmark_summary,
                                               kv_working_set, dtype, scaling_threads,
                                               implementation, source):
    """What bounds a kernel at each thread count: where its rate from cache (a sequence of
    SCALING_CACHED_CONTEXT tokens per thread, read on every call) is no higher than its rate
    from DRAM (SCALING_POINT, rotated), each thread's own work bounds it, not the memory."""
    if source == DRAM:
        case = rotated_case(kv_working_set, SCALING_POINT)
    else:
        case = in_cache_case(scaling_threads, SCALING_CACHED_CONTEXT, dtype)
    seconds = time_paged_decode_attention(measure, implementation, case)
    record(benchmark, benchmark_summary, source, implementation.name, case, seconds)


@pytest.mark.parametrize("point", point_params(LONG_POINTS[:1]))
@pytest.mark.parametrize("implementation", [
    param for param in implementation_params() if param.values[0].name == "ispc"])
def test_paged_decode_attention_torch_allocated_kv(benchmark, measure, benchmark_summary,
                                                   kv_working_set, working_set_bytes, threads,
                                                   implementation, point):
    """The ISPC kernel on a copy of the working set in plain torch allocations (4 KiB pages)."""
    require_memory(working_set_bytes, "the torch-allocated copy of the K/V working set")
    case = rotated_case(kv_working_set.with_torch_allocated_copy(), point)
    seconds = time_paged_decode_attention(measure, implementation, case)
    record(benchmark, benchmark_summary, DRAM, f"{implementation.name}/torch-alloc", case,
           seconds, kv_memory="torch allocation")


@pytest.mark.parametrize("point", point_params(LONG_POINTS + HOST_BATCH_POINTS))
@pytest.mark.parametrize("variant", ["sdpa", "sdpa-grouped"])
def test_torch_sdpa(benchmark, measure, benchmark_summary, kv_working_set, threads, variant,
                    point):
    case = rotated_case(kv_working_set, point)
    key_slices, value_slices = case.contiguous_kv()
    num_seqs = case.q.shape[0]
    if variant == "sdpa":
        query = case.q.unsqueeze(2)  # [S, H, 1, D]
        options = {"enable_gqa": True}
    else:
        query = case.q.view(num_seqs, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
        options = {}

    def call_next_slice():
        index = case.working_set.take_slice(key_slices[0].numel())
        return F.scaled_dot_product_attention(query, key_slices[index], value_slices[index],
                                              scale=case.scale, **options)

    seconds = measure(call_next_slice)
    record(benchmark, benchmark_summary, DRAM, variant, case, seconds)
