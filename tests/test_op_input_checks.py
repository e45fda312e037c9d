"""Every op refuses bad input on every implementation, and accepts good input: property tests.

For each op a strategy draws valid arguments (small random shapes and data, empty batches
included). ``test_valid_input`` runs each implementation on them and compares every output
with the reference's. ``test_corrupted_input`` then corrupts exactly one thing (a dtype, a
device, a rank, one shape dimension, one metadata value, a scalar) and requires a ValueError
(Python implementations; native kernels may raise RuntimeError) whose message starts with
``neo.<op>: `` and names the problem.

Every tensor argument lives inside a larger buffer whose other elements hold a marker (NaN, or
a large negative integer), with gaps between rows where the op accepts strided rows: after a
valid call only the elements of the op's mutated arguments may have changed, and after a
refused call nothing has. A write out of bounds shows up there, a read out of bounds as a NaN
in the output. Value checks (block ids, slots, prompt bounds, positions) are host-side only:
the CUDA kernels skip them to avoid a sync, so those corruptions are not run against them.
"""

import math
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import neo.ops
from conftest import (FLOAT_DTYPES, assert_close, implementation_params, random_paged_kv,
                      random_tensor)

# Per op and implementation: 8 examples of each kind of corruption, 80 valid cases.
settings.register_profile("op-input-checks", max_examples=8, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
CORRUPTED_SETTINGS = settings.get_profile("op-input-checks")
VALID_SETTINGS = settings(CORRUPTED_SETTINGS, max_examples=80)

SEEDS = st.integers(0, 2**31 - 1)
NON_FINITE = [float("nan"), float("inf"), float("-inf"), 1e39, -1e39]
INTEGER_MARKER = -(2**20) - 7


def schema_arguments(op: str) -> tuple[list[str], set[str]]:
    """(argument names in schema order, names of the arguments the op writes)."""
    schema = neo.ops.SCHEMAS[op]
    names, mutated = [], set()
    for argument in schema[schema.index("(") + 1:schema.index(") ->")].split(","):
        kind, name = argument.split()
        names.append(name)
        if "!" in kind:
            mutated.add(name)
    return names, mutated


class Buffers:
    """Places tensor arguments inside larger buffers filled with a marker, to see what an op
    writes outside its own elements.

    ``place(values, name, row_gap)`` returns a tensor equal to ``values`` whose storage starts
    and ends with a margin of markers and leaves ``row_gap`` markers between consecutive rows
    (dim 0) when ``row_gap`` > 0 (a non-contiguous tensor whose rows are contiguous).
    """

    def __init__(self, device: str):
        self.device = device
        self.placed: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def place(self, values: torch.Tensor, name: str, row_gap: int = 0, device: str | None = None) -> torch.Tensor:
        """``values`` inside a marked buffer on ``device`` (None: the op's device)."""
        device = device or self.device
        inner = math.prod(values.shape[1:])
        row_stride = inner + row_gap
        margin = max(inner, 8) + row_gap
        length = 2 * margin + values.shape[0] * row_stride
        marker = float("nan") if values.is_floating_point() else INTEGER_MARKER
        storage = torch.full((length,), marker, dtype=values.dtype, device=device)
        strides = (row_stride, *torch.empty(values.shape[1:]).stride())
        tensor = storage.as_strided(values.shape, strides, margin)
        tensor.copy_(values)
        own = torch.zeros(length, dtype=torch.bool, device=device)
        own.as_strided(values.shape, strides, margin).fill_(True)
        self.placed.append((name, storage, own, storage.clone()))
        return tensor

    def assert_unchanged(self, writable: set[str]) -> None:
        """Every buffer holds what it held when placed, except the own elements of the
        arguments named in ``writable``."""
        for name, storage, own, before in self.placed:
            changed = bits(storage) != bits(before)
            if name in writable:
                changed &= ~own
            assert not changed.any(), (
                f"{int(changed.sum())} elements of the buffer of {name} changed "
                f"{'outside its own elements' if name in writable else 'though nothing may'}")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (NaN compares equal to itself)."""
    if tensor.is_floating_point():
        return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    return tensor


def other_float_dtype(draw, dtype: torch.dtype) -> torch.dtype:
    return draw(st.sampled_from([other for other in FLOAT_DTYPES if other != dtype]))


def nan_tensor(shape, dtype, device) -> torch.Tensor:
    """NaN (zero for integer dtypes) of ``shape``."""
    return torch.full(shape, float("nan") if dtype.is_floating_point else 0, dtype=dtype,
                      device=device)


def resized(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A tensor like ``tensor`` (dtype, device) with dimension ``dim`` of length ``size``."""
    shape = list(tensor.shape)
    shape[dim] = size
    return nan_tensor(shape, tensor.dtype, tensor.device)


def non_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The same values in every other element of a twice-as-long last dimension."""
    wide = torch.empty((*tensor.shape[:-1], 2 * tensor.shape[-1]), dtype=tensor.dtype,
                       device=tensor.device)
    view = wide[..., ::2]
    view.copy_(tensor)
    return view


def with_value(tensor: torch.Tensor, index, value) -> torch.Tensor:
    changed = tensor.clone()
    changed[index] = value
    return changed


def outside(draw, low: int, high: int, extent: int = 2**62) -> int:
    """An integer outside ``[low, high)``, up to ``extent`` past either end."""
    return draw(st.one_of(st.integers(low - extent, low - 1),
                          st.integers(high, high + extent - 1)))


def meta_phrase(name: str) -> str:
    """The error for a meta tensor names the argument and the meta device."""
    return rf"(?s)(?=.*\b{name}\b)(?=.*\bmeta\b)"


@dataclass(frozen=True)
class Corruption:
    """One way to break valid arguments.

    ``apply(arguments, draw)`` returns the arguments to replace; ``phrase`` is a regular
    expression the error message must contain. ``host_only``: a value check, which the CUDA
    kernels leave to host-side implementations. ``nonempty``: needs a case with data (tokens,
    sequences, block pairs)."""

    apply: Callable
    phrase: str
    host_only: bool = False
    nonempty: bool = False


@dataclass(frozen=True)
class OpCases:
    """``build(draw, generator, buffers, nonempty)`` draws valid arguments (a dict in schema
    order); ``corruptions`` by name; ``exact``: outputs must equal the reference's bit for bit
    (copies), else they match within the dtype's tolerance."""

    build: Callable
    corruptions: dict[str, Corruption]
    exact: bool = False


def meta_corruptions(names) -> dict[str, Corruption]:
    return {f"{name}-on-meta": Corruption(lambda a, draw, name=name: {name: a[name].to("meta")},
                                          meta_phrase(name))
            for name in names}


def scale_corruption(name: str) -> Corruption:
    return Corruption(lambda a, draw: {name: draw(st.sampled_from(NON_FINITE))},
                      rf"{name} must be a finite float32 value")


# ---------------------------------------------------------------------------------------------
# paged_decode_attention

def build_paged_decode_attention(draw, generator, buffers, nonempty):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    num_kv_heads = draw(st.integers(1, 2))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    block_size = draw(st.sampled_from([8, 16]))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=1 if nonempty else 0, max_size=4))
    paged = random_paged_kv(seq_lens, num_kv_heads, block_size, head_dim, dtype, generator,
                            spare_blocks=draw(st.integers(0, 2)),
                            spare_columns=draw(st.integers(0, 2)))
    q = random_tensor((len(seq_lens), num_heads, head_dim), dtype, generator)
    return {"out": buffers.place(nan_tensor(q.shape, dtype, "cpu"), "out"),
            "q": buffers.place(q, "q"),
            "k_cache": buffers.place(paged.k_cache, "k_cache"),
            "v_cache": buffers.place(paged.v_cache, "v_cache"),
            "block_table": buffers.place(paged.block_table, "block_table",
                                         draw(st.integers(0, 2))),
            "seq_lens": buffers.place(paged.seq_lens, "seq_lens", draw(st.integers(0, 2))),
            "scale": draw(st.floats(0.05, 2.0)) / math.sqrt(head_dim)}


def _decode_used_entry(a, draw):
    """(sequence, column) of a block_table entry the sequence uses."""
    seq_lens = a["seq_lens"].cpu()
    seq = draw(st.integers(0, seq_lens.numel() - 1))
    block_size = a["k_cache"].shape[2]
    column = draw(st.integers(0, (int(seq_lens[seq]) - 1) // block_size))
    return seq, column


def _decode_caches(a, num_kv_heads=None, block_size=None, head_dim=None):
    num_blocks, kv_heads, size, dim = a["k_cache"].shape
    shape = (num_blocks, kv_heads if num_kv_heads is None else num_kv_heads,
             size if block_size is None else block_size, dim if head_dim is None else head_dim)
    return {name: nan_tensor(shape, a[name].dtype, a[name].device)
            for name in ("k_cache", "v_cache")}


def _decode_queries(a, num_heads=None, head_dim=None):
    num_seqs, heads, dim = a["q"].shape
    shape = (num_seqs, heads if num_heads is None else num_heads,
             dim if head_dim is None else head_dim)
    return {name: nan_tensor(shape, a[name].dtype, a[name].device) for name in ("q", "out")}


def _decode_head_dim(a, draw):
    head_dim = draw(st.sampled_from([8, 24, 40, 272]))
    return _decode_caches(a, head_dim=head_dim) | _decode_queries(a, head_dim=head_dim)


PAGED_DECODE_ATTENTION = OpCases(build_paged_decode_attention, {
    "q-integer": Corruption(lambda a, draw: {"q": a["q"].to(torch.int32)},
                            "q dtype must be float32, float16 or bfloat16"),
    "out-dtype": Corruption(
        lambda a, draw: {"out": a["out"].to(other_float_dtype(draw, a["q"].dtype))},
        "q, caches and out must share one dtype"),
    "v-cache-dtype": Corruption(
        lambda a, draw: {"v_cache": a["v_cache"].to(other_float_dtype(draw, a["q"].dtype))},
        "v_cache dtype .* differs from k_cache dtype"),
    "q-rank": Corruption(lambda a, draw: {"q": a["q"][:, 0]},
                         r"q must be \[num_seqs, num_heads, head_dim\]"),
    "out-shape": Corruption(lambda a, draw: {"out": resized(a["out"], 1, a["out"].shape[1] + 1)},
                            "out shape .* differs from q shape"),
    "k-cache-rank": Corruption(lambda a, draw: {"k_cache": a["k_cache"].flatten(0, 1)},
                               r"k_cache must be \[num_blocks, num_kv_heads, block_size"),
    "v-cache-shape": Corruption(
        lambda a, draw: {"v_cache": resized(a["v_cache"], 0, a["v_cache"].shape[0] + 1)},
        "v_cache shape .* differs from k_cache shape"),
    "k-cache-non-contiguous": Corruption(
        lambda a, draw: {"k_cache": non_contiguous(a["k_cache"])},
        "k_cache and v_cache must be contiguous", nonempty=True),
    "q-non-contiguous": Corruption(lambda a, draw: {"q": non_contiguous(a["q"])},
                                   "q and out must be contiguous", nonempty=True),
    "zero-kv-heads": Corruption(lambda a, draw: _decode_caches(a, num_kv_heads=0),
                                "k_cache must have num_kv_heads >= 1, got 0"),
    "zero-heads": Corruption(lambda a, draw: _decode_queries(a, num_heads=0),
                             "q must have num_heads >= 1, got 0"),
    "heads-not-a-multiple": Corruption(
        lambda a, draw: _decode_caches(a, num_kv_heads=a["q"].shape[1] + 1),
        r"num_heads \d+ is not a multiple of num_kv_heads \d+"),
    "q-head-dim": Corruption(lambda a, draw: _decode_queries(a, head_dim=a["q"].shape[2] + 16),
                             r"q head_dim \d+ differs from the cache's \d+"),
    "block-size": Corruption(
        lambda a, draw: _decode_caches(a, block_size=draw(st.sampled_from([4, 12, 24, 256]))),
        "block_size must be a power of two from 8 to 128"),
    "head-dim": Corruption(_decode_head_dim, "head_dim must be a multiple of 16 up to 256"),
    "block-table-dtype": Corruption(
        lambda a, draw: {"block_table": a["block_table"].to(draw(st.sampled_from(
            [torch.int64, torch.int16, torch.float32])))},
        r"block_table must be int32 \[num_seqs, max_blocks_per_seq\]"),
    "block-table-rank": Corruption(lambda a, draw: {"block_table": a["block_table"].flatten()},
                                   r"block_table must be int32 \[num_seqs, max_blocks_per_seq\]"),
    "block-table-rows": Corruption(
        lambda a, draw: {"block_table": resized(a["block_table"], 0,
                                                a["block_table"].shape[0] + 1)},
        r"block_table has \d+ rows for \d+ sequences"),
    "seq-lens-dtype": Corruption(lambda a, draw: {"seq_lens": a["seq_lens"].long()},
                                 r"seq_lens must be int32 \[\d+\]"),
    "seq-lens-length": Corruption(
        lambda a, draw: {"seq_lens": resized(a["seq_lens"], 0, a["seq_lens"].shape[0] + 1)},
        r"seq_lens must be int32 \[\d+\]"),
    "scale": scale_corruption("scale"),
    "seq-len-below-1": Corruption(
        lambda a, draw: {"seq_lens": with_value(
            a["seq_lens"], draw(st.integers(0, a["seq_lens"].numel() - 1)),
            draw(st.integers(-(2**31), 0)))},
        "every seq_len must be >= 1", host_only=True, nonempty=True),
    "seq-len-beyond-block-table": Corruption(
        lambda a, draw: {"seq_lens": with_value(
            a["seq_lens"], draw(st.integers(0, a["seq_lens"].numel() - 1)),
            draw(st.integers(a["block_table"].shape[1] * a["k_cache"].shape[2] + 1,
                             2**31 - 1)))},
        r"seq_len \d+ of sequence \d+ needs \d+ blocks but block_table has \d+ columns",
        host_only=True, nonempty=True),
    "block-id-outside-cache": Corruption(
        lambda a, draw: {"block_table": with_value(
            a["block_table"], _decode_used_entry(a, draw),
            outside(draw, 0, a["k_cache"].shape[0], extent=2**31 - a["k_cache"].shape[0]))},
        r"block id -?\d+ at block_table\[\d+, \d+\] is outside the cache's \d+ blocks",
        host_only=True, nonempty=True),
    **meta_corruptions(["out", "q", "k_cache", "v_cache", "block_table", "seq_lens"]),
})


# ---------------------------------------------------------------------------------------------
# store_kv_cache

def build_store_kv_cache(draw, generator, buffers, nonempty):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    num_kv_heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([16, 32, 64]))
    block_size = draw(st.sampled_from([8, 16]))
    num_blocks = draw(st.integers(1, 5))
    num_slots = num_blocks * block_size
    num_tokens = draw(st.integers(1 if nonempty else 0, min(20, num_slots)))
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    skipped = torch.tensor(draw(st.lists(st.booleans(), min_size=num_tokens,
                                         max_size=num_tokens)), dtype=torch.bool)
    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    token_shape = (num_tokens, num_kv_heads, head_dim)
    return {"key": buffers.place(random_tensor(token_shape, dtype, generator), "key",
                                 draw(st.integers(0, 3)) * head_dim),
            "value": buffers.place(random_tensor(token_shape, dtype, generator), "value",
                                   draw(st.integers(0, 3)) * head_dim),
            "k_cache": buffers.place(random_tensor(cache_shape, dtype, generator), "k_cache"),
            "v_cache": buffers.place(random_tensor(cache_shape, dtype, generator), "v_cache"),
            "slot_mapping": buffers.place(slots.masked_fill(skipped, -1), "slot_mapping",
                                          draw(st.integers(0, 2)))}


def _store_shapes(a, num_kv_heads=None, block_size=None, head_dim=None, tokens=False):
    """Caches (and key/value when ``tokens``) with other dimensions."""
    num_blocks, kv_heads, size, dim = a["k_cache"].shape
    kv_heads = kv_heads if num_kv_heads is None else num_kv_heads
    dim = dim if head_dim is None else head_dim
    cache_shape = (num_blocks, kv_heads, size if block_size is None else block_size, dim)
    changed = {name: nan_tensor(cache_shape, a[name].dtype, a[name].device)
               for name in ("k_cache", "v_cache")}
    if tokens:
        changed |= {name: nan_tensor((a["key"].shape[0], kv_heads, dim), a[name].dtype,
                                     a[name].device) for name in ("key", "value")}
    return changed


def _store_tokens(a, num_kv_heads):
    shape = (a["key"].shape[0], num_kv_heads, a["key"].shape[2])
    return {name: nan_tensor(shape, a[name].dtype, a[name].device) for name in ("key", "value")}


def _slot_given_twice(a, draw):
    """Another token stores into the slot of a stored token (one whose slot is not -1)."""
    slots = a["slot_mapping"].cpu()
    stored = (slots >= 0).nonzero().flatten().tolist()
    if not stored:  # every token skipped: store the first one too
        stored = [0]
        slots = with_value(slots, 0, 0)
    source = draw(st.sampled_from(stored))
    others = [token for token in range(slots.numel()) if token != source]
    if not others:  # a single token: add a second one
        tokens = {name: torch.cat((a[name], a[name])) for name in ("key", "value")}
        return tokens | {"slot_mapping": torch.cat((slots, slots)).to(a["slot_mapping"].device)}
    target = draw(st.sampled_from(others))
    return {"slot_mapping": with_value(slots, target, int(slots[source])).to(
        a["slot_mapping"].device)}


def _cache_dtype(a, draw):
    dtype = other_float_dtype(draw, a["k_cache"].dtype)
    return {name: a[name].to(dtype) for name in ("k_cache", "v_cache")}


STORE_KV_CACHE = OpCases(build_store_kv_cache, {
    "key-integer": Corruption(lambda a, draw: {"key": a["key"].to(torch.int16)},
                              "key dtype must be float32, float16 or bfloat16"),
    "value-dtype": Corruption(
        lambda a, draw: {"value": a["value"].to(other_float_dtype(draw, a["key"].dtype))},
        "key, value and caches must share one dtype"),
    "cache-dtype": Corruption(_cache_dtype, "key, value and caches must share one dtype"),
    "v-cache-dtype": Corruption(
        lambda a, draw: {"v_cache": a["v_cache"].to(other_float_dtype(draw, a["key"].dtype))},
        "v_cache dtype .* differs from k_cache dtype"),
    "key-rank": Corruption(lambda a, draw: {"key": a["key"].flatten(1)},
                           r"key and value must both be \[num_tokens, num_kv_heads, head_dim\]"),
    "value-shape": Corruption(
        lambda a, draw: {"value": resized(a["value"], 1, a["value"].shape[1] + 1)},
        r"key and value must both be \[num_tokens, num_kv_heads, head_dim\]"),
    "key-heads": Corruption(lambda a, draw: _store_tokens(a, a["key"].shape[1] + 1),
                            "does not match the cache's num_kv_heads"),
    "zero-kv-heads": Corruption(lambda a, draw: _store_shapes(a, num_kv_heads=0, tokens=True),
                                "k_cache must have num_kv_heads >= 1, got 0"),
    "k-cache-non-contiguous": Corruption(
        lambda a, draw: {"k_cache": non_contiguous(a["k_cache"])},
        "k_cache and v_cache must be contiguous"),
    "block-size": Corruption(
        lambda a, draw: _store_shapes(a, block_size=draw(st.sampled_from([4, 12, 256]))),
        "block_size must be a power of two from 8 to 128"),
    "head-dim": Corruption(
        lambda a, draw: _store_shapes(a, head_dim=draw(st.sampled_from([8, 24, 272])),
                                      tokens=True),
        "head_dim must be a multiple of 16 up to 256"),
    "slot-mapping-dtype": Corruption(
        lambda a, draw: {"slot_mapping": a["slot_mapping"].to(torch.int32)},
        r"slot_mapping must be int64 \[\d+\]"),
    "slot-mapping-length": Corruption(
        lambda a, draw: {"slot_mapping": resized(a["slot_mapping"], 0,
                                                 a["slot_mapping"].shape[0] + 1)},
        r"slot_mapping must be int64 \[\d+\]"),
    "slot-given-twice": Corruption(_slot_given_twice,
                                   r"slot \d+ of token \d+ is also the slot of token \d+",
                                   host_only=True, nonempty=True),
    "slot-outside-cache": Corruption(
        lambda a, draw: {"slot_mapping": with_value(
            a["slot_mapping"], draw(st.integers(0, a["slot_mapping"].numel() - 1)),
            outside(draw, -1, a["k_cache"].shape[0] * a["k_cache"].shape[2]))},
        r"slot -?\d+ of token \d+ is outside the cache's \d+ slots", host_only=True,
        nonempty=True),
    **meta_corruptions(["key", "value", "k_cache", "v_cache", "slot_mapping"]),
}, exact=True)


# ---------------------------------------------------------------------------------------------
# swap_blocks

def build_swap_blocks(draw, generator, buffers, nonempty):
    dtype = draw(st.sampled_from([*FLOAT_DTYPES, torch.int32]))
    block_shape = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
    minimum = 2 if nonempty else 1
    num_src_blocks = draw(st.integers(minimum, 8))
    blocks = random_tensor((num_src_blocks, *block_shape), dtype, generator)
    if draw(st.booleans()):  # one tensor: disjoint source and destination blocks
        src = dst = buffers.place(blocks, "dst")
        order = torch.randperm(num_src_blocks, generator=generator)
        count = draw(st.integers(1 if nonempty else 0, num_src_blocks // 2))
        sources, destinations = order[:count], order[count:2 * count]
    else:
        src = buffers.place(blocks, "src")
        num_dst_blocks = draw(st.integers(minimum, 8))
        dst = buffers.place(random_tensor((num_dst_blocks, *block_shape), dtype, generator),
                            "dst")
        count = draw(st.integers(1 if nonempty else 0, num_dst_blocks))
        sources = torch.randint(num_src_blocks, (count,), generator=generator)
        destinations = torch.randperm(num_dst_blocks, generator=generator)[:count]
    mapping = torch.stack((sources, destinations), dim=1)
    return {"src": src, "dst": dst,
            "block_mapping": buffers.place(mapping, "block_mapping", draw(st.integers(0, 2)), device="cpu")}


def _mapping_entry(a, draw, column):
    rows = a["block_mapping"].shape[0]
    return draw(st.integers(0, rows - 1)), column


def _duplicate_destination(a, draw):
    mapping = a["block_mapping"]
    row = draw(st.integers(0, mapping.shape[0] - 1))
    return {"block_mapping": torch.cat((mapping, mapping[row:row + 1]))}


def _read_and_written(a, draw):
    """The same tensor as src and dst, with a block copied to a block that is copied on."""
    src = a["src"]
    first, second = torch.randperm(src.shape[0])[:2].tolist()
    return {"dst": src, "block_mapping": torch.tensor([[first, second], [second, first]])}


SWAP_BLOCKS = OpCases(build_swap_blocks, {
    "dtype-mismatch": Corruption(
        lambda a, draw: {"dst": a["dst"].to(draw(st.sampled_from(
            [dtype for dtype in (*FLOAT_DTYPES, torch.int32) if dtype != a["src"].dtype])))},
        "src .* and dst .* must share dtype and block shape"),
    "block-shape-mismatch": Corruption(
        lambda a, draw: {"dst": a["dst"].unsqueeze(-1).expand(*a["dst"].shape, 2).contiguous()},
        "src .* and dst .* must share dtype and block shape"),
    "src-zero-dimensional": Corruption(lambda a, draw: {"src": a["src"].flatten()[0].clone()},
                                       "src .* and dst .* must share dtype and block shape"),
    "dst-blocks-overlap": Corruption(lambda a, draw: {"dst": a["dst"][:1].expand_as(a["dst"])},
                                     "must each lay a block out as rows of one contiguous chunk",
                                     nonempty=True),
    "mapping-dtype": Corruption(lambda a, draw: {"block_mapping": a["block_mapping"].int()},
                                r"block_mapping must be int64 \[n, 2\]"),
    "mapping-shape": Corruption(
        lambda a, draw: {"block_mapping": draw(st.sampled_from(
            [a["block_mapping"].flatten(), a["block_mapping"].repeat(1, 2)]))},
        r"block_mapping must be int64 \[n, 2\]"),
    "src-block-outside": Corruption(
        lambda a, draw: {"block_mapping": with_value(
            a["block_mapping"], _mapping_entry(a, draw, 0), outside(draw, 0, a["src"].shape[0]))},
        r"src block -?\d+ in row \d+ is outside the \d+ blocks of src", nonempty=True),
    "dst-block-outside": Corruption(
        lambda a, draw: {"block_mapping": with_value(
            a["block_mapping"], _mapping_entry(a, draw, 1), outside(draw, 0, a["dst"].shape[0]))},
        r"dst block -?\d+ in row \d+ is outside the \d+ blocks of dst", nonempty=True),
    "dst-block-twice": Corruption(_duplicate_destination,
                                  r"dst block \d+ in row \d+ is already written by an earlier row",
                                  nonempty=True),
    "block-read-and-written": Corruption(
        _read_and_written, r"block \d+ is both a source and a destination within the same tensor",
        nonempty=True),
    "src-on-meta": Corruption(lambda a, draw: {"src": a["src"].to("meta")}, meta_phrase("src")),
    "dst-on-meta": Corruption(lambda a, draw: {"dst": a["dst"].to("meta")}, meta_phrase("dst")),
    "block-mapping-on-meta": Corruption(
        lambda a, draw: {"block_mapping": a["block_mapping"].to("meta")},
        "block_mapping must be a CPU tensor"),
}, exact=True)


# ---------------------------------------------------------------------------------------------
# prefill_attention

def build_prefill_attention(draw, generator, buffers, nonempty):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    num_kv_heads = draw(st.integers(1, 2))
    num_heads = num_kv_heads * draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 40, 64]))
    if nonempty:  # two prompts or more, one of them at least 2 tokens long
        lengths = draw(st.lists(st.integers(2, 12), min_size=2, max_size=4))
    else:
        lengths = draw(st.lists(st.integers(0, 12), max_size=4))
    num_tokens = sum(lengths)
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    tokens = {"q": (num_tokens, num_heads, head_dim), "k": (num_tokens, num_kv_heads, head_dim),
              "v": (num_tokens, num_kv_heads, head_dim)}
    arguments = {"out": buffers.place(nan_tensor(tokens["q"], dtype, "cpu"), "out",
                                      draw(st.integers(0, 2)) * head_dim)}
    for name, shape in tokens.items():
        arguments[name] = buffers.place(random_tensor(shape, dtype, generator), name,
                                        draw(st.integers(0, 2)) * head_dim)
    return arguments | {
        "cu_seqlens": buffers.place(cu_seqlens, "cu_seqlens", draw(st.integers(0, 2))),
        "max_seqlen": max(lengths, default=0) + draw(st.integers(0, 3)),
        "scale": draw(st.floats(0.05, 2.0)) / math.sqrt(head_dim)}


def _prefill_tokens(a, names, dim, size):
    return {name: resized(a[name], dim, size) for name in names}


def _prefill_bounds(a):
    return a["cu_seqlens"].cpu().long()


def _cu_seqlens_decreasing(a, draw):
    bounds = _prefill_bounds(a)
    index = draw(st.integers(1, bounds.numel() - 2))  # an inner bound: start and end stay
    return {"cu_seqlens": with_value(a["cu_seqlens"], index,
                                     int(bounds[index + 1]) + draw(st.integers(1, 100)))}


def _cu_seqlens_end(a, draw):
    bounds = _prefill_bounds(a)
    end = draw(st.one_of(st.integers(int(bounds[-2]), int(bounds[-1]) - 1),
                         st.integers(int(bounds[-1]) + 1, 2**31 - 1)))
    return {"cu_seqlens": with_value(a["cu_seqlens"], -1, end)}


def _max_seqlen_below_longest(a, draw):
    longest = int((_prefill_bounds(a)[1:] - _prefill_bounds(a)[:-1]).max())
    return {"max_seqlen": draw(st.integers(1, longest - 1))}


def _max_seqlen_negative(a, draw):
    lowest = 1 if a["q"].shape[0] else 0
    return {"max_seqlen": draw(st.integers(-(2**62), lowest - 1))}


PREFILL_ATTENTION = OpCases(build_prefill_attention, {
    "q-integer": Corruption(lambda a, draw: {"q": a["q"].to(torch.int64)},
                            "q dtype must be float32, float16 or bfloat16"),
    "k-dtype": Corruption(lambda a, draw: {"k": a["k"].to(other_float_dtype(draw, a["q"].dtype))},
                          "q, k, v and out must share a dtype"),
    "out-dtype": Corruption(
        lambda a, draw: {"out": a["out"].to(other_float_dtype(draw, a["q"].dtype))},
        "q, k, v and out must share a dtype"),
    "q-rank": Corruption(lambda a, draw: {"q": a["q"][:, 0]},
                         r"q must be \[num_tokens, num_heads, head_dim\]"),
    "v-shape": Corruption(lambda a, draw: {"v": resized(a["v"], 1, a["v"].shape[1] + 1)},
                          r"k and v \[num_tokens, num_kv_heads, head_dim\]"),
    "out-shape": Corruption(lambda a, draw: {"out": resized(a["out"], 1, a["out"].shape[1] + 1)},
                            "out shape .* differs from q"),
    "kv-tokens": Corruption(lambda a, draw: _prefill_tokens(a, ("k", "v"), 0, a["k"].shape[0] + 1),
                            "q, k and v must share num_tokens and head_dim"),
    "head-dim": Corruption(
        lambda a, draw: _prefill_tokens(a, ("out", "q", "k", "v"), 2,
                                        draw(st.sampled_from([0, 264, 512]))),
        "head_dim must be from 1 to 256"),
    "zero-kv-heads": Corruption(lambda a, draw: _prefill_tokens(a, ("k", "v"), 1, 0),
                                "k and v must have num_kv_heads >= 1, got 0"),
    "zero-heads": Corruption(lambda a, draw: _prefill_tokens(a, ("out", "q"), 1, 0),
                             "q must have num_heads >= 1, got 0"),
    "heads-not-a-multiple": Corruption(
        lambda a, draw: _prefill_tokens(a, ("k", "v"), 1, a["q"].shape[1] + 1),
        r"num_heads \d+ is not a multiple of num_kv_heads \d+"),
    "cu-seqlens-dtype": Corruption(lambda a, draw: {"cu_seqlens": a["cu_seqlens"].long()},
                                   r"cu_seqlens must be int32 \[num_seqs \+ 1\]"),
    "cu-seqlens-rank": Corruption(lambda a, draw: {"cu_seqlens": a["cu_seqlens"].unsqueeze(0)},
                                  r"cu_seqlens must be int32 \[num_seqs \+ 1\]"),
    "cu-seqlens-empty": Corruption(lambda a, draw: {"cu_seqlens": a["cu_seqlens"][:0]},
                                   r"cu_seqlens must be int32 \[num_seqs \+ 1\]"),
    "cu-seqlens-no-prompt": Corruption(lambda a, draw: {"cu_seqlens": a["cu_seqlens"][:1]},
                                       r"cu_seqlens .* holds no prompt for \d+ tokens",
                                       nonempty=True),
    "max-seqlen-negative": Corruption(_max_seqlen_negative, "max_seqlen must be >= [01]"),
    "scale": scale_corruption("scale"),
    "cu-seqlens-start": Corruption(
        lambda a, draw: {"cu_seqlens": with_value(a["cu_seqlens"], 0, draw(
            st.integers(-(2**31), 2**31 - 1).filter(lambda start: start != 0)))},
        "cu_seqlens must start at 0, got", host_only=True),
    "cu-seqlens-decreasing": Corruption(_cu_seqlens_decreasing,
                                        "cu_seqlens must be non-decreasing", host_only=True,
                                        nonempty=True),
    "cu-seqlens-end": Corruption(_cu_seqlens_end, r"cu_seqlens must end at num_tokens \d+",
                                 host_only=True, nonempty=True),
    "max-seqlen-below-longest": Corruption(_max_seqlen_below_longest,
                                           r"max_seqlen \d+ is below the longest prompt",
                                           host_only=True, nonempty=True),
    **meta_corruptions(["out", "q", "k", "v", "cu_seqlens"]),
})


# ---------------------------------------------------------------------------------------------
# rms_norm and fused_add_rms_norm (``other`` is out or residual)

def norm_builder(other: str):
    def build(draw, generator, buffers, nonempty):
        dtype = draw(st.sampled_from(FLOAT_DTYPES))
        num_tokens = draw(st.integers(1 if nonempty else 0, 8))
        hidden = draw(st.integers(1, 64))
        weight = random_tensor((hidden,), draw(st.sampled_from([dtype, torch.float32])),
                               generator, scale=0.5) + 1.0
        rows = (num_tokens, hidden)
        values = {"input": random_tensor(rows, dtype, generator, scale=3.0),
                  other: (random_tensor(rows, dtype, generator, scale=3.0)
                          if other == "residual" else nan_tensor(rows, dtype, "cpu"))}
        arguments = {name: buffers.place(tensor, name, draw(st.integers(0, 3)))
                     for name, tensor in values.items()}
        return arguments | {"weight": buffers.place(weight, "weight"),
                            "epsilon": draw(st.floats(1e-6, 1e-2))}
    return build


def _norm_weight_dtype(a, draw):
    allowed = (a["input"].dtype, torch.float32)
    dtype = draw(st.sampled_from([dtype for dtype in (*FLOAT_DTYPES, torch.int32, torch.float64)
                                  if dtype not in allowed]))
    return {"weight": a["weight"].to(dtype)}


def norm_corruptions(other: str) -> dict[str, Corruption]:
    return {
        "activation-integer": Corruption(
            lambda a, draw: {name: a[name].to(torch.int32) for name in ("input", other)},
            "input dtype must be float32, float16 or bfloat16"),
        "weight-dtype": Corruption(_norm_weight_dtype,
                                   r"weight dtype must be the input's \(.*\) or float32"),
        f"{other}-dtype": Corruption(
            lambda a, draw: {other: a[other].to(other_float_dtype(draw, a["input"].dtype))},
            rf"{other} .* must match input"),
        f"{other}-shape": Corruption(
            lambda a, draw: {other: resized(a[other], 1, a[other].shape[1] + 1)},
            rf"{other} .* must match input"),
        "input-rank": Corruption(
            lambda a, draw: {"input": draw(st.sampled_from([a["input"].flatten(),
                                                            a["input"].unsqueeze(0)]))},
            r"input must be \[num_tokens, hidden\] and weight \[hidden\]"),
        "weight-shape": Corruption(
            lambda a, draw: {"weight": resized(a["weight"], 0, a["weight"].shape[0] + 1)},
            r"input must be \[num_tokens, hidden\] and weight \[hidden\]"),
        "epsilon-not-finite": scale_corruption("epsilon"),
        "epsilon-not-positive": Corruption(
            lambda a, draw: {"epsilon": draw(st.one_of(st.just(0.0), st.just(-0.0),
                                                       st.floats(-1e30, -1e-30)))},
            "epsilon must be > 0"),
        **meta_corruptions([other, "input", "weight"]),
    }


RMS_NORM = OpCases(norm_builder("out"), norm_corruptions("out"))
FUSED_ADD_RMS_NORM = OpCases(norm_builder("residual"), norm_corruptions("residual"))


# ---------------------------------------------------------------------------------------------
# rotary_embedding

def build_rotary_embedding(draw, generator, buffers, nonempty):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    num_tokens = draw(st.integers(1 if nonempty else 0, 8))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    max_positions = draw(st.integers(1, 64))
    positions = torch.randint(max_positions, (num_tokens,), generator=generator)
    if num_tokens and draw(st.booleans()):
        positions[-1] = max_positions - 1
    angles = torch.rand((max_positions, rotary_dim // 2), generator=generator) * 6.3
    arguments = {"positions": buffers.place(positions, "positions", draw(st.integers(0, 2)))}
    for name, heads in (("query", draw(st.integers(1, 4))), ("key", draw(st.integers(1, 2)))):
        arguments[name] = buffers.place(
            random_tensor((num_tokens, heads, head_dim), dtype, generator), name,
            draw(st.integers(0, 2)) * head_dim)
    cache = torch.cat((angles.cos(), angles.sin()), dim=1)
    return arguments | {"cos_sin_cache": buffers.place(cache, "cos_sin_cache",
                                                       draw(st.integers(0, 2)))}


def _rotary_cache_columns(a, draw):
    head_dim = min(a["query"].shape[2], a["key"].shape[2])
    columns = draw(st.one_of(st.just(a["cos_sin_cache"].shape[1] + 1),
                             st.integers(head_dim + 1, head_dim + 8)))
    return {"cos_sin_cache": resized(a["cos_sin_cache"], 1, columns)}


ROTARY_EMBEDDING = OpCases(build_rotary_embedding, {
    "positions-dtype": Corruption(
        lambda a, draw: {"positions": a["positions"].to(draw(st.sampled_from(
            [torch.int32, torch.float32])))},
        r"positions must be int64 \[num_tokens\]"),
    "positions-rank": Corruption(lambda a, draw: {"positions": a["positions"].unsqueeze(1)},
                                 r"positions must be int64 \[num_tokens\]"),
    "activation-integer": Corruption(
        lambda a, draw: {name: a[name].to(torch.int32) for name in ("query", "key")},
        "query dtype must be float32, float16 or bfloat16"),
    "key-dtype": Corruption(
        lambda a, draw: {"key": a["key"].to(other_float_dtype(draw, a["query"].dtype))},
        "key dtype .* differs from query dtype"),
    "query-rank": Corruption(lambda a, draw: {"query": a["query"].flatten(1)},
                             r"query \[T, H, D\] and key \[T, KVH, D\] must have T = \d+ tokens"),
    "key-tokens": Corruption(lambda a, draw: {"key": resized(a["key"], 0, a["key"].shape[0] + 1)},
                             r"query \[T, H, D\] and key \[T, KVH, D\] must have T = \d+ tokens"),
    "cache-rank": Corruption(lambda a, draw: {"cos_sin_cache": a["cos_sin_cache"].flatten()},
                             r"cos_sin_cache must be \[max_positions, rotary_dim\]"),
    "cache-columns": Corruption(_rotary_cache_columns,
                                r"cos_sin_cache must be \[max_positions, rotary_dim\] with an "
                                r"even rotary_dim <= head_dim"),
    "cache-dtype": Corruption(
        lambda a, draw: {"cos_sin_cache": a["cos_sin_cache"].to(draw(st.sampled_from(
            [torch.float16, torch.bfloat16, torch.float64])))},
        "cos_sin_cache must be float32"),
    "position-outside-cache": Corruption(
        lambda a, draw: {"positions": with_value(
            a["positions"], draw(st.integers(0, a["positions"].numel() - 1)),
            outside(draw, 0, a["cos_sin_cache"].shape[0]))},
        r"position -?\d+ of token \d+ is outside the cos_sin_cache's \d+ positions",
        host_only=True, nonempty=True),
    **meta_corruptions(["positions", "query", "key", "cos_sin_cache"]),
})


# ---------------------------------------------------------------------------------------------
# silu_and_mul

def build_silu_and_mul(draw, generator, buffers, nonempty):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    num_tokens = draw(st.integers(1 if nonempty else 0, 8))
    intermediate = draw(st.integers(1, 48))
    input = random_tensor((num_tokens, 2 * intermediate), dtype, generator, scale=3.0)
    return {"out": buffers.place(nan_tensor((num_tokens, intermediate), dtype, "cpu"), "out",
                                 draw(st.integers(0, 3))),
            "input": buffers.place(input, "input", draw(st.integers(0, 3)))}


SILU_AND_MUL = OpCases(build_silu_and_mul, {
    "activation-integer": Corruption(
        lambda a, draw: {name: a[name].to(torch.int64) for name in ("out", "input")},
        "input dtype must be float32, float16 or bfloat16"),
    "out-dtype": Corruption(
        lambda a, draw: {"out": a["out"].to(other_float_dtype(draw, a["input"].dtype))},
        r"out must be .* \[\d+, \d+\], got"),
    "out-shape": Corruption(lambda a, draw: {"out": resized(a["out"], 1, a["out"].shape[1] + 1)},
                            r"out must be .* \[\d+, \d+\], got"),
    "input-odd-width": Corruption(
        lambda a, draw: {"input": resized(a["input"], 1, a["input"].shape[1] + 1)},
        r"input must be \[num_tokens, 2 \* intermediate\]"),
    "input-rank": Corruption(lambda a, draw: {"input": a["input"].unsqueeze(0)},
                             r"input must be \[num_tokens, 2 \* intermediate\]"),
    **meta_corruptions(["out", "input"]),
})


CASES = {
    "paged_decode_attention": PAGED_DECODE_ATTENTION,
    "store_kv_cache": STORE_KV_CACHE,
    "swap_blocks": SWAP_BLOCKS,
    "prefill_attention": PREFILL_ATTENTION,
    "rms_norm": RMS_NORM,
    "fused_add_rms_norm": FUSED_ADD_RMS_NORM,
    "rotary_embedding": ROTARY_EMBEDDING,
    "silu_and_mul": SILU_AND_MUL,
}


# ---------------------------------------------------------------------------------------------
# The tests

def implementation_cases():
    """``pytest.param(op, implementation, device)`` for every implementation of every op."""
    return [pytest.param(op, *param.values, marks=param.marks, id=f"{op}-{param.id}")
            for op in neo.ops.OP_NAMES for param in implementation_params(op)]


def corruption_cases():
    """``pytest.param(op, implementation, device, corruption)``; value corruptions are left
    out for the CUDA kernels, which check no values."""
    return [pytest.param(*param.values, name, marks=param.marks, id=f"{param.id}-{name}")
            for param in implementation_cases()
            for name, corruption in CASES[param.values[0]].corruptions.items()
            if not (corruption.host_only and param.values[1].name == "cuda")]


def call(implementation, op: str, arguments: dict) -> None:
    names, _ = schema_arguments(op)
    implementation.function(*(arguments[name] for name in names))


def copies(arguments: dict) -> dict:
    """Copies of the tensor arguments; an argument passed twice stays one tensor."""
    copied = {}
    result = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            if id(value) not in copied:
                copied[id(value)] = value.clone()
            value = copied[id(value)]
        result[name] = value
    return result


def reference_of(op: str):
    return next(impl for impl in neo.ops.implementations(op) if impl.name == "reference")


def test_every_op_has_cases():
    assert set(CASES) == set(neo.ops.OP_NAMES)


@pytest.mark.parametrize(("op", "implementation", "device"), implementation_cases())
@VALID_SETTINGS
@given(data=st.data(), seed=SEEDS)
def test_valid_input(op, implementation, device, data, seed):
    """Valid arguments run, give the reference's result and write nothing else."""
    cases = CASES[op]
    buffers = Buffers(device)
    arguments = cases.build(data.draw, torch.Generator().manual_seed(seed), buffers,
                            data.draw(st.booleans()))
    expected = copies(arguments)
    call(implementation, op, arguments)
    call(reference_of(op), op, expected)
    _, mutated = schema_arguments(op)
    buffers.assert_unchanged(writable=mutated)
    for name in sorted(mutated):
        actual = arguments[name]
        if cases.exact:
            assert torch.equal(bits(actual.cpu()), bits(expected[name].cpu())), \
                f"{name} differs from the reference's"
        else:
            assert_close(actual, expected[name], actual.dtype, what=f"{name} vs reference")


@pytest.mark.parametrize(("op", "implementation", "device", "corruption"), corruption_cases())
@CORRUPTED_SETTINGS
@given(data=st.data(), seed=SEEDS)
def test_corrupted_input(op, implementation, device, corruption, data, seed):
    """Arguments with one thing broken are refused with an error naming the op and the
    problem, before anything is written."""
    cases = CASES[op]
    breaking = cases.corruptions[corruption]
    buffers = Buffers(device)
    nonempty = breaking.nonempty or data.draw(st.booleans())
    arguments = cases.build(data.draw, torch.Generator().manual_seed(seed), buffers, nonempty)
    arguments |= breaking.apply(arguments, data.draw)
    errors = (ValueError, RuntimeError) if implementation.native else ValueError
    with pytest.raises(errors) as caught:
        call(implementation, op, arguments)
    message = str(caught.value)
    assert message.startswith(f"neo.{op}: "), message
    assert re.search(breaking.phrase, message), f"{message!r} lacks {breaking.phrase!r}"
    buffers.assert_unchanged(writable=set())


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="CUDA is not available (torch.cuda.is_available() is False)")
def test_value_checks_are_skipped_during_cuda_graph_capture():
    """The reference rotary_embedding checks its positions on the host, except while a CUDA
    graph is being captured (a host read there would break the capture); the captured graph
    replays the rotation."""
    generator = torch.Generator().manual_seed(0)
    rotary = torch.ops.neo_reference.rotary_embedding
    angles = torch.rand((16, 8), generator=generator)
    cache = torch.cat((angles.cos(), angles.sin()), dim=1).cuda()
    query = random_tensor((3, 4, 16), torch.float32, generator, "cuda")
    key = random_tensor((3, 2, 16), torch.float32, generator, "cuda")
    with pytest.raises(ValueError, match="position 16 of token 1 is outside"):
        rotary(torch.tensor([0, 16, 2], device="cuda"), query, key, cache)
    positions = torch.tensor([0, 15, 2], device="cuda")
    expected = {name: tensor.clone() for name, tensor in (("query", query), ("key", key))}
    rotary(positions, expected["query"], expected["key"], cache)
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):  # warm-up outside the capture, as torch advises
        rotary(positions, query.clone(), key.clone(), cache)
    torch.cuda.current_stream().wait_stream(side_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary(positions, query, key, cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(query, expected["query"]) and torch.equal(key, expected["key"])
