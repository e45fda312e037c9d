"""The schema of every ``torch.ops.neo`` operator and the shapes and dtypes of its tensors,
written once.

Each implementation namespace (``neo`` itself, ``neo_reference``, ``neo_numba``, ``neo_ispc``,
``neo_cuda``) is declared from ``SCHEMAS``, so the same signature is checked everywhere.
``TENSORS`` describes every tensor argument of every schema (``python -m neo.ops`` prints both;
``ops/checks.py`` enforces them). Shapes use these dimensions: ``T`` tokens, ``S`` sequences,
``H`` query heads, ``KVH`` key/value heads, ``D`` head dim, ``B`` cache blocks, ``BS`` block
size, ``hidden`` the model width, ``I`` the MLP's intermediate size. Dtype ``F`` is one
floating-point dtype (float32, float16 or bfloat16) shared by all of an op's ``F`` tensors.
"""

from dataclasses import dataclass

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


@dataclass(frozen=True)
class TensorSpec:
    """One tensor argument of an op: its shape (in the dimensions of the module docstring), its
    dtype, and what its values mean or what the op writes into it."""

    shape: str
    dtype: str
    meaning: str = ""


CACHE = TensorSpec("[B, KVH, BS, D]", "F", "one layer's paged K or V cache")
TENSORS: dict[str, dict[str, TensorSpec]] = {
    "paged_decode_attention": {
        "out": TensorSpec("[S, H, D]", "F", "written: each sequence's attention output"),
        "q": TensorSpec("[S, H, D]", "F", "one query token per sequence"),
        "k_cache": CACHE,
        "v_cache": CACHE,
        "block_table": TensorSpec("[S, max_blocks_per_seq]", "int32", "each sequence's cache blocks"),
        "seq_lens": TensorSpec("[S]", "int32", "tokens already in the cache, >= 1"),
    },
    "store_kv_cache": {
        "key": TensorSpec("[T, KVH, D]", "F"),
        "value": TensorSpec("[T, KVH, D]", "F"),
        "k_cache": TensorSpec(CACHE.shape, "F", "written at the tokens' slots"),
        "v_cache": TensorSpec(CACHE.shape, "F", "written at the tokens' slots"),
        "slot_mapping": TensorSpec("[T]", "int64", "block * BS + offset; -1 skips the token; no slot twice"),
    },
    "swap_blocks": {
        "src": TensorSpec("[B, ...]", "any", "cache blocks, any device: contiguous, or a pool "
                          "[layers, 2, B, ...] seen block-first (each block: rows of one chunk)"),
        "dst": TensorSpec("[B', ...]", "src's", "written: the mapped blocks, src's block shape"),
        "block_mapping": TensorSpec("[n, 2]", "int64", "(src_block, dst_block) rows; no destination twice"),
    },
    "prefill_attention": {
        "out": TensorSpec("[T, H, D]", "F", "written: causal attention within each prompt"),
        "q": TensorSpec("[T, H, D]", "F", "the packed prompts' tokens"),
        "k": TensorSpec("[T, KVH, D]", "F"),
        "v": TensorSpec("[T, KVH, D]", "F"),
        "cu_seqlens": TensorSpec("[S + 1]", "int32", "where each prompt starts, then T"),
    },
    "rms_norm": {
        "out": TensorSpec("[T, hidden]", "F", "written: rms_norm(input) * weight"),
        "input": TensorSpec("[T, hidden]", "F"),
        "weight": TensorSpec("[hidden]", "F|float32"),
    },
    "fused_add_rms_norm": {
        "input": TensorSpec("[T, hidden]", "F", "written: rms_norm(residual + input) * weight"),
        "residual": TensorSpec("[T, hidden]", "F", "written: residual + input"),
        "weight": TensorSpec("[hidden]", "F|float32"),
    },
    "rotary_embedding": {
        "positions": TensorSpec("[T]", "int64"),
        "query": TensorSpec("[T, H, D]", "F", "written: first rotary_dim features rotated, NeoX style"),
        "key": TensorSpec("[T, KVH, D]", "F", "written: like query"),
        "cos_sin_cache": TensorSpec("[max_positions, rotary_dim]", "float32", "cos half, then sin half"),
    },
    "silu_and_mul": {
        "out": TensorSpec("[T, I]", "F", "written: silu(input[:, :I]) * input[:, I:]"),
        "input": TensorSpec("[T, 2 * I]", "F"),
    },
}
