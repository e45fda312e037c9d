"""Engine start-up: the phase clock (``neo.engine.startup_phases``), the engine's summary of its
own construction, the decode graphs' batch sizes, and ``benchmarks/startup.py`` run as the lead
runs it (each policy in a fresh process), all on the CPU with neo-tiny."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from engine_reference import gib_for_blocks
from neo import LLM
from neo.engine.startup_phases import OTHER, TOTAL, StartupPhases
from neo.runner.decode_graphs import padded_batch_size, padded_batch_sizes
from neo.sched.graph_coverage import GraphCoverage

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_POOLS = dict(gpu_kv_cache_gib=gib_for_blocks(64), cpu_kv_cache_gib=gib_for_blocks(256))
ENGINE_PHASES = {"load model", "tokenizer", "KV budget", "KV pools", "host pipeline"}


def test_phases_accumulate_and_add_up_to_the_total():
    startup = StartupPhases(torch.device("cpu"))
    with startup.phase("first"):
        time.sleep(0.02)
    with startup.phase("second"):
        pass
    with startup.phase("first"):
        time.sleep(0.02)
    with pytest.raises(KeyError), startup.phase("failed"):
        raise KeyError("x")
    startup.note("second", "3 things")
    with pytest.raises(RuntimeError, match="still running"):
        startup.result()
    time.sleep(0.01)
    seconds = startup.finish()
    assert list(seconds) == ["first", "second", OTHER, TOTAL]
    assert seconds["first"] >= 0.04 and seconds[OTHER] >= 0.01
    assert seconds[TOTAL] == pytest.approx(sum(value for name, value in seconds.items() if name != TOTAL))
    assert startup.finish() == seconds  # the clock stopped once
    summary = startup.summary()
    assert summary.startswith(f"engine ready in {seconds[TOTAL]:.2f} s: first ")
    assert "second 0.00 s (3 things)" in summary and "failed" not in summary


@pytest.mark.parametrize("policy, phases", [("gpu-only", ENGINE_PHASES),
                                            ("neo", ENGINE_PHASES | {"perf model"})])
def test_engine_reports_every_phase_of_its_start(policy, phases, caplog):
    began = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="neo.engine.engine"):
        llm = LLM("neo-tiny", device="cpu", policy=policy, perf_model="zero", **TINY_POOLS)
    wall = time.perf_counter() - began
    try:
        seconds = llm.engine.startup_seconds
    finally:
        llm.close()
    assert set(seconds) == phases | {OTHER, TOTAL}
    assert all(value >= 0 for value in seconds.values())
    assert seconds[TOTAL] == pytest.approx(sum(value for name, value in seconds.items() if name != TOTAL))
    assert seconds[TOTAL] <= wall
    lines = [record.getMessage() for record in caplog.records if "engine ready in" in record.getMessage()]
    assert len(lines) == 1 and all(f"{phase} " in lines[0] for phase in phases | {OTHER})


@pytest.mark.parametrize("largest", list(range(1, 130)) + [255, 256, 257, 512, 1000, 2048])
def test_decode_graph_sizes_cover_every_batch_the_scheduler_forms(largest):
    """Every GPU decode count up to ``max_num_seqs`` replays a graph of at least its size that
    the runner's ``GraphCoverage`` admits, padded to the next power of two up to 4, then to the
    next multiple of 8 (or the largest size)."""
    sizes = padded_batch_sizes(largest)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == largest
    coverage = GraphCoverage(decode_max_requests=sizes[-1], max_blocks=4)
    for count in range(1, largest + 1):
        size = padded_batch_size(count, sizes)
        assert coverage.decode_graph(count, widest_blocks=4)
        if count <= 4:
            assert size == min(largest, 1 << (count - 1).bit_length())
        else:
            assert size == min(largest, -(-count // 8) * 8)
    assert not coverage.decode_graph(largest + 1, widest_blocks=4)
    with pytest.raises(ValueError, match=f"no captured batch size for {largest + 1} decodes"):
        padded_batch_size(largest + 1, sizes)


def test_decode_graph_sizes_refuse_an_empty_batch_limit():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        padded_batch_sizes(0)


def test_startup_benchmark_times_each_policy_in_a_fresh_process(tmp_path):
    output = tmp_path / "startup.json"
    engine_arguments = ["--model", "neo-tiny", "--device", "cpu", "--perf-model", "zero",
                        "--gpu-kv-cache-gib", str(TINY_POOLS["gpu_kv_cache_gib"]),
                        "--cpu-kv-cache-gib", str(TINY_POOLS["cpu_kv_cache_gib"])]
    completed = subprocess.run([sys.executable, os.path.join(REPOSITORY, "benchmarks", "startup.py"),
                                "--policies", "gpu-only,neo", "--output", str(output), "--", *engine_arguments],
                               capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(output.read_text())["results"]
    assert [result["policy"] for result in results] == ["gpu-only", "neo"]
    for result in results:
        assert set(result["imports"]) == {"import torch", "import neo"}
        assert ENGINE_PHASES <= set(result["engine"])
        assert result["process start to ready"] >= result["engine"][TOTAL] + sum(result["imports"].values())
    assert "perf model" in results[1]["engine"] and "perf model" not in results[0]["engine"]
    table = completed.stdout.splitlines()
    assert table[0].split() == ["phase", "(s)", "gpu-only", "neo"]
    assert {line.split("  ")[0] for line in table[1:]} >= ENGINE_PHASES | {"import torch", "engine total"}
