"""The schema of every ``torch.ops.neo`` operator, written once.

Each implementation namespace (``neo`` itself, ``neo_reference``, ``neo_numba``, ``neo_ispc``,
``neo_cuda``) is declared from this table, so the same signature is checked everywhere.

Shapes (``T`` tokens, ``S`` sequences, ``H`` query heads, ``KVH`` key/value heads, ``D`` head
dim, ``B`` cache blocks, ``BS`` block size):

paged_decode_attention
    out, q ``[S, H, D]``; k_cache, v_cache ``[B, KVH, BS, D]``; block_table int32
    ``[S, max_blocks_per_seq]``; seq_lens int32 ``[S]`` (tokens already in the cache, >= 1).
store_kv_cache
    key, value ``[T, KVH, D]``; k_cache, v_cache ``[B, KVH, BS, D]``; slot_mapping int64 ``[T]``
    (``block * BS + offset``; -1 skips the token; no slot twice); the caches are floating point.
swap_blocks
    src, dst ``[B, ...]`` (one layer's K or V cache, any devices); block_mapping int64 ``[n, 2]``
    of (src_block, dst_block); no destination block twice.
prefill_attention
    out, q ``[T, H, D]``; k, v ``[T, KVH, D]``; cu_seqlens int32 ``[S + 1]`` (packed prompts);
    max_seqlen the longest prompt; causal mask within each prompt.
rms_norm
    out, input ``[T, hidden]``; weight ``[hidden]``.
fused_add_rms_norm
    input, residual ``[T, hidden]``: ``residual += input``; ``input = rms_norm(residual)``.
rotary_embedding
    positions int64 ``[T]``; query ``[T, H, D]``; key ``[T, KVH, D]``; cos_sin_cache float32
    ``[max_positions, rotary_dim]`` (cos in the first half, sin in the second); rotates the first
    ``rotary_dim`` features of every head in place, GPT-NeoX style (halves, not interleaved).
silu_and_mul
    input ``[T, 2 * I]``; out ``[T, I]`` = ``silu(input[:, :I]) * input[:, I:]``.
"""

SCHEMAS: dict[str, str] = {
    "paged_decode_attention": (
        "(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, float scale) -> ()"
    ),
    "store_kv_cache": (
        "(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()"
    ),
    "swap_blocks": "(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()",
    "prefill_attention": (
        "(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, "
        "float scale) -> ()"
    ),
    "rms_norm": "(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()",
    "fused_add_rms_norm": (
        "(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()"
    ),
    "rotary_embedding": (
        "(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache) -> ()"
    ),
    "silu_and_mul": "(Tensor(a!) out, Tensor input) -> ()",
}

OP_NAMES: tuple[str, ...] = tuple(SCHEMAS)
