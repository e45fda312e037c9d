"""The host side of ``benchmarks/offload.py``: the host batches' decode rate and the K/V bytes a
host decode reads, from a real engine's trace (neo-tiny on the CPU, async host pipeline); and
the label each run is reported under."""

import contextlib
import dataclasses
from statistics import median as statistics_median

import pytest

from benchmark_modules import benchmark_module
from engine_reference import PROMPTS, gib_for_blocks
from neo import EngineConfig, LLMEngine, SamplingParams
from neo.config import HOST_PIPELINES
from neo.engine.metrics import IterationRecord


@pytest.fixture(scope="module")
def offload():
    return benchmark_module("offload")


@contextlib.contextmanager
def traced_engine(tmp_path, policy: str, gpu_blocks: int = 10, late_prompts: int = 0):
    """Yields (the run's records, the engine, still open); ``late_prompts`` more requests arrive
    after the third iteration (once neo decodes on the host here)."""
    engine = LLMEngine(EngineConfig(model="neo-tiny", device="cpu", policy=policy, host_pipeline="async",
                                    gpu_kv_cache_gib=gib_for_blocks(gpu_blocks), cpu_kv_cache_gib=gib_for_blocks(256),
                                    perf_model="zero", max_num_seqs=8, trace_path=str(tmp_path / "trace.json")))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    try:
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, params, request_id=str(index))
        late = (PROMPTS * late_prompts)[:late_prompts]
        while engine.has_unfinished_requests():
            engine.step()
            if late and engine.metrics.iterations >= 3:
                for index, prompt in enumerate(late):
                    engine.add_request(prompt, params, request_id=f"late-{index}")
                late = []
        yield [dataclasses.asdict(record) for record in engine.trace.records], engine
    finally:
        engine.close()


def traced_run(tmp_path, policy: str, gpu_blocks: int = 10,
               late_prompts: int = 0) -> tuple[list[dict], LLMEngine]:
    """The run's records and its engine, closed."""
    with traced_engine(tmp_path, policy, gpu_blocks, late_prompts) as (records, engine):
        return records, engine


def test_host_batches_decode_rate_and_kv_bytes_per_host_decode(offload, tmp_path):
    records, engine = traced_run(tmp_path, "neo")
    batches = [r for r in records if r["host_batch"]]
    assert batches, "the run made no host batch"
    longest = max(len(prompt) for prompt in PROMPTS) + 12
    for record in batches:  # every host decode attends over its prompt and the tokens it has
        assert record["host_decodes"] * min(map(len, PROMPTS)) <= record["host_context_tokens"] \
            <= record["host_decodes"] * longest
    layout = engine.kv_cache.layout
    bytes_per_token = layout.block_bytes // layout.block_size
    side = offload.host_side(records, bytes_per_token)
    tokens = sum(r["host_decodes"] for r in batches)
    seconds = sum(r["measured_seconds"] for r in batches)
    assert side["host_decode_tokens_per_s"] == pytest.approx(tokens / seconds)
    assert side["kv_bytes_per_host_token"] == pytest.approx(
        sum(r["host_context_tokens"] for r in batches) * bytes_per_token / tokens)
    assert side["host_kv_read_gbps"] == pytest.approx(side["kv_bytes_per_host_token"] * tokens / seconds / 1e9)
    attending = sum(r["host_busy_seconds"] for r in batches)
    assert 0 < attending <= seconds  # the host functions ran inside their batches' time
    assert side["host_attending_share"] == pytest.approx(attending / seconds)
    assert side["host_kv_read_gbps_attending"] == pytest.approx(side["host_kv_read_gbps"] * seconds / attending)


def test_no_host_batches_no_host_side(offload, tmp_path):
    records, _ = traced_run(tmp_path, "gpu-only")
    assert all(r["host_context_tokens"] == 0 for r in records)
    assert offload.host_side(records, 1024) is None


def test_each_iteration_says_whether_a_host_batch_was_in_flight(offload, tmp_path):
    """Under the async host pipeline every iteration's record says whether it was planned
    beside a host batch; gpu-only's say nothing. The statistics split the graph-replayed decodes
    (none replay on the CPU) and the prefills by it: milliseconds per 1000 prompt tokens."""
    records, _ = traced_run(tmp_path, "neo", gpu_blocks=6, late_prompts=3)
    iterations = [r for r in records if not r["host_batch"]]
    assert all(isinstance(r["beside_host_batch"], bool) for r in iterations)
    assert any(r["beside_host_batch"] for r in iterations if not r["prefill_tokens"])
    statistics = offload.trace_statistics(records)
    assert statistics["median_graph_decode_beside_host_batch_s"] is None
    assert statistics["median_graph_decode_alone_s"] is None
    for beside in (True, False):
        prefills = [r for r in iterations if r["prefill_tokens"] and r["beside_host_batch"] is beside]
        assert prefills, f"no prefill iteration {'beside' if beside else 'without'} a host batch"
        assert statistics[f"median_prefill_ms_per_1k_tokens_{'beside_host_batch' if beside else 'alone'}"] \
            == pytest.approx(statistics_median([1e6 * r["measured_seconds"] / r["prefill_tokens"] for r in prefills]))
    assert statistics["prefill_iterations_beside_host_batch"] == len(
        [r for r in iterations if r["prefill_tokens"] and r["beside_host_batch"]])
    records, _ = traced_run(tmp_path, "gpu-only", late_prompts=3)
    assert all(r["beside_host_batch"] is None for r in records)
    assert offload.trace_statistics(records)["median_prefill_ms_per_1k_tokens_alone"] is None


def test_each_host_batch_says_whether_a_prefill_ran_beside_it(offload, tmp_path):
    """Late prompts prefill while host batches are in flight: those batches are marked, the
    batches of the steady decodes are not, and iterations say nothing."""
    records, _ = traced_run(tmp_path, "neo", gpu_blocks=6, late_prompts=3)
    batches = [r for r in records if r["host_batch"]]
    assert all(isinstance(r["host_batch_beside_prefill"], bool) for r in batches)
    assert {r["host_batch_beside_prefill"] for r in batches} == {True, False}
    assert all(r["host_batch_beside_prefill"] is None for r in records if not r["host_batch"])
    statistics = offload.trace_statistics(records)
    assert statistics["host_batches_beside_prefill"] == sum(r["host_batch_beside_prefill"] for r in batches)
    # A zero perf model predicts nothing: no ratio to report.
    assert statistics["host_batch_median_host_measured_over_predicted"] is None
    assert statistics["host_batch_median_rest_measured_over_predicted"] is None


def host_batch_record(predicted: float, predicted_host: float, measured: float, host: float,
                      beside_prefill: bool) -> dict:
    """A host batch's trace record, as the engine writes it."""
    return dataclasses.asdict(IterationRecord(
        iteration=1, num_sub_batches=1, prefill_tokens=0, gpu_decodes=0, host_decodes=4,
        predicted_seconds=predicted, predicted_host_seconds=predicted_host, profiled_host_seconds=predicted_host,
        measured_seconds=measured, launch_seconds=0.0, queue_seconds=0.0, host_busy_seconds=host,
        gpu_busy_seconds=None, schedule_seconds=0.0, graph_replayed=True, host_batch=True,
        host_batch_wait_seconds=0.0, host_batch_beside_prefill=beside_prefill, host_context_tokens=4000))


def test_a_host_batch_prediction_splits_into_its_host_time_and_the_rest(offload):
    """Host time measured over predicted over every batch; the rest (the batch's seconds less
    its host time) over the batches beside no prefill, as the scheduler calibrates it."""
    records = [host_batch_record(0.10, 0.06, 0.12, 0.06, False),  # host 1.0, rest 1.5
               host_batch_record(0.10, 0.06, 0.14, 0.06, False),  # host 1.0, rest 2.0
               host_batch_record(0.10, 0.05, 0.20, 0.04, False),  # host 0.8, rest 3.2
               host_batch_record(0.10, 0.05, 1.00, 0.05, True)]  # host 1.0, beside a prefill
    statistics = offload.trace_statistics(records)
    assert statistics["host_batch_median_host_measured_over_predicted"] == pytest.approx(1.0)
    assert statistics["host_batch_median_rest_measured_over_predicted"] == pytest.approx(2.0)
    assert statistics["host_batches_beside_prefill"] == 1


def test_each_run_is_labelled_with_its_pipeline_and_return_order(offload):
    assert offload.policy_label(EngineConfig(policy="gpu-only")) == "gpu-only"
    labels = {offload.policy_label(EngineConfig(policy=policy, host_pipeline=pipeline))
              for policy in ("neo", "full-offload") for pipeline in HOST_PIPELINES}
    assert len(labels) == 2 * len(HOST_PIPELINES)  # one trace file per run
    assert offload.policy_label(EngineConfig(policy="neo", host_pipeline="lockstep")) == "neo/lockstep"
    assert offload.policy_label(EngineConfig(policy="neo", host_pipeline="auto")) == "neo/auto"
    assert offload.policy_label(EngineConfig(policy="neo")) == "neo/async"
    assert offload.policy_label(EngineConfig(policy="neo", return_order="most-remaining")) == "neo/async"
    assert offload.policy_label(EngineConfig(policy="neo", return_order="oldest")) == "neo/async/oldest"


def test_iterations_that_move_blocks_are_counted_with_their_blocks(offload, tmp_path):
    """gpu-only with a GPU pool too small for every request preempts to the host pool and
    brings requests back: each record counts the blocks its plan moved, and the statistics
    count the decode-only iterations among them (none replay a graph on the CPU)."""
    records, engine = traced_run(tmp_path, "gpu-only", gpu_blocks=6)
    metrics = engine.metrics
    assert metrics.blocks_swapped_out > 0 and metrics.blocks_swapped_in > 0
    assert sum(r["blocks_swapped"] for r in records) == metrics.blocks_swapped_out + metrics.blocks_swapped_in
    swapping = [r for r in records if r["blocks_swapped"] and not r["prefill_tokens"] and not r["host_decodes"]]
    statistics = offload.trace_statistics(records)
    assert statistics["swap_decode_iterations"] == len(swapping) > 0
    assert statistics["swap_decode_iterations_replayed"] == metrics.graph_swap_iterations == 0
    assert statistics["median_swap_decode_blocks"] == statistics_median([r["blocks_swapped"] for r in swapping])
