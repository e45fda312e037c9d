"""How much compute-device memory the KV pool gets."""

import logging

import torch

from neo.models.attention_metadata import AttentionMetadata
from neo.config import EngineConfig
from .kv_cache import GIB

logger = logging.getLogger(__name__)

CPU_DEVICE_DEFAULT_GIB = 1.0


def gpu_kv_cache_bytes(config: EngineConfig, model, device: torch.device, max_model_len: int) -> int:
    """``gpu_kv_cache_gib`` when set; otherwise, on CUDA, what is left of
    ``gpu_memory_utilization`` of the device after the weights and the activation peak of the
    largest batch (measured by running one); on a CPU device, 1 GiB."""
    if device.type != "cuda":
        return int((config.gpu_kv_cache_gib or CPU_DEVICE_DEFAULT_GIB) * GIB)
    activation_bytes = _activation_peak_bytes(model, config, device, max_model_len)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return device_pool_bytes(config, free, total, activation_bytes)


def device_pool_bytes(config: EngineConfig, free: float, total: float, activation_bytes: float) -> int:
    """The device KV pool's bytes from the device's ``free`` bytes after the weights, its
    ``total`` and the activation peak: ``gpu_kv_cache_gib`` when set (a ``ValueError`` when it
    does not fit beside the activations), else what ``gpu_memory_utilization`` of the device
    leaves (a ``ValueError`` when nothing is left). The engine and the simulator both size
    the pool here."""
    usable = int(free - (1 - config.gpu_memory_utilization) * total - activation_bytes)
    if config.gpu_kv_cache_gib is not None:
        wanted = int(config.gpu_kv_cache_gib * GIB)
        if wanted > free - activation_bytes:
            raise ValueError(f"gpu_kv_cache_gib={config.gpu_kv_cache_gib} does not fit: "
                             f"{free / GIB:.1f} GiB are free after the weights and "
                             f"{activation_bytes / GIB:.1f} GiB are needed for activations")
        return wanted
    logger.info("device memory: %.2f GiB free of %.2f GiB after the weights, activation peak %.2f GiB, "
                "utilization %.2f: %.2f GiB for the KV pool", free / GIB, total / GIB, activation_bytes / GIB,
                config.gpu_memory_utilization, max(usable, 0) / GIB)
    if usable <= 0:
        raise ValueError(f"no device memory is left for the KV cache: {free / GIB:.1f} GiB free, "
                         f"activations need {activation_bytes / GIB:.1f} GiB; lower "
                         f"max_num_batched_tokens or raise gpu_memory_utilization")
    return usable


@torch.inference_mode()
def _activation_peak_bytes(model, config: EngineConfig, device: torch.device, max_model_len: int) -> int:
    """Peak extra memory of a prefill of ``max_num_batched_tokens`` tokens (no KV stored)."""
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    prefill_probe(model, config, device, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    logger.info("activation peak for %d tokens: %.2f GiB", config.max_num_batched_tokens, peak / GIB)
    return peak


@torch.inference_mode()
def prefill_probe(model, config: EngineConfig, device: torch.device, max_model_len: int) -> None:
    """Run the largest prefill an iteration can hold (``max_num_batched_tokens`` tokens in
    sequences of at most ``max_model_len``) and its last rows' logits on random token ids,
    storing no KV: the caches it is given hold no block, shaped as this rank's (its KV heads)."""
    model_config = model.config
    num_tokens = config.max_num_batched_tokens
    sequence_length = min(num_tokens, max_model_len)
    lengths = [sequence_length] * (num_tokens // sequence_length)
    if num_tokens % sequence_length:
        lengths.append(num_tokens % sequence_length)
    cu_seqlens = [0]
    for length in lengths:
        cu_seqlens.append(cu_seqlens[-1] + length)
    positions = torch.cat([torch.arange(length) for length in lengths]).to(device)
    empty_cache = torch.empty((0, model.rank_config.num_kv_heads, config.block_size, model_config.head_dim),
                              dtype=next(model.parameters()).dtype, device=device)
    empty_table = torch.empty((0, 0), dtype=torch.int32, device=device)
    no_slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    metadata = AttentionMetadata(
        num_prefill_tokens=num_tokens, num_gpu_decodes=0, num_host_decodes=0, positions=positions,
        slot_mapping=no_slots, prefill_cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
        max_prefill_len=max(lengths), gpu_block_table=empty_table,
        gpu_seq_lens=torch.empty(0, dtype=torch.int32, device=device),
        host_block_table=torch.empty((0, 0), dtype=torch.int32),
        host_seq_lens=torch.empty(0, dtype=torch.int32),
        host_slot_mapping=torch.empty(0, dtype=torch.int64),
        num_offloaded_prefill_tokens=0,
        prefill_host_slot_mapping=torch.empty(0, dtype=torch.int64, device=device))
    input_ids = torch.randint(0, model_config.vocab_size, (num_tokens,), device=device)
    hidden = model.forward(input_ids, metadata, [(empty_cache, empty_cache)] * model_config.num_layers)
    model.compute_logits(hidden[-min(num_tokens, config.max_num_seqs):])
