"""``benchmarks/cpu_core_rate.py``: the calls it times and its table, on this machine's CPU
kernels."""

import sys

import pytest
import torch

import neo.ops
from benchmark_modules import benchmark_module
from neo.ops import reference


@pytest.fixture(scope="module")
def core_rate():
    return benchmark_module("cpu_core_rate")


def recording(calls: list):
    def function(out, q, k_cache, v_cache, block_table, seq_lens, scale):
        calls.append(block_table.clone())
        reference.paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale)
        assert torch.isfinite(out).all()
    return function


def test_a_ring_call_reads_each_sequence_in_turn_over_its_own_blocks(core_rate):
    calls = []
    context = 40  # 3 blocks of 16
    sequence_bytes = 2 * 3 * 8 * core_rate.BLOCK_SIZE * core_rate.HEAD_DIM * 2
    call, nbytes, rounds = core_rate.kernel_call(recording(calls), 32, 8, context,
                                                 4 * sequence_bytes + 1,
                                                 torch.Generator().manual_seed(0))
    assert nbytes == sequence_bytes and rounds == 4
    for _ in range(5):
        call()
    tables = [sorted(table.flatten().tolist()) for table in calls]
    assert tables[:4] == [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(4)]
    assert tables[4] == tables[0]


def test_an_l2_call_rereads_one_sequence(core_rate):
    calls = []
    call, _, rounds = core_rate.kernel_call(recording(calls), 40, 8, 16, 0,
                                            torch.Generator().manual_seed(0))
    call()
    call()
    assert rounds == 1 and torch.equal(calls[0], calls[1])


@pytest.mark.parametrize("implementation", [
    impl.name for impl in neo.ops.implementations("paged_decode_attention", "cpu")])
def test_the_table_has_a_row_per_source_heads_and_process_count(core_rate, monkeypatch, capsys,
                                                                implementation):
    monkeypatch.setattr(sys, "argv", ["cpu_core_rate.py", "--processes", "1", "--heads",
                                      "32/8,40/8", "--context", "32", "--ring-mib", "2",
                                      "--seconds", "0.05", "--implementation", implementation])
    monkeypatch.setattr(core_rate, "WARMUP_CALLS", 1)
    core_rate.main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [row[:3] for row in rows] == [["L2", "32/8", "1"], ["L2", "40/8", "1"],
                                         ["DRAM", "32/8", "1"], ["DRAM", "40/8", "1"],
                                         ["sum", "-", "1"]]
    assert all(float(row[3]) > 0 and float(row[5]) == pytest.approx(float(row[3]), rel=0.01)
               for row in rows)


@pytest.mark.parametrize("arguments", [["--processes", "0"], ["--sources", "L3"],
                                       ["--implementation", "cuda"], ["--seconds", "0"]])
def test_bad_arguments_are_refused(core_rate, monkeypatch, arguments):
    monkeypatch.setattr(sys, "argv", ["cpu_core_rate.py", *arguments])
    with pytest.raises(SystemExit):
        core_rate.main()



def test_a_process_that_fails_stops_the_point_with_its_exit_code(core_rate, monkeypatch):
    """The last process exits before the barrier; the others, left waiting there, are stopped."""
    cpus = sorted(core_rate.os.sched_getaffinity(0))[:2]
    measure_one = core_rate.run_process

    def failing_on_the_last(cpu, *arguments):
        if cpu == cpus[-1]:
            raise SystemExit(3)
        measure_one(cpu, *arguments)

    monkeypatch.setattr(core_rate, "run_process", failing_on_the_last)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        core_rate.measure(cpus, "L2", (32, 8), 32, 0, "reference", 0.05)
