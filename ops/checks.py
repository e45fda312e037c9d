"""Argument checks shared by the fake kernels and the Python implementations.

``check_*_args`` look at shapes, dtypes, devices and scalar arguments only (no data reads), so
fake kernels can call them. ``check_*_values`` read tensor contents (block ids, lengths, slots,
prompt bounds, positions) and so copy them to the host; only host-side implementations call
them. A copy to the host is illegal while a CUDA graph is being captured, so the value checks
that can see CUDA tensors do nothing during a capture: the engine validates its metadata before
capturing, and a captured graph replays only that metadata.

Every error is a ValueError ``neo.<op>: ...`` that names the argument and the offending value
or bound. The native kernels mirror these checks (``ops_cpu/checks.cpp`` and the kernels there,
``ops_cuda/binding.cpp``), so every implementation refuses the same input; the CUDA kernels
check what needs no host sync and leave the value checks out.
"""

import math
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT32_MAX = torch.finfo(torch.float32).max
MAX_HEAD_DIM = 256
MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 128


def _require(condition: bool, op: str, message) -> None:
    """Raise ``ValueError("neo.<op>: <message>")`` unless ``condition``. ``message`` is a string
    or a function that makes one, called only when the check fails (formatting a message costs
    more than the check itself)."""
    if not condition:
        raise ValueError(f"neo.{op}: {message() if callable(message) else message}")


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is on CUDA while a CUDA graph is being captured (reading its data on
    the host would then break the capture)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_float_dtype(op: str, name: str, tensor: torch.Tensor) -> None:
    _require(tensor.dtype in FLOAT_DTYPES, op,
             lambda: f"{name} dtype must be float32, float16 or bfloat16, got {tensor.dtype}")


def _check_same_device(op: str, reference_name: str, reference: torch.Tensor,
                       tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        _require(tensor.device == reference.device, op,
                 lambda: f"{name} is on {tensor.device}, {reference_name} on {reference.device}")


def _check_float32_scalar(op: str, name: str, value: float) -> None:
    """``value`` is finite and representable in float32 (the kernels compute in float32)."""
    _require(math.isfinite(value) and abs(value) <= FLOAT32_MAX, op,
             lambda: f"{name} must be a finite float32 value, got {value}")


def check_cache_layout(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _require(k_cache.dim() == 4, op, lambda: f"k_cache must be [num_blocks, num_kv_heads, block_size, "
             f"head_dim], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, op, lambda: f"v_cache shape {tuple(v_cache.shape)} differs "
             f"from k_cache shape {tuple(k_cache.shape)}")
    _require(v_cache.dtype == k_cache.dtype, op, lambda: f"v_cache dtype {v_cache.dtype} differs from "
             f"k_cache dtype {k_cache.dtype}")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), op,
             "k_cache and v_cache must be contiguous")
    _require(k_cache.shape[1] >= 1, op,
             lambda: f"k_cache must have num_kv_heads >= 1, got {k_cache.shape[1]}")
    block_size = k_cache.shape[2]
    _require(MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0,
             op, lambda: f"block_size must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}, "
             f"got {block_size}")
    head_dim = k_cache.shape[3]
    _require(head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM, op,
             lambda: f"head_dim must be a multiple of 16 up to {MAX_HEAD_DIM}, got {head_dim}")


def _plainly_valid_paged_decode_attention_args(out, q, k_cache, v_cache, block_table, seq_lens,
                                               scale) -> bool:
    """Every condition of ``check_paged_decode_attention_args`` in one expression, without its
    messages: True only where the check passes (a condition added there must be added here).
    Arguments of the usual form are then accepted at a fraction of the check's cost, which
    matters to a kernel called per layer on a few small tensors."""
    q_shape, cache_shape, device = q.shape, k_cache.shape, q.device
    return (q.dtype in FLOAT_DTYPES and k_cache.dtype == v_cache.dtype == out.dtype == q.dtype
            and len(q_shape) == 3 and out.shape == q_shape
            and len(cache_shape) == 4 and v_cache.shape == cache_shape
            and MIN_BLOCK_SIZE <= cache_shape[2] <= MAX_BLOCK_SIZE and cache_shape[2] & (cache_shape[2] - 1) == 0
            and 0 < cache_shape[3] <= MAX_HEAD_DIM and cache_shape[3] % 16 == 0
            and q_shape[2] == cache_shape[3]
            and cache_shape[1] >= 1 and q_shape[1] >= 1 and q_shape[1] % cache_shape[1] == 0
            and block_table.dtype == seq_lens.dtype == torch.int32 and block_table.dim() == 2
            and block_table.shape[0] == q_shape[0] and seq_lens.shape == (q_shape[0],)
            and q.is_contiguous() and out.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.device == device and v_cache.device == device and out.device == device
            and block_table.device == device and seq_lens.device == device
            and -FLOAT32_MAX <= scale <= FLOAT32_MAX)


def check_paged_decode_attention_args(out, q, k_cache, v_cache, block_table, seq_lens,
                                      scale) -> None:
    if _plainly_valid_paged_decode_attention_args(out, q, k_cache, v_cache, block_table, seq_lens, scale):
        return
    op = "paged_decode_attention"
    check_cache_layout(op, k_cache, v_cache)
    _check_float_dtype(op, "q", q)
    _require(q.dtype == k_cache.dtype == out.dtype, op,
             lambda: f"q, caches and out must share one dtype, got q {q.dtype}, cache {k_cache.dtype}, "
             f"out {out.dtype}")
    _require(q.dim() == 3, op, lambda: f"q must be [num_seqs, num_heads, head_dim], got {tuple(q.shape)}")
    _require(out.shape == q.shape, op, lambda: f"out shape {tuple(out.shape)} differs from q shape "
             f"{tuple(q.shape)}")
    _require(q.is_contiguous() and out.is_contiguous(), op, "q and out must be contiguous")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    _require(head_dim == k_cache.shape[3], op, lambda: f"q head_dim {head_dim} differs from the cache's "
             f"{k_cache.shape[3]}")
    _require(num_heads >= 1, op, lambda: f"q must have num_heads >= 1, got {num_heads}")
    _require(num_heads % num_kv_heads == 0, op, lambda: f"num_heads {num_heads} is not a multiple of "
             f"num_kv_heads {num_kv_heads}")
    _require(block_table.dtype == torch.int32 and block_table.dim() == 2, op,
             lambda: f"block_table must be int32 [num_seqs, max_blocks_per_seq], got {block_table.dtype} "
             f"{tuple(block_table.shape)}")
    _require(seq_lens.dtype == torch.int32 and seq_lens.shape == (num_seqs,), op,
             lambda: f"seq_lens must be int32 [{num_seqs}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    _require(block_table.shape[0] == num_seqs, op, lambda: f"block_table has {block_table.shape[0]} rows "
             f"for {num_seqs} sequences")
    _check_same_device(op, "q", q, {"k_cache": k_cache, "v_cache": v_cache, "out": out,
                                    "block_table": block_table, "seq_lens": seq_lens})
    _check_float32_scalar(op, "scale", scale)


def check_paged_decode_attention_values(k_cache, block_table, seq_lens) -> None:
    """Reads ``seq_lens`` and the used part of ``block_table``: a host sync on GPU tensors,
    skipped while a CUDA graph is being captured."""
    op = "paged_decode_attention"
    if seq_lens.numel() == 0 or _capturing(seq_lens):
        return
    block_size = k_cache.shape[2]
    lengths = seq_lens.to("cpu", torch.int64)
    _require(bool((lengths >= 1).all()), op, lambda: f"every seq_len must be >= 1, got min "
             f"{int(lengths.min())}")
    blocks_needed = (lengths + block_size - 1) // block_size
    max_blocks = block_table.shape[1]
    worst = int(blocks_needed.argmax())
    _require(int(blocks_needed[worst]) <= max_blocks, op,
             lambda: f"seq_len {int(lengths[worst])} of sequence {worst} needs {int(blocks_needed[worst])} "
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
             lambda: f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
             f"{tuple(key.shape)} and {tuple(value.shape)}")
    _require(key.shape[1:] == (k_cache.shape[1], k_cache.shape[3]), op,
             lambda: f"key [*, {key.shape[1]}, {key.shape[2]}] does not match the cache's "
             f"num_kv_heads {k_cache.shape[1]} and head_dim {k_cache.shape[3]}")
    _check_float_dtype(op, "key", key)
    _require(key.dtype == value.dtype == k_cache.dtype, op,
             lambda: f"key, value and caches must share one dtype, got {key.dtype}, {value.dtype}, "
             f"{k_cache.dtype}")
    _require(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (key.shape[0],), op,
             lambda: f"slot_mapping must be int64 [{key.shape[0]}], got {slot_mapping.dtype} "
             f"{tuple(slot_mapping.shape)}")
    _check_same_device(op, "key", key, {"value": value, "k_cache": k_cache, "v_cache": v_cache,
                                        "slot_mapping": slot_mapping})


def check_store_kv_cache_values(k_cache, slot_mapping) -> None:
    """Reads ``slot_mapping``: every slot is -1 or in the cache, and no slot is given to two
    tokens (which token's K/V it kept would depend on the order the copies run in). A host
    sync on GPU tensors, skipped while a CUDA graph is being captured."""
    op = "store_kv_cache"
    if _capturing(slot_mapping):
        return
    num_slots = k_cache.shape[0] * k_cache.shape[2]
    slots = slot_mapping.to("cpu")
    bad = (slots < -1) | (slots >= num_slots)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"neo.{op}: slot {int(slots[index])} of token {index} is outside the "
                         f"cache's {num_slots} slots")
    first_token = {}
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            _require(slot not in first_token, op, lambda: f"slot {slot} of token {token} is also the "
                     f"slot of token {first_token.get(slot)}")
            first_token[slot] = token


@dataclass(frozen=True)
class BlockRows:
    """Where the blocks (dimension 0) of a ``swap_blocks`` tensor lie, in elements: block ``b``
    starts at ``b * block_stride`` and is ``rows`` rows of ``chunk`` contiguous elements,
    ``pitch`` apart. A contiguous tensor's block is one row; a whole pool
    ``[layers, 2, B, ...]`` with its block dimension moved first has one row per layer and K/V,
    so one pitched copy moves a block of every layer."""

    rows: int
    pitch: int
    chunk: int
    block_stride: int


def block_rows(tensor: torch.Tensor) -> BlockRows | None:
    """``tensor``'s ``BlockRows``: its trailing contiguous dimensions form the chunk, the other
    dimensions after the first collapse into rows at one pitch. None for any other layout, and
    where rows or blocks would overlap (the CUDA kernel computes the same)."""
    sizes, strides = tensor.shape, tensor.stride()
    block_stride = strides[0] if tensor.dim() else 1
    if tensor.numel() == 0:
        return BlockRows(1, 0, 0, block_stride)
    dim, chunk = tensor.dim() - 1, 1
    while dim >= 1 and (sizes[dim] == 1 or strides[dim] == chunk):
        chunk *= sizes[dim]
        dim -= 1
    rows, pitch, expected = 1, chunk, None  # expected: the stride that collapses the next dim
    for dim in range(dim, 0, -1):
        if sizes[dim] == 1:
            continue
        if expected is None:
            pitch = strides[dim]
        elif strides[dim] != expected:
            return None
        expected = strides[dim] * sizes[dim]
        rows *= sizes[dim]
    blocks = sizes[0]
    if blocks > 1 and block_stride < chunk:
        return None
    if rows > 1 and (pitch < chunk or (blocks - 1) * block_stride + chunk > pitch):
        return None
    return BlockRows(rows, pitch, chunk, block_stride)


def swap_blocks_rows(src: torch.Tensor, dst: torch.Tensor) -> tuple[BlockRows, BlockRows] | None:
    """The ``BlockRows`` of ``src`` and ``dst`` split into the same rows (a one-row block is
    re-read as rows of the other's chunk), or None when no such split exists."""
    src_rows, dst_rows = block_rows(src), block_rows(dst)
    if src_rows is None or dst_rows is None:
        return None
    if src_rows.rows != dst_rows.rows:
        if src_rows.rows == 1:
            src_rows = BlockRows(dst_rows.rows, dst_rows.chunk, dst_rows.chunk, src_rows.block_stride)
        elif dst_rows.rows == 1:
            dst_rows = BlockRows(src_rows.rows, src_rows.chunk, src_rows.chunk, dst_rows.block_stride)
        else:
            return None
    return src_rows, dst_rows


def check_swap_blocks_args(src, dst, block_mapping) -> None:
    """src and dst may be on different devices (a CPU cache and a GPU cache), but neither on
    the meta device, which holds no data to copy. Each may be a view whose blocks are rows of
    one contiguous chunk (``block_rows``)."""
    op = "swap_blocks"
    _require(src.dim() >= 1 and dst.dim() == src.dim() and src.shape[1:] == dst.shape[1:]
             and src.dtype == dst.dtype, op,
             lambda: f"src {src.dtype} {tuple(src.shape)} and dst {dst.dtype} {tuple(dst.shape)} must "
             f"share dtype and block shape")
    _require(swap_blocks_rows(src, dst) is not None, op,
             lambda: f"src (strides {src.stride()}) and dst (strides {dst.stride()}) must each lay a "
             f"block out as rows of one contiguous chunk at one pitch, blocks side by side within "
             f"a row (a contiguous tensor, or a whole pool with its block dimension moved first)")
    _require(block_mapping.dtype == torch.int64 and block_mapping.dim() == 2
             and block_mapping.shape[1] == 2, op,
             lambda: f"block_mapping must be int64 [n, 2], got {block_mapping.dtype} "
             f"{tuple(block_mapping.shape)}")
    _require(block_mapping.device.type == "cpu", op, "block_mapping must be a CPU tensor")
    for name, tensor in (("src", src), ("dst", dst)):
        _require(not tensor.is_meta, op, lambda: f"{name} is on {tensor.device}, which holds no data")


def check_swap_blocks_values(src, dst, block_mapping) -> None:
    """Reads ``block_mapping`` (a CPU tensor, so this is legal during a CUDA graph capture).

    Refuses block ids outside src or dst, a dst block written by two rows (which row wins
    would depend on the copy order), and, when src and dst are the same tensor, a block that
    is both read and written."""
    op = "swap_blocks"
    if block_mapping.numel() == 0:
        return
    for column, tensor, name in ((0, src, "src"), (1, dst, "dst")):
        ids = block_mapping[:, column]
        bad = (ids < 0) | (ids >= tensor.shape[0])
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"neo.{op}: {name} block {int(ids[row])} in row {row} is "
                             f"outside the {tensor.shape[0]} blocks of {name}")
    pairs = block_mapping.tolist()
    written = set()
    for row, (_, destination) in enumerate(pairs):
        _require(destination not in written, op,
                 lambda: f"dst block {destination} in row {row} is already written by an earlier row")
        written.add(destination)
    if src.device == dst.device and src.data_ptr() == dst.data_ptr():
        read = {source for source, _ in pairs}
        for _, destination in pairs:
            _require(destination not in read, op, lambda: f"block {destination} is both a source and a "
                     f"destination within the same tensor")


def check_prefill_attention_args(out, q, k, v, cu_seqlens, max_seqlen, scale) -> None:
    op = "prefill_attention"
    _require(q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, op,
             lambda: f"q must be [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, "
             f"head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _require(out.shape == q.shape, op, lambda: f"out shape {tuple(out.shape)} differs from q "
             f"{tuple(q.shape)}")
    _require(q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], op,
             "q, k and v must share num_tokens and head_dim")
    num_tokens, num_heads, head_dim = q.shape
    _require(1 <= head_dim <= MAX_HEAD_DIM, op,
             lambda: f"head_dim must be from 1 to {MAX_HEAD_DIM}, got {head_dim}")
    _require(k.shape[1] >= 1, op, lambda: f"k and v must have num_kv_heads >= 1, got {k.shape[1]}")
    _require(num_heads >= 1, op, lambda: f"q must have num_heads >= 1, got {num_heads}")
    _require(num_heads % k.shape[1] == 0, op, lambda: f"num_heads {num_heads} is not a multiple of "
             f"num_kv_heads {k.shape[1]}")
    _check_float_dtype(op, "q", q)
    _require(q.dtype == k.dtype == v.dtype == out.dtype, op,
             lambda: f"q, k, v and out must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
             f"{out.dtype}")
    _require(cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 1,
             op, lambda: f"cu_seqlens must be int32 [num_seqs + 1], got {cu_seqlens.dtype} "
             f"{tuple(cu_seqlens.shape)}")
    _require(num_tokens == 0 or cu_seqlens.numel() >= 2, op,
             lambda: f"cu_seqlens {tuple(cu_seqlens.shape)} holds no prompt for {num_tokens} tokens")
    _require(max_seqlen >= (1 if num_tokens else 0), op,
             lambda: f"max_seqlen must be >= {1 if num_tokens else 0} with {num_tokens} tokens, got "
             f"{max_seqlen}")
    _check_same_device(op, "q", q, {"k": k, "v": v, "out": out, "cu_seqlens": cu_seqlens})
    _check_float32_scalar(op, "scale", scale)


def check_prefill_attention_values(q, cu_seqlens, max_seqlen) -> None:
    """Reads ``cu_seqlens``: it must start at 0, never decrease and end at num_tokens (so every
    row of ``out`` belongs to exactly one prompt), and ``max_seqlen`` must be at least the
    longest prompt. A host sync on GPU tensors, skipped while a CUDA graph is being captured."""
    op = "prefill_attention"
    if _capturing(cu_seqlens):
        return
    bounds = cu_seqlens.to("cpu", torch.int64)
    _require(int(bounds[0]) == 0, op, lambda: f"cu_seqlens must start at 0, got {int(bounds[0])}")
    lengths = bounds[1:] - bounds[:-1]
    if bool((lengths < 0).any()):
        index = int((lengths < 0).nonzero()[0, 0]) + 1
        raise ValueError(f"neo.{op}: cu_seqlens must be non-decreasing, got cu_seqlens[{index}] "
                         f"= {int(bounds[index])} after {int(bounds[index - 1])}")
    num_tokens = q.shape[0]
    _require(int(bounds[-1]) == num_tokens, op, lambda: f"cu_seqlens must end at num_tokens "
             f"{num_tokens}, got {int(bounds[-1])}")
    if lengths.numel():
        longest = int(lengths.argmax())
        _require(max_seqlen >= int(lengths[longest]), op,
                 lambda: f"max_seqlen {max_seqlen} is below the longest prompt, {int(lengths[longest])} "
                 f"tokens (prompt {longest})")


def check_rms_norm_args(op, input, weight, epsilon, other, other_name) -> None:
    """For rms_norm (``other`` is ``out``) and fused_add_rms_norm (``other`` is ``residual``).

    ``weight`` has the input's dtype or is float32 (a float32 weight with half-precision
    activations; the norm is computed in float32 either way)."""
    _require(input.dim() == 2 and weight.shape == (input.shape[1],), op,
             lambda: f"input must be [num_tokens, hidden] and weight [hidden], got {tuple(input.shape)} "
             f"and {tuple(weight.shape)}")
    _require(other.shape == input.shape and other.dtype == input.dtype, op,
             lambda: f"{other_name} {other.dtype} {tuple(other.shape)} must match input {input.dtype} "
             f"{tuple(input.shape)}")
    _check_float_dtype(op, "input", input)
    _require(weight.dtype in (input.dtype, torch.float32), op,
             lambda: f"weight dtype must be the input's ({input.dtype}) or float32, got {weight.dtype}")
    _check_same_device(op, "input", input, {"weight": weight, other_name: other})
    _check_float32_scalar(op, "epsilon", epsilon)
    _require(epsilon > 0, op, lambda: f"epsilon must be > 0, got {epsilon}")


def check_rotary_embedding_args(positions, query, key, cos_sin_cache) -> None:
    op = "rotary_embedding"
    _require(positions.dtype == torch.int64 and positions.dim() == 1, op,
             lambda: f"positions must be int64 [num_tokens], got {positions.dtype} "
             f"{tuple(positions.shape)}")
    _require(query.dim() == 3 and key.dim() == 3 and query.shape[0] == key.shape[0]
             == positions.shape[0], op,
             lambda: f"query [T, H, D] and key [T, KVH, D] must have T = {positions.shape[0]} tokens, got "
             f"{tuple(query.shape)} and {tuple(key.shape)}")
    _require(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] % 2 == 0
             and cos_sin_cache.shape[1] <= min(query.shape[2], key.shape[2]), op,
             lambda: f"cos_sin_cache must be [max_positions, rotary_dim] with an even rotary_dim <= "
             f"head_dim, got {tuple(cos_sin_cache.shape)}")
    _require(cos_sin_cache.dtype == torch.float32, op,
             lambda: f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}")
    _check_float_dtype(op, "query", query)
    _require(key.dtype == query.dtype, op,
             lambda: f"key dtype {key.dtype} differs from query dtype {query.dtype}")
    _check_same_device(op, "query", query, {"key": key, "positions": positions,
                                            "cos_sin_cache": cos_sin_cache})


def check_rotary_embedding_values(positions, cos_sin_cache) -> None:
    """Reads ``positions``: each must index a row of ``cos_sin_cache``. A host sync on GPU
    tensors, skipped while a CUDA graph is being captured."""
    if positions.numel() == 0 or _capturing(positions):
        return
    values = positions.to("cpu")
    max_positions = cos_sin_cache.shape[0]
    bad = (values < 0) | (values >= max_positions)
    if bool(bad.any()):
        token = int(bad.nonzero()[0, 0])
        raise ValueError(f"neo.rotary_embedding: position {int(values[token])} of token {token} "
                         f"is outside the cos_sin_cache's {max_positions} positions")


def check_silu_and_mul_args(out, input) -> None:
    op = "silu_and_mul"
    _require(input.dim() == 2 and input.shape[1] % 2 == 0, op,
             lambda: f"input must be [num_tokens, 2 * intermediate], got {tuple(input.shape)}")
    _require(out.shape == (input.shape[0], input.shape[1] // 2) and out.dtype == input.dtype, op,
             lambda: f"out must be {input.dtype} [{input.shape[0]}, {input.shape[1] // 2}], got "
             f"{out.dtype} {tuple(out.shape)}")
    _check_float_dtype(op, "input", input)
    _check_same_device(op, "input", input, {"out": out})
