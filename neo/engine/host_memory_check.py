"""Refuses an engine whose host-memory allocations cannot fit, before any of them is made.

The host holds the host KV pool, and on a CPU compute device also the weights and the compute
device's KV pool. Their sizes follow from the configs alone: the parameter count of the model
config (counted on the meta device) times the dtype's size, and the two pools' budgets. Their sum
is compared with the memory the kernel reports it can give without swapping
(``MemAvailable`` in ``/proc/meminfo``), so a model too large for the machine is a ``ValueError``
that says what to change, not an allocation that fails (or swaps) minutes into loading.
Activations and the rotary table are left out: the sum is a lower bound of what the engine
uses.
"""

import torch

from neo.kv.kv_cache import GIB
from neo.models.causal_lm import count_parameters
from neo.models.config import ModelConfig

MEMINFO_PATH = "/proc/meminfo"


def available_host_bytes(meminfo_path: str = MEMINFO_PATH) -> int | None:
    """``MemAvailable`` of ``meminfo_path`` in bytes; None where the file or the field is absent
    (a system other than Linux)."""
    try:
        with open(meminfo_path) as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                if name == "MemAvailable":
                    return int(value.split()[0]) * 1024  # the value is in kB
    except OSError:
        return None
    return None


def weight_bytes(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in ``dtype``."""
    return count_parameters(model_config) * dtype.itemsize


def check_host_memory(model: str, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                      compute_pool_bytes: int, host_pool_bytes: int, available_bytes: int | None,
                      ranks: int = 1) -> None:
    """Raise ``ValueError`` when the host allocations of an engine exceed ``available_bytes``:
    the host KV pool (``host_pool_bytes``), plus, when ``device`` is the CPU, the weights of
    ``model_config`` in ``dtype`` and the compute pool (``compute_pool_bytes``). An engine of
    ``ranks`` tensor-parallel ranks on this host holds the pools once per rank and the weights
    once (each rank its share). Nothing is checked when ``available_bytes`` is None."""
    if available_bytes is None:
        return
    per_rank = f", {ranks} ranks" if ranks > 1 else ""
    parts = {f"host KV pool (cpu_kv_cache_gib{per_rank})": ranks * host_pool_bytes}
    if device.type == "cpu":
        parts = {f"weights ({str(dtype).removeprefix('torch.')})": weight_bytes(model_config, dtype),
                 f"compute KV pool (gpu_kv_cache_gib{per_rank})": ranks * compute_pool_bytes, **parts}
    needed = sum(parts.values())
    if needed <= available_bytes:
        return
    listing = ", ".join(f"{name} {size / GIB:.2f} GiB" for name, size in parts.items())
    fixes = "lower cpu_kv_cache_gib"
    if device.type == "cpu":
        smaller_dtype = "dtype='bfloat16' (half the weights' bytes), " if dtype.itemsize > 2 else ""
        fixes = f"use a smaller model, {smaller_dtype}or lower gpu_kv_cache_gib and cpu_kv_cache_gib"
    raise ValueError(f"model {model!r} on {device} needs {needed / GIB:.2f} GiB of host memory "
                     f"({listing}) but {available_bytes / GIB:.2f} GiB are available: {fixes}")
