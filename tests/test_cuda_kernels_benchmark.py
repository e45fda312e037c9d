"""``benchmarks/cuda_kernels.py``'s command line, on the CPU: the decode points and variants it
takes, and the errors that name what is wrong."""

import argparse
import re

import pytest
import torch

from benchmark_modules import benchmark_module

cuda_kernels = benchmark_module("cuda_kernels")


def test_points_parse_as_sequences_by_context():
    point = cuda_kernels.DecodePoint
    assert cuda_kernels.parse_points("256x128, 64x4096") == [point(((256, 128),)),
                                                             point(((64, 4096),))]


def test_a_mixed_point_in_a_wider_table():
    (mixed, wide) = cuda_kernels.parse_points("63x1024+1x4096,64x1088@2112")
    assert mixed.groups == ((63, 1024), (1, 4096)) and mixed.table_tokens == 0
    assert mixed.lengths == [1024] * 63 + [4096]
    assert (mixed.num_seqs, mixed.kv_tokens, mixed.table_width) == (64, 63 * 1024 + 4096, 4096)
    assert mixed.label == "63x1024+1x4096"
    assert (wide.num_seqs, wide.table_width, wide.label) == (64, 2112, "64x1088@2112")
    # A width that is not whole blocks is rounded up to them.
    assert cuda_kernels.parse_points("2x100@1000")[0].table_width == 1008


@pytest.mark.parametrize("text", ["256", "0x128", "256x0", "ax1", "12x", "256x128,",
                                  "1x64+", "1x64++2x32", "+1x64"])
def test_a_malformed_point_is_named(text):
    bad = text.split(",")[-1].strip()
    message = f"'{re.escape(bad)}' is not a decode point"
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        cuda_kernels.parse_points(text)


@pytest.mark.parametrize("text", ["64x1088@", "64x1088@1000", "64x1088@a"])
def test_a_table_narrower_than_the_longest_sequence_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="at least the longest context"):
        cuda_kernels.parse_points(text)


def test_variants_without_a_sweep_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cuda_kernels.main(["--variants", "w4_l8_p1024_pv_tc"])
    assert exit_info.value.code == 2
    assert "--variants selects among the variants of --sweep" in capsys.readouterr().err


@pytest.mark.parametrize("block_order", cuda_kernels.BLOCK_ORDERS)
def test_block_tables_name_every_block_once_in_their_order(block_order):
    point = cuda_kernels.DecodePoint(((2, 40), (1, 70)), table_tokens=96, block_order=block_order)
    table = cuda_kernels.block_table(point, torch.Generator().manual_seed(0), "cpu")
    blocks = [3, 3, 5]  # 40 and 70 tokens in blocks of 16
    assert table.shape == (3, 6) and table.dtype == torch.int32
    used = torch.cat([table[row, :count] for row, count in enumerate(blocks)])
    assert sorted(used.tolist()) == list(range(sum(blocks)))
    assert all((table[row, count:] == 0).all() for row, count in enumerate(blocks))
    if block_order == "sequential":
        assert used.tolist() == list(range(sum(blocks)))


def test_an_unknown_block_order_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cuda_kernels.main(["--block-order", "interleaved"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'interleaved'" in capsys.readouterr().err
