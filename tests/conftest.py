"""Shared test helpers: implementations as parameters, seeded random data, paged KV caches,
output poisoning and tolerances by dtype.

Every test draws fresh random data: the seed of a test case is derived from the run's base seed
(``NEO_TEST_SEED``, random unless set; printed in the report header) and the case's id, so a
failure is replayed by running with the printed seed.
"""

import math
import os
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

import neo.ops

BASE_SEED = int(os.environ.get("NEO_TEST_SEED", random.SystemRandom().randrange(2**31)))

# Largest allowed |actual - expected|, relative to max |expected|, when comparing with a float64
# formula: a few roundings of the output dtype (float32 accumulations; fp16 has 11 significant
# bits, bf16 8).
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def pytest_report_header(config):
    return f"neo tests: NEO_TEST_SEED={BASE_SEED} (set it to replay this run's random data)"


@pytest.fixture
def seed(request) -> int:
    """A fresh seed for this test case: the run's base seed mixed with the case's id."""
    return zlib.crc32(f"{BASE_SEED}/{request.node.nodeid}".encode())


@pytest.fixture
def generator(seed) -> torch.Generator:
    """A CPU random generator seeded for this test case (draw on the CPU, then move)."""
    return torch.Generator().manual_seed(seed)


def cuda_skip_reason(device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    return None


def implementation_params(op: str, devices=("cpu", "cuda"), names=None):
    """``pytest.param(implementation, device)`` for every implementation of ``op`` x device.

    An unavailable implementation (a build that is missing) is a skip whose reason is the
    registry's note; a CUDA device is skipped only when CUDA is absent. ``names`` restricts the
    list to some implementations.
    """
    params = []
    for implementation in neo.ops.implementations(op, available_only=False):
        if names is not None and implementation.name not in names:
            continue
        for device in implementation.devices:
            if device not in devices:
                continue
            reason = cuda_skip_reason(device)
            if not implementation.available:
                reason = f"{implementation.name}: {implementation.note}"
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(pytest.param(implementation, device, marks=marks,
                                       id=f"{implementation.name}-{device}"))
    return params


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16, which the ISPC kernel's bf16_dot variant needs (Linux
    lists the flag once the OS saves the registers)."""
    with open("/proc/cpuinfo") as cpuinfo:
        return "avx512_bf16" in cpuinfo.read().split()


def cpu_vendor() -> str:
    """The CPU's vendor id as Linux reports it ("GenuineIntel", "AuthenticAMD")."""
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def random_tensor(shape, dtype, generator, device="cpu", scale=1.0) -> torch.Tensor:
    """Normal random values (drawn in float32 on the CPU), times ``scale``, as ``dtype``."""
    return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device)


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor`` with NaN (floats) or -12345 (integers) before an op writes it."""
    return tensor.fill_(float("nan") if tensor.is_floating_point() else -12345)


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    return poison(torch.empty_like(tensor))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 what: str = "output", tolerance: float | None = None,
                 absolute: float = 0.0) -> None:
    """``|actual - expected| <= tolerance * max|expected| + absolute`` everywhere (no NaN).

    ``tolerance`` defaults to ``TOLERANCES[dtype]``; ``absolute`` allows for outputs that are
    subnormal in ``dtype`` (whose spacing is fixed, not relative).
    """
    tolerance = TOLERANCES[dtype] if tolerance is None else tolerance
    actual = actual.detach().to("cpu", torch.float64)
    expected = expected.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not expected.isnan().any(), f"{what}: the expected values contain NaN"
    bad = actual.isnan() | actual.isinf()
    assert not bad.any(), f"{what}: {int(bad.sum())} of {actual.numel()} values are NaN/inf, " \
                          f"first at {tuple(bad.nonzero()[0].tolist())}"
    if expected.numel() == 0:
        return
    scale = max(float(expected.abs().max()), 1e-6)
    error = (actual - expected).abs()
    worst = tuple(int(i) for i in torch.unravel_index(error.argmax(), error.shape))
    assert float(error[worst]) <= tolerance * scale + absolute, (
        f"{what}: max |error| {float(error[worst]):.3g} at {worst} (got {float(actual[worst]):.6g},"
        f" expected {float(expected[worst]):.6g}) > {tolerance:g} x max|expected| {scale:.3g}"
        f" + {absolute:.3g}")


@dataclass
class PagedKV:
    """A random paged KV cache of one layer for a batch of sequences.

    ``k_cache``, ``v_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]``; every slot
    that holds no token of a sequence (the tail of a sequence's last block, spare blocks) is NaN.
    ``block_table``: int32 ``[num_seqs, max_blocks]``, a random permutation of the blocks; entries
    past a sequence's last block hold ids outside the cache (-1, huge) that must not be read.
    ``seq_lens``: int32 ``[num_seqs]``.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    def to(self, device) -> "PagedKV":
        return PagedKV(*(tensor.to(device) for tensor in
                         (self.k_cache, self.v_cache, self.block_table, self.seq_lens)))


UNUSED_BLOCK_IDS = (-1, 2**31 - 1, -(2**31), 1 << 20)


def random_paged_kv(seq_lens, num_kv_heads: int, block_size: int, head_dim: int,
                    dtype: torch.dtype, generator: torch.Generator, device="cpu",
                    spare_blocks: int = 3, spare_columns: int = 2) -> PagedKV:
    """A ``PagedKV`` for sequences of ``seq_lens`` tokens (see ``PagedKV``)."""
    blocks_per_seq = [math.ceil(length / block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    max_blocks = max(blocks_per_seq, default=0) + spare_columns
    garbage = torch.tensor(UNUSED_BLOCK_IDS, dtype=torch.int32)
    block_table = garbage[torch.randint(len(UNUSED_BLOCK_IDS), (len(seq_lens), max_blocks),
                                        generator=generator)]
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    used = 0
    for row, (length, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        blocks = order[used:used + count]
        used += count
        block_table[row, :count] = blocks
        for cache in (k_cache, v_cache):
            tokens = random_tensor((count, num_kv_heads, block_size, head_dim), dtype, generator)
            tokens[-1, :, length - (count - 1) * block_size:] = float("nan")
            cache[blocks.long()] = tokens
    return PagedKV(k_cache, v_cache, block_table,
                   torch.tensor(list(seq_lens), dtype=torch.int32)).to(device)


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    seq: int) -> torch.Tensor:
    """The ``[seq_len, num_kv_heads, head_dim]`` tokens of sequence ``seq`` from a paged cache."""
    block_size = cache.shape[2]
    tokens = torch.arange(int(seq_lens[seq]))
    blocks = block_table[seq].cpu().long()[tokens // block_size]
    return cache.cpu()[blocks, :, tokens % block_size]
