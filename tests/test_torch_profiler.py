"""``LLM.start_profile`` / ``stop_profile``: a ``torch.profiler`` timeline of a stretch of serving
from every rank (neo-tiny on the CPU; two ranks over gloo), ``neo bench``'s window of
iterations, the server's routes, and ``benchmarks/timeline_summary.py`` over the traces."""

import json
import lzma

import pytest

from benchmark_modules import benchmark_module
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


def test_the_timeline_summary_counts_a_real_runs_iterations(tmp_path):
    """``benchmarks/timeline_summary.py`` over a CPU engine's trace (compressed as the GPU
    session leaves it): the stretch's iterations, and no GPU stream."""
    summary_module = benchmark_module("timeline_summary")
    llm = LLM("neo-tiny", **engine_options(1, tmp_path))
    try:
        llm.start_profile()
        llm.generate(PROMPTS[:2], PARAMS)
        path = llm.stop_profile()[0]
    finally:
        llm.close()
    with open(path, "rb") as source, lzma.open(path + ".xz", "wb") as target:
        target.write(source.read())
    summary = summary_module.summarize(path + ".xz")
    assert summary["iterations"]["count"] == PARAMS.max_tokens  # one prefill, then a decode per token
    assert summary["gpu_streams"] == {}
    assert "iterations: 6 launches" in summary_module.format_summary(path, summary)


def test_the_timeline_summary_splits_each_gpu_stream_by_kind(tmp_path):
    """Kernel and copy events as the profiler writes them for a GPU (Chrome trace "X" events with
    the device and stream in their arguments): busy time per stream by kind, and the NCCL
    kernels' count and durations."""
    def kernel(name, stream, start, duration, category="kernel"):
        return dict(ph="X", cat=category, name=name, pid=0, tid=stream, ts=start, dur=duration,
                    args=dict(device=0, stream=stream))

    events = [kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 7, 0, 3000),
              kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 7, 3000, 1000),
              kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 7, 4000, 1000),
              kernel("Memcpy DtoH (Device -> Pinned)", 13, 500, 250, category="gpu_memcpy"),
              kernel("neo::paged_decode_attention_kernel", 13, 1000, 500),
              dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", pid=1, tid=1, ts=0, dur=2000)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = benchmark_module("timeline_summary").summarize(str(path))
    main, side = summary["gpu_streams"]["device 0 stream 7"], summary["gpu_streams"]["device 0 stream 13"]
    assert main["span_ms"] == side["span_ms"] == pytest.approx(5.0)
    assert main["busy_ms_by_kind"] == {"gemm": pytest.approx(1.0), "nccl": pytest.approx(4.0)}
    assert (main["nccl_kernels"], main["nccl_mean_ms"], main["nccl_max_ms"]) == (2, pytest.approx(2.0),
                                                                                 pytest.approx(3.0))
    assert side["busy_ms_by_kind"] == {"attention": pytest.approx(0.5), "copy": pytest.approx(0.25)}
    assert summary["host_calls"]["thread 1"]["longest_calls"]["cudaGraphLaunch"]["max_ms"] == pytest.approx(2.0)


def test_the_timeline_summary_groups_graph_replays_by_their_launch(tmp_path):
    """A replayed graph's kernels land on the streams of its branches: the summary takes them out
    of the per-stream view and groups them by the ``cudaGraphLaunch`` whose correlation id they
    carry: replays per count of GPU operations, launch-to-start time, span and busy time."""
    def operation(name, stream, start, duration, launch, category="kernel"):
        return dict(ph="X", cat=category, name=name, pid=0, tid=stream, ts=start, dur=duration,
                    args=dict(device=0, stream=stream, correlation=launch))

    def launch(start, launch_id):
        return dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", pid=1, tid=1, ts=start, dur=10,
                    args=dict(correlation=launch_id))

    events = [launch(0, 1), operation("nvjet_sm90_tst_128x32", 900, 1000, 2000, 1),
              operation("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 901, 3000, 1000, 1),
              launch(10000, 2), operation("nvjet_sm90_tst_128x32", 902, 40000, 2000, 2),
              operation("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 903, 42000, 3000, 2),
              operation("neo::paged_decode_attention_kernel", 7, 50000, 500, 3)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary_module = benchmark_module("timeline_summary")
    summary = summary_module.summarize(str(path))
    assert list(summary["gpu_streams"]) == ["device 0 stream 7"]
    assert summary["gpu_streams"]["device 0 stream 7"]["busy_ms_by_kind"] == {"attention": pytest.approx(0.5)}
    replays = summary["graph_replays"]["graphs of 2 GPU operations"]
    assert replays["replays"] == 2
    assert (replays["mean_start_delay_ms"], replays["max_start_delay_ms"]) == (pytest.approx(15.5), pytest.approx(30.0))
    assert replays["mean_span_ms"] == pytest.approx(4.0)  # 3 and 5 ms
    assert replays["mean_busy_ms_by_kind"] == {"gemm": pytest.approx(2.0), "nccl": pytest.approx(2.0)}
    assert "graphs of 2 GPU operations: 2 replays, launch to start mean 15.50 ms (longest 30.00)" in \
        summary_module.format_summary(str(path), summary)


def test_the_timeline_summary_splits_a_host_batchs_layers_into_host_and_gpu_stages(tmp_path):
    """A host batch's replay copies the query, key and value to the host and the output back per
    layer: the time from the last copy to the host to the copy back is the layer's host stage,
    from the copy back to the next layer's first copy its GPU stage (with the batch's kernels'
    busy time in it). A replay whose copies do not come three to one (a swap) is left out."""
    def operation(name, start, duration, launch, category="kernel"):
        return dict(ph="X", cat=category, name=name, pid=0, tid=5, ts=start, dur=duration,
                    args=dict(device=0, stream=5, correlation=launch))

    def to_host(start):
        return operation("Memcpy DtoH (Device -> Pinned)", start, 10, 1, category="gpu_memcpy")

    def back(start):
        return operation("Memcpy HtoD (Pinned -> Device)", start, 10, 1, category="gpu_memcpy")

    layer_one = [operation("rms_norm", 0, 100, 1), to_host(100), to_host(110), to_host(120), back(1130)]
    # GPU stage of 860 us (1140 -> 2000), of which the batch's kernels ran 300 us
    layer_two = [operation("nvjet_gemm", 1200, 200, 1), operation("rms_norm", 1500, 100, 1),
                 to_host(2000), to_host(2010), to_host(2020), back(2530)]
    swap = [operation("Memcpy DtoH (Device -> Pinned)", 5000, 100, 2, category="gpu_memcpy"),
            operation("Memcpy HtoD (Pinned -> Device)", 5200, 100, 2, category="gpu_memcpy")]
    events = layer_one + layer_two + swap + [
        dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", pid=1, tid=1, ts=0, dur=10, args=dict(correlation=1)),
        dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", pid=1, tid=1, ts=4900, dur=10, args=dict(correlation=2))]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary_module = benchmark_module("timeline_summary")
    summary = summary_module.summarize(str(path))
    hand_offs = summary["host_hand_offs"]
    assert (hand_offs["replays"], hand_offs["layers"]) == (1, 2)
    assert hand_offs["median_host_stage_ms"] == pytest.approx(0.75)  # 1130 - 130 and 2530 - 2030 us
    assert hand_offs["median_gpu_stage_ms"] == pytest.approx(0.86)
    assert hand_offs["median_gpu_stage_busy_ms"] == pytest.approx(0.3)
    assert hand_offs["host_stage_share"] == pytest.approx(1.5 / 2.54)
    assert hand_offs["gpu_stage_share"] == pytest.approx(0.86 / 2.54)
    assert "host hand-offs: 2 layers in 1 replays" in summary_module.format_summary(str(path), summary)
