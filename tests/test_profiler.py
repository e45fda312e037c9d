"""The profiler measures a table the engine can load; the perf model interpolates it."""

import json

import pytest

from neo import EngineConfig, LLMEngine
from neo.cli import main as cli_main
from neo.request import KVLocation
from neo.runner.profiler import Profiler
from neo.sched.cost import StageTimes
from neo.sched.perf_model import PerfModel, PerfTable, interpolate
from neo.sched.scheduler_output import SchedulerOutput, SubBatch
from neo.sched.stage_order import ASYMMETRIC, SEQUENTIAL

SMALL = dict(gpu_kv_cache_gib=0.005, cpu_kv_cache_gib=0.02, max_num_batched_tokens=256, max_num_seqs=16)


def test_interpolate_is_piecewise_linear_and_extrapolates():
    xs, ys = [1, 3, 7], [10.0, 30.0, 50.0]
    assert interpolate(xs, ys, 2) == pytest.approx(20.0)
    assert interpolate(xs, ys, 5) == pytest.approx(40.0)
    assert interpolate(xs, ys, 9) == pytest.approx(60.0)
    assert interpolate(xs, ys, 0) == pytest.approx(0.0)
    assert interpolate([4], [8.0], 2) == pytest.approx(4.0)


def test_host_attention_is_bilinear():
    table = PerfTable(host_attention_requests=[1, 5], host_attention_tokens=[[100, 300], [100, 300]],
                      host_attention_seconds=[[1.0, 3.0], [2.0, 4.0]])
    model = PerfModel(table)
    assert model.host_attention(3, 200) == pytest.approx(2.5)
    assert model.host_attention(0, 200) == 0.0


def test_graph_decode_adds_the_extra_attention_of_longer_contexts():
    table = PerfTable(gpu_attention_tokens=[100, 1100], gpu_attention_seconds=[1.0, 2.0],
                      graph_decode_requests=[1, 9], graph_decode_seconds=[5.0, 9.0], graph_decode_context=50)
    model = PerfModel(table)
    assert model.graph_decode(5, 250) == pytest.approx(7.0)  # the profiled context: the table alone
    assert model.graph_decode(5, 850) == pytest.approx(7.6)  # + attention(850) - attention(250)
    assert model.graph_decode(5, 100) == pytest.approx(7.0)  # shorter contexts cost no less
    assert model.graph_decode(10, 500) is None  # beyond the largest captured batch
    assert PerfModel(PerfTable()).graph_decode(1, 1) is None


def test_two_sub_batch_iterations_take_the_graph_overhead_for_graph_replays():
    table = PerfTable(pipeline_overhead=0.4, pipeline_graph_overhead=-0.1, iteration_overhead=0.05)
    model = PerfModel(table)

    def times(host0: float) -> list[StageTimes]:
        return [StageTimes(1.0, 0.5, host0), StageTimes(1.0, 0.0, 0.3)]

    # max(linear1 + o/2, host0) + max(linear0 + gpu0 + o/2, host1) + iteration overhead
    assert model.iteration_time(ASYMMETRIC, times(0.2)) == pytest.approx(1.2 + 1.7 + 0.05)
    assert model.iteration_time(ASYMMETRIC, times(0.2), graphed=True) == pytest.approx(0.95 + 1.45 + 0.05)
    assert model.iteration_time(ASYMMETRIC, times(2.0), graphed=True) == pytest.approx(2.0 + 1.45 + 0.05)
    assert model.iteration_time(ASYMMETRIC, times(0.2), graphed=True, launch_overhead=0.0) == pytest.approx(2.55)
    # One sub-batch: the iteration overhead alone.
    assert model.iteration_time(SEQUENTIAL, times(0.2)[:1], graphed=True) == pytest.approx(1.7 + 0.05)


@pytest.mark.parametrize("measured, lowest, expected", [(3.0, 0.0, 0.8), (2.0, 0.0, 0.0), (2.0, -2.0, -0.2)])
def test_pipeline_overhead_makes_the_model_meet_the_measured_time(measured, lowest, expected):
    """The overhead solved for a measured two-sub-batch iteration; one faster than its stages
    add up to gets a negative overhead where allowed (graph replays), else none."""
    model = PerfModel(PerfTable())
    times = [StageTimes(1.0, 0.2, 0.1), StageTimes(1.0, 0.0, 0.1)]  # 2.2 s of stages, host attention hidden
    assert Profiler._overhead_for(model, ASYMMETRIC, times, measured, lowest) == pytest.approx(expected, abs=1e-9)


def test_profile_command_writes_a_table_the_engine_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "perf.json"
    arguments = ["profile", "--model", "neo-tiny", "--output", str(path), "--gpu-kv-cache-gib",
                 str(SMALL["gpu_kv_cache_gib"]), "--cpu-kv-cache-gib", str(SMALL["cpu_kv_cache_gib"]),
                 "--max-num-batched-tokens", "256", "--max-num-seqs", "16"]
    assert cli_main(arguments) == 0
    table = json.loads(path.read_text())
    assert table["key"]["model_shape"][0] == "LlamaForCausalLM"
    for name in ("linear", "gpu_attention", "prefill"):
        seconds = table[f"{name}_seconds"]
        assert seconds and all(value > 0 for value in seconds), name
    assert all(value > 0 for row in table["host_attention_seconds"] for value in row)
    assert table["graph_decode_requests"] == []  # no CUDA graphs on the CPU
    engine = LLMEngine(EngineConfig(policy="neo", perf_model=str(path), **SMALL))
    try:
        model = engine.scheduler.estimates.perf_model
        assert not model.is_zero and model.linear(256) == pytest.approx(table["linear_seconds"][-1])
    finally:
        engine.close()


def test_auto_profiles_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))
    first = LLMEngine(EngineConfig(policy="full-offload", perf_model="auto", **SMALL))
    first.close()
    cached = list((tmp_path / "perf").glob("*.json"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    second = LLMEngine(EngineConfig(policy="neo", perf_model="auto", **SMALL))
    second.close()
    assert cached[0].stat().st_mtime_ns == stamp, "the second engine profiled again"


def test_cached_table_is_profiled_again_only_for_an_engine_it_does_not_cover(tmp_path, monkeypatch):
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))

    def profile_stamp(max_num_seqs: int) -> tuple[int, list]:
        engine = LLMEngine(EngineConfig(policy="neo", perf_model="auto", **{**SMALL, "max_num_seqs": max_num_seqs}))
        engine.close()
        (path,) = (tmp_path / "perf").glob("*.json")
        return path.stat().st_mtime_ns, PerfTable.load(str(path)).host_attention_requests

    first, requests = profile_stamp(8)
    assert requests == [1, 8]
    second, requests = profile_stamp(64)  # up to 64 host requests are beyond the cached table
    assert second != first and requests == [1, 8, 32, 64]
    third, requests = profile_stamp(8)  # the larger table covers the smaller engine
    assert third == second and requests == [1, 8, 32, 64]


def test_a_rebuilt_kernel_is_profiled_again(tmp_path, monkeypatch):
    """The table key holds the compiled kernels' fingerprints: a table measured with other
    builds is not reused."""
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("neo.runner.profiler.build_fingerprints", lambda: {"ispc": "0123456789abcdef"})
    LLMEngine(EngineConfig(policy="neo", perf_model="auto", **SMALL)).close()
    (first,) = (tmp_path / "perf").glob("*.json")
    assert PerfTable.load(str(first)).key["kernels"] == {"ispc": "0123456789abcdef"}
    monkeypatch.setattr("neo.runner.profiler.build_fingerprints", lambda: {"ispc": "fedcba9876543210"})
    LLMEngine(EngineConfig(policy="neo", perf_model="auto", **SMALL)).close()
    tables = sorted((tmp_path / "perf").glob("*.json"))
    assert len(tables) == 2 and {PerfTable.load(str(path)).key["kernels"]["ispc"] for path in tables} == {
        "0123456789abcdef", "fedcba9876543210"}


@pytest.mark.parametrize("max_model_len", [64, 300])
def test_profiles_within_the_models_context(tmp_path, monkeypatch, max_model_len):
    """Every position the profiler draws is inside the rotary table of a short context."""
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))
    engine = LLMEngine(EngineConfig(policy="neo", perf_model="auto", max_model_len=max_model_len, **SMALL))
    try:
        assert not engine.scheduler.estimates.perf_model.is_zero
    finally:
        engine.close()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_table_is_keyed_by_whether_the_engine_schedules_ahead(tmp_path, monkeypatch, async_scheduling):
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))
    engine = LLMEngine(EngineConfig(policy="neo", perf_model="zero", async_scheduling=async_scheduling, **SMALL))
    try:
        key = engine.profiler.key()
        assert engine.profiler.schedules_ahead is async_scheduling
        assert ("schedules_ahead" in key) is (not async_scheduling)
    finally:
        engine.close()


def test_iterations_timed_ahead_are_launched_before_the_one_before_is_read(tmp_path, monkeypatch):
    """``Profiler._time_ahead`` runs a plan as async scheduling does: after a warm-up, every
    read has the next iteration already queued behind it, and every launch is read once."""
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))
    engine = LLMEngine(EngineConfig(policy="neo", perf_model="zero", async_scheduling=True, **SMALL))
    profiler, runner = engine.profiler, engine.runner
    events, in_flight = [], []
    launch, collect = runner.launch, runner.collect

    def counted_launch(*args, **kwargs):
        launched = launch(*args, **kwargs)
        in_flight.append(launched)
        events.append(("launch", len(in_flight)))
        return launched

    def counted_collect(launched):
        events.append(("collect", len(in_flight)))
        in_flight.remove(launched)
        return collect(launched)

    monkeypatch.setattr(runner, "launch", counted_launch)
    monkeypatch.setattr(runner, "collect", counted_collect)
    requests = profiler.allocate_requests(KVLocation.GPU, [5, 9, 17])
    try:
        plan = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=requests)], stage_order=SEQUENTIAL)
        seconds = profiler._time_ahead(plan, iterations=4)
        assert 0 < seconds < float("inf")
        timed = events[2:]  # after the warm-up's launch and read
        assert len(timed) == profiler.repeats * 2 * (4 + 2)
        assert not in_flight
        collects = [depth for kind, depth in timed if kind == "collect"]
        assert len(collects) == profiler.repeats * (4 + 2)
        # Every read but the last of each repeat has the next launch queued: two in flight.
        assert collects == ([2] * (4 + 1) + [1]) * profiler.repeats
        assert all(r.num_cached_tokens == r.num_tokens - 1 for r in requests)  # the requests are left as they were
    finally:
        profiler.free_requests(requests)
        engine.close()



def test_host_attention_points_are_measured_in_rounds(tmp_path, monkeypatch):
    """Every point once per round, the first round a warm-up (not counted); a point's time is
    the median of the later rounds, so one slow spell that falls into a single round does not
    move it.
    Points whose lengths the model caps to the same total are measured once."""
    monkeypatch.setenv("NEO_CACHE_DIR", str(tmp_path))
    engine = LLMEngine(EngineConfig(policy="neo", perf_model="zero", max_model_len=1024, **SMALL))
    profiler = engine.profiler
    visits = []

    class Progress:
        steps = 0

        def update(self, steps):
            self.steps += steps

    try:
        request_points, context_points = [1, 4], [256, 2048, 4096]
        rows = profiler._host_points(request_points, context_points)
        assert rows == [[[256], [1023]], [[64] * 4, [512] * 4, [1023] * 4]]  # 2048 and 4096 capped alike
        points = [lengths for row in rows for lengths in row]
        # 100x too slow: the warm-up round, and the first point of the second timed round
        slow_visits = set(range(1, len(points) + 1)) | {2 * len(points) + 1}

        def host_attention(lengths):
            visits.append(lengths)
            return (100.0 if len(visits) in slow_visits else 1.0) * sum(lengths)

        monkeypatch.setattr(profiler, "_host_attention", host_attention)
        progress = Progress()
        tokens, seconds = profiler._host_attention_table(rows, progress)
        assert visits == points * (profiler.repeats + 1)
        assert progress.steps == len(visits)
        assert tokens == [[256, 1023], [256, 2048, 4092]]
        assert seconds == [[float(t) for t in row] for row in tokens]
    finally:
        engine.close()
