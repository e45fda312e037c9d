"""Async scheduling (``EngineConfig.async_scheduling``) in float32: iteration k+1 is
planned and launched before iteration k's tokens are read, so each step returns the tokens of
the iteration before, and a request that stops has one more token computed and dropped.

The tokens of a mixed batch (different ``max_tokens``, stop token ids, stop strings,
``min_tokens``, an abort mid-run, seeded sampling at temperature > 0, parallel sampling, and
requests with penalties or log-probabilities, which take the synchronous order) must equal those
of the synchronous engine, under gpu-only and neo, on the CPU and on CUDA where it is present,
with a GPU pool large enough for all and one so small that requests are preempted or decode on
the host; every KV block must be free again afterwards; greedy tokens must equal transformers'.
"""

import time

import pytest
import torch

from conftest import cuda_skip_reason
from engine_reference import NEW_TOKENS, PROMPTS, gib_for_blocks, greedy_continuations, transformers_tiny
from mixed_batch import ABORTED_AT, assert_all_blocks_free, engine_for, make_mixed_requests, run_mixed
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.request import KVLocation, Request
from neo.sched.runner_output import UNRESOLVED_TOKEN
from neo.sched.scheduler_output import SchedulerOutput, SubBatch


@pytest.fixture(scope="module")
def mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    return make_mixed_requests()


# A sleep kernel of this many cycles holds a GPU for about 20 ms (clocks of 1-2 GHz).
HELD_CYCLES = 30_000_000

DEVICES = [pytest.param(device, marks=[pytest.mark.skip(reason=cuda_skip_reason(device))]
                        if cuda_skip_reason(device) else []) for device in ("cpu", "cuda")]


def count_launches_ahead(engine: LLMEngine) -> list[int]:
    """A two-item list counting the iterations the engine launches to be read after the next
    launch (planned ahead), all of them and those launched while a host batch was in flight."""
    count = [0, 0]
    launch = engine.runner.launch

    def counting_launch(plan, on_launched=None, previous=None, read_later=False):
        count[0] += read_later
        count[1] += read_later and engine.runner.host_batch_in_flight
        return launch(plan, on_launched, previous, read_later)

    engine.runner.launch = counting_launch
    return count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy, host_pipeline", [("gpu-only", "async"), ("neo", "async"), ("neo", "lockstep")],
                         ids=["gpu-only", "neo-async", "neo-lockstep"])
@pytest.mark.parametrize("gpu_blocks", [1024, 12], ids=["roomy", "preempting"])
def test_mixed_batch_tokens_equal_the_synchronous_engine(gpu_blocks, policy, host_pipeline, device, mixed_requests):
    """On CUDA the engine replays decode graphs and the tokens are copied back behind events, so
    the overlap is real there; the tokens must still equal the synchronous engine's. Under neo
    with a small GPU pool requests decode on the host (iterations then run in the synchronous
    order) and on the GPU (planned ahead while none is on the host)."""
    results, metrics = {}, {}
    for async_scheduling in (False, True):
        engine = engine_for(async_scheduling, gpu_blocks, device, policy, host_pipeline)
        launches_ahead = count_launches_ahead(engine)
        try:
            results[async_scheduling] = run_mixed(engine, mixed_requests)
            engine.step()  # the iteration still in flight, if any, only drops tokens
            assert_all_blocks_free(engine)
            metrics[async_scheduling] = engine.metrics.as_dict()
        finally:
            engine.close()
        assert (launches_ahead[0] > 0) == async_scheduling
        if async_scheduling:
            launches_beside_host_batches = launches_ahead[1]
    assert results[True] == results[False]
    if gpu_blocks == 12:
        key = "preemptions" if policy == "gpu-only" else "host_decode_tokens"
        assert metrics[True][key] > 0 and metrics[False][key] > 0
        if host_pipeline == "async" and policy == "neo":  # GPU iterations planned ahead beside host batches
            assert launches_beside_host_batches > 0
    reasons = {request_id: completions[0][1] for request_id, completions in results[False].items()}
    assert reasons["0"] == reasons["1"] == "stop"  # the stop string and the stop token were found
    assert reasons["2"] == "length" and reasons["5"] == "abort"
    assert len(results[False]["2"][0][0]) == 1 and len(results[False]["5"][0][0]) == ABORTED_AT
    assert len(results[False]["6"][0][0]) >= 6  # min_tokens held the stop token back


def test_each_step_returns_the_previous_iterations_tokens():
    """The prefill's token is still on its way when its step returns; the next step launches
    the next iteration before it reads that token, then returns it. With the setting off, the
    prefill's step returns it, and each launch comes after the previous token was read."""
    for async_scheduling in (False, True):
        engine = engine_for(async_scheduling, 1024)
        try:
            request = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0))
            outputs = engine.step()
            if async_scheduling:
                assert outputs == [] and request.output_token_ids == [UNRESOLVED_TOKEN]
            else:
                assert len(outputs) == 1 and outputs[0].outputs[0].token_ids == request.output_token_ids
            at_launch = []
            outputs = engine.step(on_launched=lambda: at_launch.append(request.output_token_ids[:]))
            assert len(outputs[0].outputs[0].token_ids) == (1 if async_scheduling else 2)
            assert (at_launch[0] == [UNRESOLVED_TOKEN]) == async_scheduling
        finally:
            engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_iterations_measured_seconds_add_up_to_the_time_that_passed(device, async_scheduling, tmp_path):
    """Under async scheduling an iteration is launched while the one before it runs; its
    measured time counts from the read of that one's tokens, not from its own launch, so the
    trace's iterations add up to at most the run's time (counted from each launch they would
    come to about twice it), and each is positive."""
    engine = LLMEngine(EngineConfig(model="neo-tiny", device=device, dtype="float32", policy="gpu-only",
                                    gpu_kv_cache_gib=gib_for_blocks(1024), perf_model="zero", max_num_seqs=8,
                                    async_scheduling=async_scheduling, trace_path=str(tmp_path / "trace.json")))
    try:
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                               request_id=str(index))
        began = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        elapsed = time.perf_counter() - began
        measured = [record.measured_seconds for record in engine.trace.records]
    finally:
        engine.close()
    assert len(measured) >= 24 and all(seconds > 0 for seconds in measured)
    assert sum(measured) <= elapsed


def test_a_finished_burst_leaves_no_iteration_in_flight_to_time_the_idle_stretch_after_it(tmp_path):
    """The step whose read ends the last requests has launched one more iteration for them
    (its tokens are dropped). It is read in that step: left in flight, it would be read only in
    the next burst's first step, and its measured time would count the idle second in between
    (on the GPU machine such an iteration measured 52x its estimate and set the decode
    calibration, summed, to its bound). Each burst of 5 tokens a request is one prefill and 5
    decode iterations, the last one dropped: all 12 are in the trace."""
    idle_seconds = 1.0
    engine = LLMEngine(EngineConfig(model="neo-tiny", device="cpu", dtype="float32", policy="gpu-only",
                                    gpu_kv_cache_gib=gib_for_blocks(1024), perf_model="zero", max_num_seqs=8,
                                    async_scheduling=True, trace_path=str(tmp_path / "trace.json")))
    try:
        for burst in range(2):
            requests = [engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                           request_id=f"{burst}-{index}") for index, prompt in enumerate(PROMPTS)]
            while engine.has_unfinished_requests():
                engine.step()
            assert not engine.iteration_in_flight
            assert all(len(request.output_token_ids) == 5 for request in requests)
            time.sleep(idle_seconds)
        records = engine.trace.records
    finally:
        engine.close()
    assert len(records) == 12
    assert all(0 < record.measured_seconds < idle_seconds for record in records if not record.prefill_tokens)


@pytest.mark.skipif(cuda_skip_reason("cuda") is not None, reason=str(cuda_skip_reason("cuda")))
def test_a_host_batch_that_completes_while_a_step_waits_is_followed_by_the_next_at_once(mixed_requests):
    """Each GPU iteration is held on the device for about 20 ms (a sleep kernel queued before its
    work), far longer than a host batch of the tiny model: a batch completes while the step
    waits for an iteration's tokens, and the step collects it and launches the next one then
    (``Scheduler.schedule_host_batch``), not a step later. The tokens equal the synchronous
    engine's, and every block is free again. A host request may now get two tokens in one step,
    so request "5", aborted once a step returns it with ``ABORTED_AT`` tokens, may have one more
    here."""
    results = {}
    for async_scheduling in (False, True):
        engine = engine_for(async_scheduling, 12, "cuda", "neo", "async")
        if async_scheduling:
            launch = engine.runner.launch

            def held_launch(plan, on_launched=None, previous=None, read_later=False):
                torch.cuda._sleep(HELD_CYCLES)
                return launch(plan, on_launched, previous, read_later)

            engine.runner.launch = held_launch
        try:
            results[async_scheduling] = run_mixed(engine, mixed_requests)
            engine.step()
            assert_all_blocks_free(engine)
            metrics = engine.metrics.as_dict()
        finally:
            engine.close()
        assert metrics["host_decode_tokens"] > 0
        assert (metrics["host_batches_between_steps"] > 0) == async_scheduling
    aborted = {key: result.pop("5") for key, result in results.items()}
    assert results[True] == results[False]
    (synchronous, _, _), = aborted[False]
    (relaunched, reason, _), = aborted[True]
    assert reason == "abort" and relaunched[:ABORTED_AT] == synchronous[:ABORTED_AT]
    assert ABORTED_AT <= len(relaunched) <= ABORTED_AT + 1


def test_a_plan_that_copies_blocks_between_the_pools_is_not_launched_ahead():
    """A host batch runs on streams of its own: launched while the copies of a plan ahead had not
    run, it would read blocks not yet in the host pool, or write into a host block a copy back
    to the GPU has yet to read. Such a plan is read before the next plan is made."""
    request = Request("0", [1, 2, 3], SamplingParams(max_tokens=4))
    request.location = KVLocation.GPU
    for copies in ({}, {"swap_out": [(0, 1)]}, {"swap_in": [(1, 0)]}):
        plan = SchedulerOutput(sub_batches=[SubBatch(gpu_decodes=[request])], **copies)
        assert plan.runs_ahead() == (not copies)


@pytest.mark.parametrize("device", DEVICES)
def test_async_scheduling_by_default_on_cuda_only(device):
    """Unset, it is on for CUDA devices, one rank or several, and off on the CPU (each step
    returns its own tokens)."""
    engine = LLMEngine(EngineConfig(model="neo-tiny", device=device, gpu_kv_cache_gib=gib_for_blocks(64)))
    try:
        assert engine.async_scheduling == (device == "cuda")
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
        assert len(engine.step()) == (0 if device == "cuda" else 1)
    finally:
        engine.close()
    assert EngineConfig(model="neo-tiny", device=device, tensor_parallel_size=2).schedules_ahead == (device == "cuda")


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    return greedy_continuations(transformers_tiny(str(tmp_path_factory.mktemp("neo-tiny"))))


@pytest.mark.parametrize("gpu_blocks", [1024, 8], ids=["roomy", "preempting"])
def test_greedy_equals_transformers(gpu_blocks, expected):
    llm = LLM("neo-tiny", device="cpu", policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(gpu_blocks),
              cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8, async_scheduling=True)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        llm.engine.step()
        assert_all_blocks_free(llm.engine)
        preemptions = llm.get_metrics()["preemptions"]
    finally:
        llm.close()
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert (preemptions > 0) == (gpu_blocks == 8)


POLICIES = [("gpu-only", "async"), ("neo", "async"), ("neo", "lockstep")]


@pytest.mark.parametrize("policy, host_pipeline", POLICIES, ids=["gpu-only", "neo-async", "neo-lockstep"])
def test_two_ranks_scheduling_ahead_give_one_synchronous_ranks_tokens(policy, host_pipeline, mixed_requests):
    """Two ranks on the CPU (gloo) with async scheduling: the driver's samples reach the other
    rank by broadcast, and that rank takes the next plan's unresolved tokens from them. The mixed
    batch's tokens must equal one synchronous rank's, with a pool so small that requests are
    preempted or decode on the host, and every block free afterwards."""
    results = {}
    for size, async_scheduling in ((1, False), (2, True)):
        engine = engine_for(async_scheduling, 12, "cpu", policy, host_pipeline, tensor_parallel_size=size)
        launches_ahead = count_launches_ahead(engine)
        try:
            results[size] = run_mixed(engine, mixed_requests)
            engine.step()
            assert_all_blocks_free(engine)
            key = "preemptions" if policy == "gpu-only" else "host_decode_tokens"
            assert engine.metrics.as_dict()[key] > 0
        finally:
            engine.close()
        assert (launches_ahead[0] > 0) == async_scheduling
    assert results[2] == results[1]


def test_async_scheduling_above_one_rank_is_what_is_asked_for():
    assert EngineConfig(model="neo-tiny", device="cpu", tensor_parallel_size=2, async_scheduling=True).schedules_ahead
    assert not EngineConfig(model="neo-tiny", device="cpu", tensor_parallel_size=2,
                            async_scheduling=False).schedules_ahead
