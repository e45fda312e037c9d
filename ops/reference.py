"""Pure-torch reference implementations of every ``torch.ops.neo`` operator.

They run on any device with nothing built, accumulate in float32, and are the oracle the
tests compare every other implementation against. Clarity over speed: several of them read
metadata on the host.
"""

import torch
import torch.nn.functional as F

from . import checks


def paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale):
    """One decode query per sequence against its paged K/V (shapes in ``schemas``)."""
    checks.check_paged_decode_attention_args(out, q, k_cache, v_cache, block_table, seq_lens,
                                             scale)
    checks.check_paged_decode_attention_values(k_cache, block_table, seq_lens)
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    lengths = seq_lens.long()
    num_blocks = int((lengths.max() + block_size - 1) // block_size)
    blocks = block_table[:, :num_blocks].long().clamp(0, k_cache.shape[0] - 1)

    def gather(cache):  # -> [S, KVH, num_blocks * BS, D] float32
        paged = cache[blocks].float()  # [S, nb, KVH, BS, D]
        return paged.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, -1, head_dim)

    positions = torch.arange(num_blocks * block_size, device=q.device)
    beyond = (positions.view(1, 1, -1, 1) >= lengths.view(-1, 1, 1, 1))  # [S, 1, t, 1]
    # Slots past a sequence's length may hold anything (even NaN): zero them before use.
    keys, values = (gather(cache).masked_fill(beyond, 0.0) for cache in (k_cache, v_cache))
    queries = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,sktd->skgt", queries, keys) * scale
    probabilities = scores.masked_fill(beyond.view(num_seqs, 1, 1, -1), float("-inf")).softmax(dim=-1)
    result = torch.einsum("skgt,sktd->skgd", probabilities, values)
    out.copy_(result.reshape(num_seqs, num_heads, head_dim))


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping):
    """Scatter each token's K/V into its cache slot; slot -1 is skipped."""
    checks.check_store_kv_cache_args(key, value, k_cache, v_cache, slot_mapping)
    checks.check_store_kv_cache_values(k_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key[keep]
    v_cache[blocks, :, offsets] = value[keep]


def swap_blocks(src, dst, block_mapping):
    """``dst[dst_block] = src[src_block]`` for each mapping row; devices may differ."""
    checks.check_swap_blocks_args(src, dst, block_mapping)
    checks.check_swap_blocks_values(src, dst, block_mapping)
    if block_mapping.numel() == 0:
        return
    source_ids = block_mapping[:, 0].to(src.device)
    destination_ids = block_mapping[:, 1].to(dst.device)
    dst.index_copy_(0, destination_ids, src.index_select(0, source_ids).to(dst.device))


def prefill_attention(out, q, k, v, cu_seqlens, max_seqlen, scale):
    """Causal self-attention within each packed prompt."""
    checks.check_prefill_attention_args(out, q, k, v, cu_seqlens, max_seqlen, scale)
    checks.check_prefill_attention_values(q, cu_seqlens, max_seqlen)
    bounds = cu_seqlens.tolist()
    group = q.shape[1] // k.shape[1]
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        queries = q[start:end].float().transpose(0, 1)  # [H, L, D]
        keys = k[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)
        values = v[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)
        result = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
        out[start:end] = result.transpose(0, 1).to(out.dtype)


def _rms_normalize(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    x = x.float()
    normalized = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return weight * normalized.to(weight.dtype)


def rms_norm(out, input, weight, epsilon):
    """``out = weight * input / rms(input)``, computed in float32 like Hugging Face's Llama."""
    checks.check_rms_norm_args("rms_norm", input, weight, epsilon, out, "out")
    out.copy_(_rms_normalize(input, weight, epsilon))


def fused_add_rms_norm(input, residual, weight, epsilon):
    """``residual += input``; ``input = rms_norm(residual)``."""
    checks.check_rms_norm_args("fused_add_rms_norm", input, weight, epsilon, residual, "residual")
    residual.add_(input)
    input.copy_(_rms_normalize(residual, weight, epsilon))


def rotary_embedding(positions, query, key, cos_sin_cache):
    """Rotate the first ``rotary_dim`` features of each head (GPT-NeoX halves) in place."""
    checks.check_rotary_embedding_args(positions, query, key, cos_sin_cache)
    checks.check_rotary_embedding_values(positions, cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim / 2]
    for tensor in (query, key):
        rotated = tensor[..., :rotary_dim]
        first, second = rotated.float().chunk(2, dim=-1)
        cos_t, sin_t = cos.to(tensor.dtype).float(), sin.to(tensor.dtype).float()
        result = torch.cat((first * cos_t - second * sin_t, second * cos_t + first * sin_t), -1)
        rotated.copy_(result)


def silu_and_mul(out, input):
    """``out = silu(gate) * up`` with ``input = [gate | up]``."""
    checks.check_silu_and_mul_args(out, input)
    gate, up = input.chunk(2, dim=-1)
    out.copy_(F.silu(gate.float()) * up.float())


IMPLEMENTATIONS = {
    "paged_decode_attention": paged_decode_attention,
    "store_kv_cache": store_kv_cache,
    "swap_blocks": swap_blocks,
    "prefill_attention": prefill_attention,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "silu_and_mul": silu_and_mul,
}
