"""``benchmarks/cpu_call_cost.py``: the arguments it builds and its table, on this machine's CPU
kernels."""

import sys

import pytest
import torch

import neo.ops
from benchmark_modules import benchmark_module
from neo.ops import reference


@pytest.fixture(scope="module")
def call_cost():
    return benchmark_module("cpu_call_cost")


def test_arguments_are_a_valid_call_over_distinct_blocks(call_cost):
    out, q, k_cache, v_cache, block_table, seq_lens, scale = call_cost.arguments_for(
        3, 40, torch.Generator().manual_seed(0))
    assert q.shape == (3, call_cost.NUM_HEADS, call_cost.HEAD_DIM) and q.dtype == torch.bfloat16
    assert k_cache.shape == (9, call_cost.NUM_KV_HEADS, call_cost.BLOCK_SIZE, call_cost.HEAD_DIM)
    assert block_table.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert seq_lens.tolist() == [40, 40, 40]
    reference.paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale)
    assert torch.isfinite(out).all()


def test_the_table_has_a_row_per_thread_count_and_a_cell_per_kernel_and_shape(call_cost,
                                                                               monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["cpu_call_cost.py", "--threads", "1", "--calls", "3"])
    monkeypatch.setattr(call_cost, "WARMUP_CALLS", 1)
    threads = torch.get_num_threads()
    try:
        call_cost.main()
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.splitlines()
    kernels = [impl.name for impl in neo.ops.implementations("paged_decode_attention", "cpu")
               if impl.name != "reference"]
    header = lines[1].split()
    assert header[0] == "threads" and header[1:] == [
        part for name in kernels for shape in call_cost.SHAPES for part in (name, shape)]
    row = lines[2].split()
    assert row[0] == "1" and len(row) == 1 + 3 * len(kernels) * len(call_cost.SHAPES)
    medians_and_fastest = [float(cell) for cell in row[1:] if cell != "/"]
    assert all(value > 0 for value in medians_and_fastest)


def test_thread_counts_below_one_are_refused(call_cost, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cpu_call_cost.py", "--threads", "0"])
    with pytest.raises(SystemExit):
        call_cost.main()
