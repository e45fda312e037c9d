"""``neo.store_kv_cache``: every implementation, on every device, against a token-by-token copy.

The caches start with random contents; after the call, the slots of the stored tokens must hold
their K/V exactly and every other slot its previous contents (slot -1 stores nothing).
"""

import pytest
import torch

from conftest import FLOAT_DTYPES, implementation_params, random_tensor

OP = "store_kv_cache"
IMPLEMENTATIONS = implementation_params(OP)

# (num_kv_heads, head_dim)
HEAD_LAYOUTS = {"1x64": (1, 64), "2x80": (2, 80), "8x128": (8, 128)}


def expected_caches(key, value, k_cache, v_cache, slot_mapping):
    """The caches after the op, one token at a time, on the CPU."""
    k_cache, v_cache = k_cache.cpu().clone(), v_cache.cpu().clone()
    block_size = k_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, :, slot % block_size] = key[token].cpu()
            v_cache[slot // block_size, :, slot % block_size] = value[token].cpu()
    return k_cache, v_cache


def random_slots(num_tokens, num_slots, generator, skipped_every=4):
    """Distinct random slots; every ``skipped_every``-th token gets -1."""
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[::skipped_every] = -1
    return slots


def make_case(num_tokens, num_blocks, num_kv_heads, block_size, head_dim, dtype, generator,
              device, strided=False):
    """(key, value, k_cache, v_cache, slot_mapping). ``strided``: key and value are views into a
    packed [num_tokens, 3 * num_kv_heads, head_dim] tensor, as after a fused QKV projection."""
    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = random_tensor(cache_shape, dtype, generator, device)
    v_cache = random_tensor(cache_shape, dtype, generator, device)
    if strided:
        packed = random_tensor((num_tokens, 3 * num_kv_heads, head_dim), dtype, generator, device)
        key, value = packed[:, num_kv_heads:2 * num_kv_heads], packed[:, 2 * num_kv_heads:]
    else:
        key = random_tensor((num_tokens, num_kv_heads, head_dim), dtype, generator, device)
        value = random_tensor((num_tokens, num_kv_heads, head_dim), dtype, generator, device)
    slots = random_slots(num_tokens, num_blocks * block_size, generator).to(device)
    return key, value, k_cache, v_cache, slots


def check(implementation, key, value, k_cache, v_cache, slot_mapping):
    expected_k, expected_v = expected_caches(key, value, k_cache, v_cache, slot_mapping)
    implementation.function(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.cpu(), expected_k), "k_cache differs from the token-by-token copy"
    assert torch.equal(v_cache.cpu(), expected_v), "v_cache differs from the token-by-token copy"


@pytest.mark.parametrize("heads", HEAD_LAYOUTS.values(), ids=HEAD_LAYOUTS.keys())
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_matches_token_by_token_copy(implementation, device, dtype, block_size, heads,
                                     generator):
    num_kv_heads, head_dim = heads
    num_tokens = int(torch.randint(1, 80, (), generator=generator))
    check(implementation, *make_case(num_tokens, num_tokens // block_size + 3, num_kv_heads,
                                     block_size, head_dim, dtype, generator, device))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_strided_key_and_value(implementation, device, dtype, generator):
    check(implementation, *make_case(50, 9, 2, 16, 64, dtype, generator, device, strided=True))


@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_many_tokens(implementation, device, generator):
    """A whole prompt's worth of tokens (the CPU kernel splits them over threads)."""
    check(implementation, *make_case(3000, 200, 8, 16, 128, torch.bfloat16, generator, device))


@pytest.mark.parametrize(("implementation", "device"), IMPLEMENTATIONS)
def test_all_skipped_and_no_tokens(implementation, device, generator):
    key, value, k_cache, v_cache, slots = make_case(12, 4, 2, 8, 64, torch.float16, generator,
                                                    device)
    check(implementation, key, value, k_cache, v_cache, torch.full_like(slots, -1))
    check(implementation, key[:0], value[:0], k_cache, v_cache, slots[:0])


# Bad input. The CUDA kernel checks only what needs no host sync (shapes and dtypes).

def with_slot(arguments, token, slot):
    slots = arguments[4].clone()
    slots[token] = slot
    return (*arguments[:4], slots)


BAD_INPUTS = {
    # name: (how to break (key, value, k_cache, v_cache, slot_mapping), phrase, reads values)
    "slot-past-end": (lambda a: with_slot(a, 1, a[2].shape[0] * a[2].shape[2]),
                      r"slot \d+ of token 1 is outside the cache's \d+ slots", True),
    "slot-minus-2": (lambda a: with_slot(a, 3, -2), "slot -2 of token 3 is outside", True),
    "value-dtype": (lambda a: (a[0], a[1].double(), *a[2:]), "must share one dtype", False),
    "cache-dtype": (lambda a: (*a[:2], a[2].half(), a[3].half(), a[4]),
                    "must share one dtype", False),
    "value-shape": (lambda a: (a[0], a[1][:, :1].contiguous(), *a[2:]),
                    "key and value must both be", False),
    "heads-mismatch": (lambda a: (a[0][:, :1].contiguous(), a[1][:, :1].contiguous(), *a[2:]),
                       "does not match the cache's num_kv_heads", False),
    "slot-mapping-int32": (lambda a: (*a[:4], a[4].int()), "slot_mapping must be int64", False),
    "slot-mapping-length": (lambda a: (*a[:4], a[4][:-1]), "slot_mapping must be int64", False),
    "cache-non-contiguous": (lambda a: (*a[:2], a[2].transpose(0, 1).contiguous()
                                        .transpose(0, 1), *a[3:]), "must be contiguous", False),
    "block-size-12": (lambda a: (*a[:2], a[2][:, :, :12].contiguous(),
                                 a[3][:, :, :12].contiguous(), a[4]),
                      "block_size must be a power of two", False),
}


@pytest.mark.parametrize(("implementation", "device", "name"), [
    pytest.param(*param.values, name, marks=param.marks, id=f"{param.id}-{name}")
    for param in IMPLEMENTATIONS for name, (_, _, reads_values) in BAD_INPUTS.items()
    if not (reads_values and param.values[0].name == "cuda")])
def test_bad_input_raises(implementation, device, name, generator):
    breaking, phrase, _ = BAD_INPUTS[name]
    arguments = breaking(make_case(6, 3, 2, 16, 64, torch.float32, generator, device))
    with pytest.raises((ValueError, RuntimeError), match=phrase):
        implementation.function(*arguments)
