"""``benchmarks/host_kernel_alone.py``: a run's host batches replayed through the host's attention
kernel alone, on a real engine (neo-tiny on the CPU, async host pipeline) right after its run."""

import pytest

from benchmark_modules import benchmark_module
from test_offload_host_side import traced_engine


@pytest.fixture(scope="module")
def alone():
    return benchmark_module("host_kernel_alone")


def test_equal_lengths_sum_to_the_batch_context(alone):
    assert alone.equal_lengths(10, 3) == [4, 3, 3]
    assert alone.equal_lengths(9, 3) == [3, 3, 3]
    assert sum(alone.equal_lengths(1001, 7)) == 1001


def test_samples_spread_over_the_run_and_skip_batches_without_host_work(alone):
    records = [{"iteration": index, "host_batch": index % 2 == 0, "host_decodes": 2, "host_busy_seconds": 0.1}
               for index in range(40)]
    records.append({"iteration": 40, "host_batch": True, "host_decodes": 0, "host_busy_seconds": 0.0})
    batches = [r for r in records if r["host_batch"] and r["host_decodes"]]
    assert alone.sample_batches(records, 100) == batches
    sampled = alone.sample_batches(records, 4)
    assert [r["iteration"] for r in sampled] == [0, 10, 20, 30]


def test_a_runs_host_batches_replayed_alone(alone, tmp_path):
    """The engine's time is the sampled batches' host-function time; alone, their shapes read
    the same K/V bytes (context tokens times the pool's bytes per token) in the time measured."""
    with traced_engine(tmp_path, "neo") as (records, engine):
        result = alone.replay_host_batches(engine, records, samples=3)
        sampled = alone.sample_batches(records, 3)
        layout = engine.kv_cache.layout
    assert result["batches"] == len(sampled) == 3
    assert result["engine_seconds"] == pytest.approx(sum(r["host_busy_seconds"] for r in sampled))
    assert result["alone_seconds"] > 0
    assert result["engine_over_alone"] == pytest.approx(result["engine_seconds"] / result["alone_seconds"])
    kv_bytes = sum(r["host_context_tokens"] for r in sampled) * layout.block_bytes // layout.block_size
    assert result["kv_read_gbps_alone"] == pytest.approx(kv_bytes / result["alone_seconds"] / 1e9)
    assert result["kv_read_gbps_engine"] == pytest.approx(kv_bytes / result["engine_seconds"] / 1e9)


def test_no_host_batches_nothing_to_replay(alone, tmp_path):
    with traced_engine(tmp_path, "gpu-only") as (records, engine):
        assert alone.replay_host_batches(engine, records) is None
