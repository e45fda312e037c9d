"""``neo.swap_blocks``: every implementation, for every pair of source and destination devices,
against a block-by-block copy; blocks not in the mapping keep their contents."""

import itertools

import pytest
import torch

import neo.ops
from conftest import FLOAT_DTYPES, cuda_skip_reason, random_tensor

OP = "swap_blocks"

# one layer's K or V cache [num_blocks, num_kv_heads, block_size, head_dim], and any other
# block shape the op accepts
BLOCK_SHAPES = {"kv-2x16x64": (2, 16, 64), "kv-8x8x128": (8, 8, 128), "odd-7x5": (7, 5)}


def implementation_device_pairs():
    """``pytest.param(implementation, src_device, dst_device)``: each implementation with every
    (src, dst) device pair it serves. A call dispatches to CUDA when either tensor is on CUDA."""
    params = []
    for implementation in neo.ops.implementations(OP, available_only=False):
        for src_device, dst_device in itertools.product(("cpu", "cuda"), repeat=2):
            dispatch_device = "cuda" if "cuda" in (src_device, dst_device) else "cpu"
            if dispatch_device not in implementation.devices:
                continue
            reason = cuda_skip_reason(dispatch_device)
            if not implementation.available:
                reason = f"{implementation.name}: {implementation.note}"
            params.append(pytest.param(
                implementation, src_device, dst_device,
                marks=[pytest.mark.skip(reason=reason)] if reason else [],
                id=f"{implementation.name}-{src_device}-to-{dst_device}"))
    return params


PAIRS = implementation_device_pairs()


def random_mapping(num_pairs, num_src_blocks, num_dst_blocks, generator):
    """int64 [num_pairs, 2]: distinct random source blocks to distinct random destinations."""
    sources = torch.randperm(num_src_blocks, generator=generator)[:num_pairs]
    destinations = torch.randperm(num_dst_blocks, generator=generator)[:num_pairs]
    return torch.stack((sources, destinations), dim=1)


def check(implementation, src, dst, block_mapping):
    src_before = src.cpu().clone()
    expected = dst.cpu().clone()
    for source, destination in block_mapping.tolist():
        expected[destination] = src_before[source]
    implementation.function(src, dst, block_mapping)
    assert torch.equal(dst.cpu(), expected), "dst differs from the block-by-block copy"
    assert torch.equal(src.cpu(), src_before), "src changed"


@pytest.mark.parametrize("num_pairs", [1, 5, 12])
@pytest.mark.parametrize("block_shape", BLOCK_SHAPES.values(), ids=BLOCK_SHAPES.keys())
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "src_device", "dst_device"), PAIRS)
def test_matches_block_by_block_copy(implementation, src_device, dst_device, dtype, block_shape,
                                     num_pairs, generator):
    src = random_tensor((13, *block_shape), dtype, generator, src_device)
    dst = random_tensor((17, *block_shape), dtype, generator, dst_device)
    check(implementation, src, dst, random_mapping(num_pairs, 13, 17, generator))


@pytest.mark.parametrize(("implementation", "src_device", "dst_device"), PAIRS)
def test_empty_mapping(implementation, src_device, dst_device, generator):
    src = random_tensor((4, 2, 8, 64), torch.float16, generator, src_device)
    dst = random_tensor((4, 2, 8, 64), torch.float16, generator, dst_device)
    check(implementation, src, dst, torch.empty((0, 2), dtype=torch.int64))


# Blocks [B, 3, 2, 4, 8] as views of pools [*leading, B, ...] with the block dimension moved
# first, so a block is one row per leading index (the engine's whole pool has leading
# (layers, 2), one layer of it leading (2,)), against each other and against contiguous
# tensors. The mapping has runs of consecutive blocks.
POOL_LAYOUTS = {
    "pool-to-pool": ((3, 2), (3, 2)),
    "layer-to-layer": ((3,), (3,)),
    "contiguous-to-pool": (None, (3, 2)),
    "pool-to-contiguous": ((3, 2), None),
    "strided-blocks": ("every-other", "every-other"),
}
MAPPING_WITH_RUNS = [(0, 3), (1, 4), (2, 5), (7, 0), (9, 1), (10, 2), (4, 9), (6, 11), (12, 16)]


def blocks_laid_out(layout, num_blocks, dtype, generator, device):
    """Random ``[num_blocks, 3, 2, 4, 8]`` blocks laid out as ``layout`` says: a pool's leading
    dimensions, None for contiguous, or every other block of a twice longer tensor."""
    block_shape = (4, 8)
    if layout is None:
        return random_tensor((num_blocks, 3, 2, *block_shape), dtype, generator, device)
    if layout == "every-other":
        return random_tensor((2 * num_blocks, 3, 2, *block_shape), dtype, generator, device)[::2]
    pool = random_tensor((*layout, num_blocks, *((3, 2)[len(layout):]), *block_shape), dtype,
                         generator, device)
    return pool.movedim(len(layout), 0)


@pytest.mark.parametrize("layouts", POOL_LAYOUTS.values(), ids=POOL_LAYOUTS.keys())
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("implementation", "src_device", "dst_device"), PAIRS)
def test_pool_views_match_block_by_block_copy(implementation, src_device, dst_device, dtype,
                                              layouts, generator):
    src = blocks_laid_out(layouts[0], 13, dtype, generator, src_device)
    dst = blocks_laid_out(layouts[1], 17, dtype, generator, dst_device)
    check(implementation, src, dst, torch.tensor(MAPPING_WITH_RUNS, dtype=torch.int64))


BAD_INPUTS = {
    # name: (how to break (src, dst, block_mapping), phrase of the error, reads values)
    "src-block-past-end": (lambda s, d, m: (s, d, torch.tensor([[0, 1], [s.shape[0], 2]])),
                           r"src block \d+ in row 1 is outside", True),
    "dst-block-negative": (lambda s, d, m: (s, d, torch.tensor([[0, -1]])),
                           "dst block -1 in row 0 is outside", True),
    "dtype-mismatch": (lambda s, d, m: (s, d.double(), m), "must share dtype and block shape",
                       False),
    "block-shape-mismatch": (lambda s, d, m: (s, d[:, :1].contiguous(), m),
                             "must share dtype and block shape", False),
    "mapping-int32": (lambda s, d, m: (s, d, m.int()), r"block_mapping must be int64 \[n, 2\]",
                      False),
    "mapping-shape": (lambda s, d, m: (s, d, m[:, :1].contiguous()),
                      r"block_mapping must be int64 \[n, 2\]", False),
    "dst-inner-transposed": (lambda s, d, m: (s, d.transpose(2, 3).contiguous().transpose(2, 3), m),
                             "must each lay a block out as rows of one contiguous chunk", False),
    "dst-blocks-overlap": (lambda s, d, m: (s, d[:1].expand_as(d), m),
                           "must each lay a block out as rows of one contiguous chunk", False),
}


@pytest.mark.parametrize(("implementation", "src_device", "dst_device", "name"), [
    pytest.param(*param.values, name, marks=param.marks, id=f"{param.id}-{name}")
    for param in PAIRS for name, (_, _, reads_values) in BAD_INPUTS.items()
    if not (reads_values and param.values[0].name == "cuda")])
def test_bad_input_raises(implementation, src_device, dst_device, name, generator):
    breaking, phrase, _ = BAD_INPUTS[name]
    src = random_tensor((5, 2, 8, 64), torch.float32, generator, src_device)
    dst = random_tensor((6, 2, 8, 64), torch.float32, generator, dst_device)
    arguments = breaking(src, dst, random_mapping(3, 5, 6, generator))
    with pytest.raises((ValueError, RuntimeError), match=phrase):
        implementation.function(*arguments)


@pytest.mark.parametrize(("implementation", "src_device", "dst_device"),
                         [param for param in PAIRS if "cuda" in param.values[1:]])
def test_mapping_on_cuda_raises(implementation, src_device, dst_device, generator):
    src = random_tensor((5, 2, 8, 64), torch.float32, generator, src_device)
    dst = random_tensor((6, 2, 8, 64), torch.float32, generator, dst_device)
    mapping = random_mapping(3, 5, 6, generator).to("cuda")
    with pytest.raises((ValueError, RuntimeError), match="block_mapping must be a CPU tensor"):
        implementation.function(src, dst, mapping)
