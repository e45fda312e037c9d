"""The token-interval benchmark (benchmarks/interval_frontier.py) end to end on the tiny model:
every pipeline's points, their ratios to the gpu-only point and the best point within each bound."""

import json

import pytest

from benchmark_modules import benchmark_module



@pytest.fixture(scope="module")
def frontier():
    return benchmark_module("interval_frontier")


def test_every_pipeline_measures_each_host_count(frontier, tmp_path):
    path = tmp_path / "frontier.json"
    assert frontier.main(["--model", "neo-tiny", "--device", "cpu", "--dtype", "float32", "--gpu-kv-cache-gib",
                          "0.004", "--cpu-kv-cache-gib", "0.05", "--context", "60", "--host-requests", "1,3",
                          "--repeats", "2", "--host-batches", "2", "--intervals-ms", "0.001,1e6",
                          "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert set(report["pipelines"]) == {"lockstep", "async"}
    for pipeline, points in report["pipelines"].items():
        baseline, *with_host = points
        assert baseline["pipeline"] == "gpu-only" and baseline["ratio_to_gpu_only"] == 1.0
        assert baseline["replayed_graph"] is False  # no CUDA graphs on the CPU
        assert [entry["host_requests"] for entry in with_host] == [1, 3]
        for entry in with_host:
            assert entry["pipeline"] == pipeline and entry["gpu_requests"] == baseline["gpu_requests"] > 0
            assert entry["ratio_to_gpu_only"] == pytest.approx(entry["tokens_per_second"]
                                                               / baseline["tokens_per_second"])
            assert entry["max_interval_ms"] == max(entry["gpu_interval_ms"], entry["host_interval_ms"]) > 0
            assert entry["mean_interval_ms"] == pytest.approx(
                1e3 * (entry["gpu_requests"] + entry["host_requests"]) / entry["tokens_per_second"])
            assert pipeline == "lockstep" or entry["host_batch_ms"] > 0
    every_point = [entry for points in report["pipelines"].values() for entry in points]
    assert report["best_within"]["0.001"] is None
    assert report["best_within"]["1000000.0"]["ratio_to_gpu_only"] == max(
        entry["ratio_to_gpu_only"] for entry in every_point)


def test_a_pool_too_small_for_the_host_requests_is_named(frontier):
    with pytest.raises(SystemExit, match="host blocks.*raise --cpu-kv-cache-gib"):
        frontier.main(["--model", "neo-tiny", "--device", "cpu", "--dtype", "float32", "--gpu-kv-cache-gib",
                       "0.004", "--cpu-kv-cache-gib", "0.001", "--context", "60", "--host-requests", "64",
                       "--pipelines", "async"])


def test_unknown_pipeline_is_refused(frontier):
    with pytest.raises(SystemExit):
        frontier.main(["--pipelines", "sideways"])
