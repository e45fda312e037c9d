"""``KVCache`` swaps: every layer at once (``swap``, what a plan that replays a graph or has no
sub-batch runs) against layer by layer (``swap_layer``, the eager walk), on the CPU and, where
there is one, a GPU with the page-locked host pool; and the parallel zeroing that faults the
host pool in before it is page-locked, in transparent huge pages where the system offers them."""

import re
from pathlib import Path

import pytest
import torch

from conftest import cuda_skip_reason
from neo.kv.host_memory import HUGE_PAGE_BYTES, huge_page_zeros, zero_in_parallel
from neo.kv.kv_cache import CacheLayout, KVCache

DEVICES = [pytest.param(device, marks=[pytest.mark.skip(reason=cuda_skip_reason(device))]
                        if cuda_skip_reason(device) else [], id=device) for device in ("cpu", "cuda")]
# (gpu_block, host_block) rows with a run of three; then (host_block, gpu_block) rows, one of
# them into GPU block 0, which the swap-out reads first
OUT_PAIRS = [(0, 5), (1, 6), (2, 7), (8, 0)]
IN_PAIRS = [(3, 0), (4, 1), (9, 9)]


def swapped_pools(device: str, layer_by_layer: bool):
    """(initial GPU pool, initial host pool, GPU pool after, host pool after), all on the CPU."""
    layout = CacheLayout(num_layers=3, num_kv_heads=2, block_size=16, head_dim=64,
                         dtype=torch.bfloat16, num_gpu_blocks=10, num_host_blocks=12)
    cache = KVCache(layout, torch.device(device))
    try:
        generator = torch.Generator().manual_seed(1)
        gpu = torch.randn(cache.gpu.shape, generator=generator).to(layout.dtype)
        host = torch.randn(cache.host.shape, generator=generator).to(layout.dtype)
        cache.gpu.copy_(gpu)
        cache.host.copy_(host)
        out_pairs = torch.tensor(OUT_PAIRS, dtype=torch.int64)
        in_pairs = torch.tensor(IN_PAIRS, dtype=torch.int64)
        if layer_by_layer:
            for layer in range(layout.num_layers):
                cache.swap_layer(layer, out_pairs, in_pairs)
        else:
            cache.swap(out_pairs, in_pairs)
        if device == "cuda":
            torch.cuda.synchronize()
        return gpu, host, cache.gpu.cpu(), cache.host.clone()
    finally:
        cache.close()


@pytest.mark.parametrize("device", DEVICES)
def test_whole_pool_swap_moves_every_layer_of_each_block(device):
    gpu, host, gpu_after, host_after = swapped_pools(device, layer_by_layer=False)
    for gpu_block, host_block in OUT_PAIRS:
        assert torch.equal(host_after[:, :, host_block], gpu[:, :, gpu_block])
    for host_block, gpu_block in IN_PAIRS:
        assert torch.equal(gpu_after[:, :, gpu_block], host[:, :, host_block])
    kept_host = sorted(set(range(12)) - {host_block for _, host_block in OUT_PAIRS})
    kept_gpu = sorted(set(range(10)) - {gpu_block for _, gpu_block in IN_PAIRS})
    assert torch.equal(host_after[:, :, kept_host], host[:, :, kept_host])
    assert torch.equal(gpu_after[:, :, kept_gpu], gpu[:, :, kept_gpu])


@pytest.mark.parametrize("device", DEVICES)
def test_whole_pool_swap_equals_layer_by_layer_swaps(device):
    _, _, gpu_whole, host_whole = swapped_pools(device, layer_by_layer=False)
    _, _, gpu_layers, host_layers = swapped_pools(device, layer_by_layer=True)
    assert torch.equal(gpu_whole, gpu_layers) and torch.equal(host_whole, host_layers)


@pytest.mark.parametrize("num_bytes, threads", [(1, 4), (3 * HUGE_PAGE_BYTES + 12345, 2),
                                                (8 * HUGE_PAGE_BYTES, 3), (5 * HUGE_PAGE_BYTES, 16)])
def test_zero_in_parallel_zeroes_every_byte(num_bytes, threads):
    """Slices of whole 2 MiB ranges, one per thread, the last one short; more threads than
    ranges leaves the spare ones idle."""
    tensor = huge_page_zeros((num_bytes,), torch.uint8)
    tensor.fill_(7)
    zero_in_parallel(tensor, threads)
    assert not tensor.any()


def transparent_huge_page_mode() -> str | None:
    """The bracketed choice of /sys/kernel/mm/transparent_hugepage/enabled, None without it."""
    settings = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not settings.exists():
        return None
    match = re.search(r"\[(\w+)\]", settings.read_text())
    return match.group(1) if match else None


def huge_page_bytes_of(address: int) -> int:
    """``AnonHugePages`` of the mapping in /proc/self/smaps that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(transparent_huge_page_mode() not in ("always", "madvise"),
                    reason="this system offers no transparent huge pages")
def test_huge_page_zeros_are_backed_by_huge_pages():
    """The memory is a private anonymous mapping: a shared one (Python's default for anonymous
    ``mmap``) is shmem, which takes huge pages only under ``shmem_enabled`` and ignores the
    advice, so the host pool would stay in 4 KiB pages."""
    tensor = huge_page_zeros((16 * HUGE_PAGE_BYTES,), torch.uint8)
    zero_in_parallel(tensor, 4)
    assert huge_page_bytes_of(tensor.data_ptr()) >= 8 * HUGE_PAGE_BYTES
