"""Argument checks shared by the fake kernels and the Python implementations.

``check_*_args`` look at shapes, dtypes and devices only (no data reads), so fake kernels can
call them. ``check_*_values`` read metadata values (block ids, lengths) and so synchronize
with the device; only host-side implementations call them.
"""

import torch

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 128


def _require(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise ValueError(f"neo.{op}: {message}")


def check_cache_layout(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _require(k_cache.dim() == 4, op, f"k_cache must be [num_blocks, num_kv_heads, block_size, "
             f"head_dim], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, op, f"v_cache shape {tuple(v_cache.shape)} differs "
             f"from k_cache shape {tuple(k_cache.shape)}")
    _require(v_cache.dtype == k_cache.dtype, op, f"v_cache dtype {v_cache.dtype} differs from "
             f"k_cache dtype {k_cache.dtype}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), op,
             "k_cache and v_cache must be contiguous")
    block_size = k_cache.shape[2]
    _require(MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0,
             op, f"block_size must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}, "
             f"got {block_size}")
    head_dim = k_cache.shape[3]
    _require(head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM, op,
             f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}, got {head_dim}")


def check_paged_decode_attention_args(out, q, k_cache, v_cache, block_table, seq_lens) -> None:
    op = "paged_decode_attention"
    check_cache_layout(op, k_cache, v_cache)
    _require(q.dtype in ATTENTION_DTYPES, op,
             f"q dtype must be float32, float16 or bfloat16, got {q.dtype}")
    _require(q.dtype == k_cache.dtype == out.dtype, op,
             f"q, caches and out must share one dtype, got q {q.dtype}, cache {k_cache.dtype}, "
             f"out {out.dtype}")
    _require(q.dim() == 3, op, f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    _require(out.shape == q.shape, op, f"out shape {tuple(out.shape)} differs from q shape "
             f"{tuple(q.shape)}")
    _require(q.is_contiguous() and out.is_contiguous(), op, "q and out must be contiguous")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    _require(head_dim == k_cache.shape[3], op, f"q head_dim {head_dim} differs from the cache's "
             f"{k_cache.shape[3]}")
    _require(num_heads % num_kv_heads == 0, op, f"num_heads {num_heads} is not a multiple of "
             f"num_kv_heads {num_kv_heads}")
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2, op,
             f"block_table must be int32 [num_seqs, max_blocks_per_seq], got {block_table.dtype} "
             f"{tuple(block_table.shape)}")
    _require(seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,), op,
             f"seq_lens must be int32 [{num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    _require(block_table.shape[0] == num_seqs, op, f"block_table has {block_table.shape[0]} rows "
             f"for {num_seqs} sequences")
    for name, tensor in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out),
                         ("block_table", block_table), ("seq_lens", seq_lens)):
        _require(tensor.device == q.device, op, f"{name} is on {tensor.device}, q on {q.device}")


def check_paged_decode_attention_values(k_cache, block_table, seq_lens) -> None:
    """Reads ``seq_lens`` and the used part of ``block_table``: a host sync on GPU tensors."""
    op = "paged_decode_attention"
    if seq_lens.numel() == 0:
        return
    block_size = k_cache.shape[2]
    lengths = seq_lens.to("cpu", torch.int64)
    _require(bool((lengths >= 1).all()), op, f"every seq_len must be >= 1, got min "
             f"{int(lengths.min())}")
    blocks_needed = (lengths + block_size - 1) // block_size
    max_blocks = block_table.shape[1]
    worst = int(blocks_needed.argmax())
    _require(int(blocks_needed[worst]) <= max_blocks, op,
             f"seq_len {int(lengths[worst])} of sequence {worst} needs {int(blocks_needed[worst])} "
             f"blocks but block_table has {max_blocks} columns")
    table = block_table.to("cpu", torch.int64)
    used = torch.arange(max_blocks).unsqueeze(0) < blocks_needed.unsqueeze(1)
    bad = used & ((table < 0) | (table >= k_cache.shape[0]))
    if bool(bad.any()):
        seq, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"neo.{op}: block id {int(table[seq, column])} at block_table[{seq}, "
                         f"{column}] is outside the cache's {k_cache.shape[0]} blocks")


def check_store_kv_cache_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    op = "store_kv_cache"
    check_cache_layout(op, k_cache, v_cache)
    _require(key.dim() == 3 and key.shape == value.shape, op,
             f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
             f"{tuple(key.shape)} and {tuple(value.shape)}")
    _require(key.shape[1:] == (k_cache.shape[1], k_cache.shape[3]), op,
             f"key [*, {key.shape[1]}, {key.shape[2]}] does not match the cache's "
             f"num_kv_heads {k_cache.shape[1]} and head_dim {k_cache.shape[3]}")
    _require(key.dtype == value.dtype == k_cache.dtype, op,
             f"key, value and caches must share one dtype, got {key.dtype}, {value.dtype}, "
             f"{k_cache.dtype}")
    _require(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (key.shape[0],), op,
             f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} "
             f"{tuple(slot_mapping.shape)}")
    for name, tensor in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
                         ("slot_mapping", slot_mapping)):
        _require(tensor.device == key.device, op,
                 f"{name} is on {tensor.device}, key on {key.device}")


def check_store_kv_cache_values(k_cache, slot_mapping) -> None:
    """Reads ``slot_mapping``: a host sync on GPU tensors."""
    num_slots = k_cache.shape[0] * k_cache.shape[2]
    slots = slot_mapping.to("cpu")
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"neo.store_kv_cache: slot {int(slots[index])} of token {index} is "
                         f"outside the cache's {num_slots} slots")


def check_swap_blocks_args(src, dst, block_mapping) -> None:
    op = "swap_blocks"
    _require(src.shape[1:] == dst.shape[1:] and src.dtype == dst.dtype, op,
             f"src {src.dtype} {tuple(src.shape)} and dst {dst.dtype} {tuple(dst.shape)} must "
             f"share dtype and block shape")
    _require(src.is_contiguous() and dst.is_contiguous(), op, "src and dst must be contiguous")
    _require(block_mapping.dtype == torch.int64 and block_mapping.dim() == 2
             and block_mapping.shape[1] == 2, op,
             f"block_mapping must be int64 [n, 2], got {block_mapping.dtype} "
             f"{tuple(block_mapping.shape)}")
    _require(block_mapping.device.type == "cpu", op, "block_mapping must be a CPU tensor")


def check_swap_blocks_values(src, dst, block_mapping) -> None:
    if block_mapping.numel() == 0:
        return
    for column, tensor, name in ((0, src, "src"), (1, dst, "dst")):
        ids = block_mapping[:, column]
        bad = (ids < 0) | (ids >= tensor.shape[0])
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"neo.swap_blocks: {name} block {int(ids[row])} in row {row} is "
                             f"outside the {tensor.shape[0]} blocks of {name}")


def check_prefill_attention_args(out, q, k, v, cu_seqlens) -> None:
    op = "prefill_attention"
    _require(q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, op,
             f"q must be [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, "
             f"head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _require(out.shape == q.shape, op, f"out shape {tuple(out.shape)} differs from q "
             f"{tuple(q.shape)}")
    _require(q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], op,
             "q, k and v must share num_tokens and head_dim")
    _require(q.shape[1] % k.shape[1] == 0, op, f"num_heads {q.shape[1]} is not a multiple of "
             f"num_kv_heads {k.shape[1]}")
    _require(q.dtype == k.dtype == v.dtype == out.dtype, op, "q, k, v and out must share a dtype")
    _require(cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1,
             op, f"cu_seqlens must be int32 [num_seqs + 1], got {cu_seqlens.dtype} "
             f"{tuple(cu_seqlens.shape)}")


def check_rms_norm_args(op, input, weight, out=None) -> None:
    _require(input.dim() == 2 and weight.shape == (input.shape[1],), op,
             f"input must be [num_tokens, hidden] and weight [hidden], got {tuple(input.shape)} "
             f"and {tuple(weight.shape)}")
    if out is not None:
        _require(out.shape == input.shape and out.dtype == input.dtype, op,
                 f"out {out.dtype} {tuple(out.shape)} must match input {input.dtype} "
                 f"{tuple(input.shape)}")


def check_rotary_embedding_args(positions, query, key, cos_sin_cache) -> None:
    op = "rotary_embedding"
    _require(positions.dtype == torch.int64 and positions.dim() == 1, op,
             f"positions must be int64 [num_tokens], got {positions.dtype} "
             f"{tuple(positions.shape)}")
    _require(query.dim() == 3 and key.dim() == 3 and query.shape[0] == key.shape[0]
             == positions.shape[0], op,
             f"query [T, H, D] and key [T, KVH, D] must have T = {positions.shape[0]} tokens, got "
             f"{tuple(query.shape)} and {tuple(key.shape)}")
    _require(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] % 2 == 0
             and cos_sin_cache.shape[1] <= query.shape[2], op,
             f"cos_sin_cache must be [max_positions, rotary_dim] with an even rotary_dim <= "
             f"head_dim, got {tuple(cos_sin_cache.shape)}")
    _require(cos_sin_cache.dtype == torch.float32, op, "cos_sin_cache must be float32")


def check_silu_and_mul_args(out, input) -> None:
    op = "silu_and_mul"
    _require(input.dim() == 2 and input.shape[1] % 2 == 0, op,
             f"input must be [num_tokens, 2 * intermediate], got {tuple(input.shape)}")
    _require(out.shape == (input.shape[0], input.shape[1] // 2) and out.dtype == input.dtype, op,
             f"out must be {input.dtype} [{input.shape[0]}, {input.shape[1] // 2}], got "
             f"{out.dtype} {tuple(out.shape)}")
