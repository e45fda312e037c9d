"""``LLM.start_profile`` / ``stop_profile``: a ``torch.profiler`` timeline of a stretch of serving
from every rank (neo-tiny on the CPU; two ranks over gloo), ``neo bench``'s window of
iterations, and the server's routes."""

import json

import pytest

from engine_reference import BLOCK_BYTES, PROMPTS, gib_for_blocks
from neo import LLM, EngineConfig, SamplingParams
from neo.bench import run_offline_benchmark
from neo.runner.model_runner import ITERATION_LABEL
from server_harness import TINY_OPTIONS, live_server, post

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine_options(size: int, directory) -> dict:
    block_bytes = BLOCK_BYTES // size
    return dict(device="cpu", tensor_parallel_size=size, perf_model="zero", max_num_seqs=8,
                gpu_kv_cache_gib=gib_for_blocks(64, block_bytes), cpu_kv_cache_gib=gib_for_blocks(64, block_bytes),
                torch_profiler_dir=str(directory))


def operator_names(path) -> set[str]:
    """The names of the operators and labelled ranges a Chrome trace recorded on the host."""
    with open(path) as file:
        events = json.load(file)["traceEvents"]
    return {event["name"] for event in events if event.get("cat") in ("cpu_op", "user_annotation")}


@pytest.mark.parametrize("size", [1, 2])
def test_each_rank_writes_the_timeline_of_the_stretch(tmp_path, size):
    llm = LLM("neo-tiny", **engine_options(size, tmp_path))
    try:
        llm.generate(PROMPTS[:1], PARAMS)  # before the stretch: not recorded
        llm.start_profile()
        llm.generate(PROMPTS, PARAMS)
        paths = llm.stop_profile()
    finally:
        llm.close()  # the other ranks have written theirs once they exit
    assert paths == [str(tmp_path / f"trace-1-rank{rank}.json") for rank in range(size)]
    for path in paths:  # every rank ran the stretch's iterations, its GEMMs among them
        names = operator_names(path)
        assert ITERATION_LABEL in names and "aten::linear" in names, path


def test_profiling_needs_a_directory_and_a_stretch_started_once(tmp_path):
    llm = LLM("neo-tiny", device="cpu", perf_model="zero")
    try:
        with pytest.raises(ValueError, match="torch_profiler_dir"):
            llm.start_profile()
    finally:
        llm.close()
    llm = LLM("neo-tiny", **engine_options(1, tmp_path))
    try:
        with pytest.raises(RuntimeError, match="not recording"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already recording"):
            llm.start_profile()
        assert llm.stop_profile() == [str(tmp_path / "trace-1-rank0.json")]
        llm.start_profile()  # a second stretch, its own file
        assert llm.stop_profile() == [str(tmp_path / "trace-2-rank0.json")]
    finally:
        llm.close()


def test_a_stretch_left_recording_is_written_at_close(tmp_path):
    llm = LLM("neo-tiny", **engine_options(1, tmp_path))
    llm.start_profile()
    llm.generate(PROMPTS[:1], PARAMS)
    llm.close()
    assert "aten::linear" in operator_names(tmp_path / "trace-1-rank0.json")


def test_bench_records_the_window_of_iterations_it_is_given(tmp_path):
    config = EngineConfig(model="neo-tiny", **engine_options(1, tmp_path))
    result = run_offline_benchmark(config, "synthetic:input=16,output=12", 8, show_progress=False,
                                   profile_iterations=(3, 6))
    assert result["torch_profiler_traces"] == [str(tmp_path / "trace-1-rank0.json")]
    with open(tmp_path / "trace-1-rank0.json") as file:
        events = json.load(file)["traceEvents"]
    assert len([event for event in events if event.get("name") == ITERATION_LABEL]) == 4  # iterations 3 to 6
    with pytest.raises(ValueError, match="torch_profiler_dir"):
        run_offline_benchmark(EngineConfig(model="neo-tiny", device="cpu"), "synthetic:input=16,output=12", 2,
                              show_progress=False, profile_iterations=(1, 2))


def test_the_server_starts_and_stops_a_stretch_over_http(tmp_path):
    """vLLM's routes: ``POST /start_profile``, ``POST /stop_profile`` (which answers the files);
    a second start or a stop without a start is a 409 naming why; without a profiler directory
    the routes do not exist."""
    with live_server("neo-tiny", TINY_OPTIONS | {"torch_profiler_dir": str(tmp_path)}) as server:
        assert post(server, "/stop_profile", {}).status_code == 409
        assert post(server, "/start_profile", {}).json() == {"status": "recording"}
        again = post(server, "/start_profile", {})
        assert again.status_code == 409 and "already recording" in again.json()["error"]["message"]
        completion = post(server, "/v1/completions", dict(prompt=[1, 2, 3], max_tokens=4, temperature=0))
        assert completion.status_code == 200
        stopped = post(server, "/stop_profile", {})
        assert stopped.json() == {"status": "written", "traces": [str(tmp_path / "trace-1-rank0.json")]}
    assert ITERATION_LABEL in operator_names(tmp_path / "trace-1-rank0.json")
    with live_server("neo-tiny", TINY_OPTIONS) as server:
        assert post(server, "/start_profile", {}).status_code == 404
