"""The host-memory pre-check: what it counts on each compute device, and what it says when the
allocations do not fit."""

import pytest
import torch

from neo.engine.host_memory_check import available_host_bytes, check_host_memory, weight_bytes
from neo.kv.kv_cache import GIB
from neo.models.causal_lm import count_parameters
from neo.models.loader import resolve_model_config
from neo.models.tiny import tiny_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   2000000 kB\n")
    assert available_host_bytes(str(meminfo)) == 2000000 * 1024
    meminfo.write_text("MemTotal:       32000000 kB\n")
    assert available_host_bytes(str(meminfo)) is None
    assert available_host_bytes(str(tmp_path / "absent")) is None
    assert available_host_bytes() > 0


def test_neo_tiny_fits_this_machine():
    check_host_memory("neo-tiny", tiny_config(), torch.float32, CPU, GIB, 4 * GIB, available_host_bytes())


def test_the_cpu_counts_weights_and_both_pools_a_gpu_only_the_host_pool():
    config = resolve_model_config("llama-3.1-8b")
    weights = weight_bytes(config, torch.bfloat16)
    assert weights == count_parameters(config) * 2
    check_host_memory("llama-3.1-8b", config, torch.bfloat16, CPU, GIB, GIB, weights + 2 * GIB)
    with pytest.raises(ValueError, match=r"^model 'llama-3.1-8b' on cpu needs 16\.96 GiB of host memory \(weights "
                                         r"\(bfloat16\) 14\.96 GiB, compute KV pool \(gpu_kv_cache_gib\) 1\.00 GiB, "
                                         r"host KV pool \(cpu_kv_cache_gib\) 1\.00 GiB\) but 15\.96 GiB are available: "
                                         r"use a smaller model, or lower gpu_kv_cache_gib and cpu_kv_cache_gib$"):
        check_host_memory("llama-3.1-8b", config, torch.bfloat16, CPU, GIB, GIB, weights + GIB)
    check_host_memory("llama-3.1-8b", config, torch.bfloat16, CUDA, 0, GIB, GIB)
    with pytest.raises(ValueError, match=r"host KV pool \(cpu_kv_cache_gib\) 1\.00 GiB\) .*lower cpu_kv_cache_gib"):
        check_host_memory("llama-3.1-8b", config, torch.bfloat16, CUDA, 0, GIB, GIB - 1)


def test_tensor_parallel_ranks_count_their_pools_once_each_and_the_weights_once():
    config = resolve_model_config("llama-3.1-8b")
    check_host_memory("llama-3.1-8b", config, torch.bfloat16, CUDA, 0, GIB, 2 * GIB, ranks=2)
    with pytest.raises(ValueError, match=r"needs 2\.00 GiB of host memory \(host KV pool \(cpu_kv_cache_gib, 2 "
                                         r"ranks\) 2\.00 GiB\)"):
        check_host_memory("llama-3.1-8b", config, torch.bfloat16, CUDA, 0, GIB, 2 * GIB - 1, ranks=2)
    weights = weight_bytes(config, torch.bfloat16)
    check_host_memory("llama-3.1-8b", config, torch.bfloat16, CPU, GIB, GIB, weights + 4 * GIB, ranks=2)
    with pytest.raises(ValueError, match=r"compute KV pool \(gpu_kv_cache_gib, 2 ranks\) 2\.00 GiB"):
        check_host_memory("llama-3.1-8b", config, torch.bfloat16, CPU, GIB, GIB, weights + 4 * GIB - 1, ranks=2)


def test_unknown_available_memory_checks_nothing():
    check_host_memory("llama-3.1-8b", resolve_model_config("llama-3.1-8b"), torch.float32, CPU, GIB, GIB, None)
