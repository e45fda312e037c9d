"""``CacheLayout`` (derived pool sizes) and ``KVCache`` (the cache tensors and their copies)."""

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .host_memory import huge_page_zeros, zero_in_parallel
from neo.models.config import ModelConfig
from neo.models.parallel import TensorParallel

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class CacheLayout:
    """Shape of both KV pools, computed once from the configs and the memory budgets."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    num_gpu_blocks: int
    num_host_blocks: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return self.block_bytes // self.block_size

    @classmethod
    def for_budgets(cls, model: ModelConfig, dtype: torch.dtype, block_size: int,
                    gpu_bytes: int, host_bytes: int) -> "CacheLayout":
        layout = cls(model.num_layers, model.num_kv_heads, block_size, model.head_dim, dtype, 0, 0)
        return cls(model.num_layers, model.num_kv_heads, block_size, model.head_dim, dtype,
                   num_gpu_blocks=gpu_bytes // layout.block_bytes,
                   num_host_blocks=host_bytes // layout.block_bytes)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)


def smallest_over_ranks(layout: CacheLayout, parallel: TensorParallel) -> CacheLayout:
    """``layout`` with each pool's block count the smallest any rank of ``parallel`` computed
    (``layout`` itself on one rank): the ranks share one block table per request, so every
    rank's pools must hold the same blocks."""
    if parallel.size == 1:
        return layout
    counts = torch.tensor([layout.num_gpu_blocks, layout.num_host_blocks], dtype=torch.int64)
    parallel.all_reduce(counts, op=dist.ReduceOp.MIN)
    return replace(layout, num_gpu_blocks=int(counts[0]), num_host_blocks=int(counts[1]))


def _pin(tensor: torch.Tensor) -> None:
    """Page-lock an existing host tensor (``cudaHostRegister``) so copies to and from it are
    asynchronous DMA. Unlike ``pin_memory=True`` this does not round the size up."""
    if tensor.numel() == 0:
        return
    result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister of the {tensor.numel() * tensor.element_size() / GIB:.1f} "
                           f"GiB host KV cache failed with error {int(result)}: lower "
                           f"cpu_kv_cache_gib or raise the locked-memory limit (ulimit -l)")


class _DeviceAddressedHostMemory:
    """Hands a page-locked host tensor to torch as a CUDA tensor over the same bytes
    (``__cuda_array_interface__``). Registered host memory is mapped for the device, at its host
    address where the device can use host pointers for registered memory
    (``cudaDevAttrCanUseHostPointerForRegisteredMem``; ``_device_addressed`` checks it), so
    kernels given this tensor read and write the host memory over PCIe."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # keeps the memory alive as long as the CUDA tensor over it
        self.__cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                         "data": (host.data_ptr(), False), "version": 2}


def _device_addressed(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` aliasing the page-locked contiguous host tensor ``host``."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    alias = torch.as_tensor(_DeviceAddressedHostMemory(host), device=device)
    if alias.device != device or alias.data_ptr() != host.data_ptr():
        raise RuntimeError(f"the page-locked host KV cache at {host.data_ptr():#x} is not addressable "
                           f"from {device} at that address (got a view on {alias.device} at "
                           f"{alias.data_ptr():#x})")
    return alias.view(host.dtype).view(host.shape)


def _allocate(pool: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool (unused slots then hold finite values), the host one in huge pages; a
    clear error when it does not fit."""
    try:
        if device.type == "cpu" and pool == "host":
            return huge_page_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, torch.OutOfMemoryError, OSError) as error:
        size = torch.Size(shape).numel() * dtype.itemsize / GIB
        setting = "gpu_kv_cache_gib" if pool == "GPU" else "cpu_kv_cache_gib"
        raise ValueError(f"the {pool} KV pool of {size:.1f} GiB cannot be allocated on {device} "
                         f"({error.__class__.__name__}); lower {setting}") from None


def _swap(gpu_blocks: torch.Tensor, host_blocks: torch.Tensor, gpu_to_host: torch.Tensor,
          host_to_gpu: torch.Tensor) -> None:
    """Copy the mapped blocks of two pool views with the block dimension first (see
    ``KVCache.swap_layer`` for the mappings)."""
    if gpu_to_host.numel():
        torch.ops.neo.swap_blocks(gpu_blocks, host_blocks, gpu_to_host)
    if host_to_gpu.numel():
        torch.ops.neo.swap_blocks(host_blocks, gpu_blocks, host_to_gpu)


class KVCache:
    """Per-layer K and V caches in both pools, ``[num_blocks, num_kv_heads, block_size, head_dim]``.

    The compute-device pool lives on ``device``; the host pool in host memory, page-locked when
    the compute device is a GPU so swaps and layer-wise copies run as asynchronous DMA.
    ``host_layers`` are the host pool's layers as CPU tensors (for the host CPU's kernels);
    ``host_layers_for_device`` the same memory as tensors of the compute device, which its
    kernels write directly (on a GPU: over PCIe, through the mapping of the page-locked pool).
    """

    def __init__(self, layout: CacheLayout, device: torch.device):
        self.layout = layout
        self.device = device
        self.gpu = _allocate("GPU", layout.pool_shape(layout.num_gpu_blocks), layout.dtype, device)
        self.host = _allocate("host", layout.pool_shape(layout.num_host_blocks), layout.dtype, torch.device("cpu"))
        if device.type == "cuda" and layout.num_host_blocks:
            logger.info("page-locking the %.1f GiB host KV cache", self.host.numel() * self.host.element_size() / GIB)
            zero_in_parallel(self.host)  # faults its pages in from every core before the pin
            _pin(self.host)
        self.gpu_layers = [(self.gpu[i, 0], self.gpu[i, 1]) for i in range(layout.num_layers)]
        self.host_layers = [(self.host[i, 0], self.host[i, 1]) for i in range(layout.num_layers)]
        host_for_device = self.host
        if device.type == "cuda" and layout.num_host_blocks:
            host_for_device = _device_addressed(self.host, device)
        self.host_layers_for_device = [(host_for_device[i, 0], host_for_device[i, 1]) for i in range(layout.num_layers)]

    def close(self) -> None:
        """Unpin the host pool (the tensors are freed when the last reference goes)."""
        if self.device.type == "cuda" and self.layout.num_host_blocks and self.host is not None:
            self.host_layers_for_device = None  # before the memory goes
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self.host = None

    def swap_layer(self, layer: int, gpu_to_host: torch.Tensor, host_to_gpu: torch.Tensor) -> None:
        """Copy whole blocks of one layer, K and V, between the pools.

        gpu_to_host: int64 ``[n, 2]`` host tensor of (gpu_block, host_block) rows.
        host_to_gpu: int64 ``[m, 2]`` host tensor of (host_block, gpu_block) rows.
        Runs on the caller's current stream.
        """
        _swap(self.gpu[layer].movedim(1, 0), self.host[layer].movedim(1, 0), gpu_to_host, host_to_gpu)

    def swap(self, gpu_to_host: torch.Tensor, host_to_gpu: torch.Tensor) -> None:
        """``swap_layer`` for every layer at once: each block of the mapping moves, all layers,
        K and V, in one pitched copy per run of consecutive blocks (the pools seen as
        ``[blocks, layers, 2, ...]``). Runs on the caller's current stream."""
        _swap(self.gpu.movedim(2, 0), self.host.movedim(2, 0), gpu_to_host, host_to_gpu)
