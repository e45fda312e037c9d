"""``torch.library.opcheck`` on every op, through ``torch.ops.neo`` and through every
implementation's own namespace (``torch.ops.neo_<implementation>``), on every device, with
small realistic inputs: schema (mutations declared), fake kernel, autograd registration and
AOT dispatch."""

import math

import pytest
import torch

import neo.ops
from conftest import cuda_skip_reason, poisoned_like, random_paged_kv, random_tensor


def paged_decode_attention_arguments(device, generator):
    paged = random_paged_kv([37, 1, 16], 2, 16, 64, torch.bfloat16, generator, device)
    q = random_tensor((3, 8, 64), torch.bfloat16, generator, device)
    return (poisoned_like(q), q, paged.k_cache, paged.v_cache, paged.block_table,
            paged.seq_lens, 1 / math.sqrt(64))


def store_kv_cache_arguments(device, generator):
    key = random_tensor((5, 2, 64), torch.float16, generator, device)
    value = random_tensor((5, 2, 64), torch.float16, generator, device)
    k_cache = random_tensor((4, 2, 16, 64), torch.float16, generator, device)
    v_cache = random_tensor((4, 2, 16, 64), torch.float16, generator, device)
    slots = torch.tensor([3, -1, 40, 17, 63], device=device)
    return key, value, k_cache, v_cache, slots


def swap_blocks_arguments(device, generator):
    """Two pools [layers, 2, B, KVH, BS, D] seen with their block dimension first, as the
    engine swaps every layer at once."""
    src = random_tensor((3, 2, 6, 2, 16, 64), torch.bfloat16, generator, device).movedim(2, 0)
    dst = random_tensor((3, 2, 5, 2, 16, 64), torch.bfloat16, generator, device).movedim(2, 0)
    return src, dst, torch.tensor([[0, 4], [5, 1], [2, 2]])


def prefill_attention_arguments(device, generator):
    q = random_tensor((9, 8, 64), torch.bfloat16, generator, device)
    k = random_tensor((9, 2, 64), torch.bfloat16, generator, device)
    v = random_tensor((9, 2, 64), torch.bfloat16, generator, device)
    cu_seqlens = torch.tensor([0, 1, 6, 9], dtype=torch.int32, device=device)
    return poisoned_like(q), q, k, v, cu_seqlens, 5, 1 / math.sqrt(64)


def rms_norm_arguments(device, generator):
    x = random_tensor((4, 256), torch.bfloat16, generator, device)
    return poisoned_like(x), x, random_tensor((256,), torch.bfloat16, generator, device), 1e-5


def fused_add_rms_norm_arguments(device, generator):
    return (random_tensor((4, 256), torch.bfloat16, generator, device),
            random_tensor((4, 256), torch.bfloat16, generator, device),
            random_tensor((256,), torch.bfloat16, generator, device), 1e-5)


def rotary_embedding_arguments(device, generator):
    frequencies = torch.rand(32, generator=generator)
    angles = torch.arange(64, dtype=torch.float32).unsqueeze(1) * frequencies
    cache = torch.cat((angles.cos(), angles.sin()), dim=1).to(device)
    positions = torch.tensor([0, 5, 63, 7], device=device)
    return (positions, random_tensor((4, 8, 64), torch.bfloat16, generator, device),
            random_tensor((4, 2, 64), torch.bfloat16, generator, device), cache)


def silu_and_mul_arguments(device, generator):
    x = random_tensor((4, 512), torch.bfloat16, generator, device)
    return poisoned_like(x[:, :256]), x


ARGUMENTS = {
    "paged_decode_attention": paged_decode_attention_arguments,
    "store_kv_cache": store_kv_cache_arguments,
    "swap_blocks": swap_blocks_arguments,
    "prefill_attention": prefill_attention_arguments,
    "rms_norm": rms_norm_arguments,
    "fused_add_rms_norm": fused_add_rms_norm_arguments,
    "rotary_embedding": rotary_embedding_arguments,
    "silu_and_mul": silu_and_mul_arguments,
}


def opcheck_params():
    """(op, namespace, device) for ``torch.ops.neo`` and every implementation's namespace."""
    params = []
    for op in neo.ops.OP_NAMES:
        for device in ("cpu", "cuda"):
            reason = cuda_skip_reason(device)
            params.append(pytest.param(op, "neo", device,
                                       marks=[pytest.mark.skip(reason=reason)] if reason else [],
                                       id=f"{op}-neo-{device}"))
        for implementation in neo.ops.implementations(op, available_only=False):
            for device in implementation.devices:
                reason = cuda_skip_reason(device)
                if not implementation.available:
                    reason = f"{implementation.name}: {implementation.note}"
                params.append(pytest.param(
                    op, f"neo_{implementation.name}", device,
                    marks=[pytest.mark.skip(reason=reason)] if reason else [],
                    id=f"{op}-neo_{implementation.name}-{device}"))
    return params


def test_every_op_has_arguments():
    assert set(ARGUMENTS) == set(neo.ops.OP_NAMES)


@pytest.mark.parametrize(("op", "namespace", "device"), opcheck_params())
def test_opcheck(op, namespace, device, generator):
    function = getattr(getattr(torch.ops, namespace), op)
    torch.library.opcheck(function, ARGUMENTS[op](device, generator))
