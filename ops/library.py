"""Declares ``torch.ops.neo`` and one namespace per implementation, with fake kernels.

``torch.ops.neo.<op>`` is what models call: the pure-torch reference is registered as its
``CompositeExplicitAutograd`` kernel (any device), and compiled kernels registered for the CPU
or CUDA dispatch key take precedence on their device. Every implementation is also declared
under its own namespace (``torch.ops.neo_reference.<op>``, ``torch.ops.neo_numba.<op>``,
``torch.ops.neo_ispc.<op>``, ``torch.ops.neo_cuda.<op>``, and ``torch.ops.neo_<name>.<op>`` for
a kernel added with ``neo.ops.register_kernel``), declared by ``registry`` when that
implementation is available, so tests, benchmarks and the engine can call each one by name.
"""

import torch
from torch.library import Library

from . import checks
from .schemas import SCHEMAS

_libraries: dict[str, list[Library]] = {}


def declare(namespace: str, op_names) -> Library:
    """Declare ``op_names`` (schemas from ``SCHEMAS``, with fake kernels) in ``namespace``.

    A namespace has one defining library: the first declaration in a namespace creates it, a
    later one (another op of a kernel added by name) adds a fragment to it. Returns the library
    that holds the new declarations."""
    kind = "FRAGMENT" if namespace in _libraries else "DEF"
    library = Library(namespace, kind)
    for name in op_names:
        library.define(name + SCHEMAS[name])
        torch.library.register_fake(f"{namespace}::{name}", FAKE_KERNELS[name], lib=library)
    _libraries.setdefault(namespace, []).append(library)
    return library


def library(namespace: str) -> Library:
    """The defining ``Library`` of a declared namespace (for registering kernels from Python)."""
    return _libraries[namespace][0]


def is_declared(qualified_name: str) -> bool:
    """Whether an op named ``namespace::op`` has a schema, whoever declared it."""
    return bool(torch._C._jit_get_schemas_for_operator(qualified_name))


# Fake kernels: every op writes into its arguments and returns nothing, so a fake kernel only
# checks what can be checked from metadata.

def _fake_paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale):
    checks.check_paged_decode_attention_args(out, q, k_cache, v_cache, block_table, seq_lens,
                                             scale)


def _fake_store_kv_cache(key, value, k_cache, v_cache, slot_mapping):
    checks.check_store_kv_cache_args(key, value, k_cache, v_cache, slot_mapping)


def _fake_swap_blocks(src, dst, block_mapping):
    checks.check_swap_blocks_args(src, dst, block_mapping)


def _fake_prefill_attention(out, q, k, v, cu_seqlens, max_seqlen, scale):
    checks.check_prefill_attention_args(out, q, k, v, cu_seqlens, max_seqlen, scale)


def _fake_rms_norm(out, input, weight, epsilon):
    checks.check_rms_norm_args("rms_norm", input, weight, epsilon, out, "out")


def _fake_fused_add_rms_norm(input, residual, weight, epsilon):
    checks.check_rms_norm_args("fused_add_rms_norm", input, weight, epsilon, residual, "residual")


def _fake_rotary_embedding(positions, query, key, cos_sin_cache):
    checks.check_rotary_embedding_args(positions, query, key, cos_sin_cache)


def _fake_silu_and_mul(out, input):
    checks.check_silu_and_mul_args(out, input)


FAKE_KERNELS = {
    "paged_decode_attention": _fake_paged_decode_attention,
    "store_kv_cache": _fake_store_kv_cache,
    "swap_blocks": _fake_swap_blocks,
    "prefill_attention": _fake_prefill_attention,
    "rms_norm": _fake_rms_norm,
    "fused_add_rms_norm": _fake_fused_add_rms_norm,
    "rotary_embedding": _fake_rotary_embedding,
    "silu_and_mul": _fake_silu_and_mul,
}

declare("neo", SCHEMAS)
