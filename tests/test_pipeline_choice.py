"""The ``auto`` host pipeline (``neo.sched.placement.pipeline_choice``): each iteration runs the
lockstep or the async plan, whichever the cost function estimates makes more tokens per second;
no lockstep iteration runs while a host batch is in flight; the engine runs both kinds of
iteration with the same greedy tokens as gpu-only, each through the stages of its order."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_reference import gib_for_blocks
from neo import LLM, SamplingParams
from neo.request import Request
from neo.sampling_params import SamplingParams as Params
from neo.sched.perf_model import PerfModel
from neo.sched.placement import PipelineChoice
from neo.sched.stage_order import HOST_BATCH, Stage
from scheduler_harness import execute, make_scheduler, requests_of, synthetic_model
from test_block_manager import check_pools
from test_stage_order import StageRecorder

NEW_TOKENS = 6
LOCKSTEP_CHEAPER = dict(pipeline_overhead=0.0, host_batch_overhead=1.0)  # seconds per iteration / batch
ASYNC_CHEAPER = dict(pipeline_overhead=1.0, host_batch_overhead=0.0)


def overheads_model(pipeline_overhead: float, host_batch_overhead: float, host_per_token: float = 1e-6) -> PerfModel:
    """The harness's straight-line model with a fixed cost per lockstep iteration and per host
    batch: a large one makes that pipeline the costlier."""
    model = synthetic_model(1e-5, 1e-8, host_per_token)
    model.table.pipeline_overhead = pipeline_overhead
    model.table.host_batch_overhead = host_batch_overhead
    return model


def drive(scheduler, requests: list[Request], batch_iterations, abort=None, max_steps: int = 20_000) -> dict:
    """The engine loop's stand-in under ``auto``: each plan's sub-batches decode; a launched
    host batch completes ``batch_iterations()`` iterations later (at once with nothing else
    to run). Checks the in-flight rule and the pools every iteration; returns how many
    lockstep iterations (host decodes in sub-batches) and host batches ran."""
    for request in requests:
        scheduler.add(request)
    counts = {"lockstep": 0, "host_batches": 0}
    in_flight, remaining = [], 0
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return counts
        if abort is not None:
            for request in [r for r in requests if not r.is_finished and abort(r)]:
                scheduler.abort(request)
        plan = scheduler.schedule()
        lockstep = any(batch.host_decodes for batch in plan.sub_batches)
        assert not (lockstep and plan.host_batch is not None), "one plan ran both pipelines"
        if in_flight:
            assert not lockstep and len(plan.sub_batches) <= 1, "a lockstep iteration ran beside a host batch"
            assert plan.host_batch is None, "a host batch was launched while one is in flight"
            assert not {id(r) for r in in_flight} & {id(r) for r in plan.requests}, "a request in flight was planned"
        if plan.host_batch is not None:
            in_flight, remaining = plan.host_batch.host_decodes, batch_iterations()
            counts["host_batches"] += 1
        counts["lockstep"] += lockstep
        completed = None
        if in_flight:
            remaining -= 1
            if remaining <= 0 or not plan.requests:
                completed, in_flight = in_flight, []
        execute(scheduler, plan, host_batch=completed)
        holders = [r for r in requests if not r.is_finished] + [r for r in in_flight if r.is_finished]
        check_pools(scheduler.block_manager, holders)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("overheads, expected", [(LOCKSTEP_CHEAPER, "lockstep"), (ASYNC_CHEAPER, "async")])
def test_auto_runs_the_pipeline_the_cost_function_makes_cheaper(overheads, expected):
    """48 requests of 20 output tokens through a GPU pool that holds about 7: enough backlog that
    a host population of the size that pays finishes before the GPU drains the rest, so either
    pipeline offloads; which one runs is the one its overhead makes cheaper."""
    scheduler = make_scheduler("neo", 30, 200, overheads_model(**overheads), host_pipeline="auto", graphs=False)
    assert isinstance(scheduler.placement, PipelineChoice)
    requests = requests_of(48, prompt_len=40, max_tokens=20)
    counts = drive(scheduler, requests, batch_iterations=lambda: 3)
    assert all(r.num_output_tokens == 20 for r in requests)
    if expected == "lockstep":
        assert counts["lockstep"] > 0 and counts["host_batches"] == 0
    else:
        assert counts["host_batches"] > 0 and counts["lockstep"] == 0


def test_the_choice_is_the_higher_of_the_two_estimated_rates():
    """With host requests ready and no batch in flight, the plan placed is the candidate with
    the higher estimated tokens per second, whichever the overheads favour."""
    for overheads, expected in ((LOCKSTEP_CHEAPER, "lockstep"), (ASYNC_CHEAPER, "async")):
        scheduler = make_scheduler("neo", 30, 200, overheads_model(**overheads), host_pipeline="auto", graphs=False)
        placement = scheduler.placement
        rates = []
        original = placement.choose

        def recording_choose(scheduler, batch0, host_requests, plan):
            chosen = original(scheduler, batch0, host_requests, plan)
            if host_requests and placement.in_flight is None:
                trial = placement._lockstep_trial(scheduler, batch0, host_requests, plan)
                places_host_decodes = any(batch.host_decodes for batch in trial.sub_batches)
                lockstep_rate = len(trial.requests) / trial.predicted_time
                async_rate = placement.async_rate(scheduler, batch0, host_requests, plan)
                rates.append((places_host_decodes and lockstep_rate > async_rate, chosen))
            return chosen

        placement.choose = recording_choose
        drive(scheduler, requests_of(24, prompt_len=40, max_tokens=20), batch_iterations=lambda: 2)
        assert rates
        for lockstep_higher, chosen in rates:
            assert (chosen is placement.lockstep) == lockstep_higher
        winner = placement.lockstep if expected == "lockstep" else placement.asynchronous
        assert any(chosen is winner for _, chosen in rates)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), policy=st.sampled_from(["neo", "full-offload"]),
       gpu_blocks=st.integers(4, 40), pipeline_overhead=st.sampled_from([0.0, 1e-3, 1.0]),
       host_batch_overhead=st.sampled_from([0.0, 1e-3, 1.0]), host_per_token=st.sampled_from([1e-7, 1e-6, 1e-5]))
def test_random_mixes_never_run_lockstep_beside_a_host_batch_nor_leak(seed, policy, gpu_blocks, pipeline_overhead,
                                                                       host_batch_overhead, host_per_token):
    rng = random.Random(seed)
    model = overheads_model(pipeline_overhead, host_batch_overhead, host_per_token)
    scheduler = make_scheduler(policy, 0 if policy == "full-offload" else gpu_blocks, 120, model,
                               host_pipeline="auto", max_num_seqs=rng.randint(1, 16), block_size=8,
                               graphs=bool(seed % 2))
    requests = [Request(str(i), [2] * rng.randint(1, 200), Params(max_tokens=rng.randint(1, 40)))
                for i in range(rng.randint(1, 20))]
    doomed = {id(r) for r in requests if rng.random() < 0.2}
    drive(scheduler, requests, batch_iterations=lambda: rng.randint(1, 4),
          abort=lambda r: id(r) in doomed and r.num_output_tokens >= 2 and rng.random() < 0.3)
    for request in requests:
        assert request.is_finished
        if request.finish_reason == "length" and id(request) not in doomed:
            assert request.num_output_tokens == request.sampling_params.max_tokens


# -- the engine on neo-tiny ----------------------------------------------------------------------


def engine_prompts() -> list[list[int]]:
    """Sixteen prompts of 4-60 tokens: enough for a 6-block GPU pool to overflow to the host."""
    rng = random.Random(0)
    return [[rng.randrange(1, 250) for _ in range(rng.randint(4, 60))] for _ in range(16)]


@pytest.fixture(scope="module")
def gpu_only_tokens():
    llm = LLM("neo-tiny", device="cpu", dtype="float32", policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(256))
    try:
        outputs = llm.generate(engine_prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.close()


def perf_model_file(tmp_path, **overheads) -> str:
    path = tmp_path / "perf-model.json"
    overheads_model(**overheads).table.save(str(path))
    return str(path)


@pytest.mark.parametrize("overheads, kinds", [(LOCKSTEP_CHEAPER, {"lockstep"}), (ASYNC_CHEAPER, {"async"}),
                                              ({"pipeline_overhead": 0.0, "host_batch_overhead": 0.0},
                                               {"lockstep", "async"})],
                         ids=["lockstep-cheaper", "async-cheaper", "mixed"])
def test_the_engine_runs_auto_with_gpu_only_tokens_each_iteration_in_its_order(tmp_path, overheads, kinds,
                                                                               gpu_only_tokens):
    """Greedy tokens under ``auto`` equal gpu-only's, with lockstep iterations, host batches or
    both; each iteration with host decodes walks its order's steps (two-sub-batch or
    sequential), and each host batch the ``host-batch`` order's."""
    llm = LLM("neo-tiny", device="cpu", dtype="float32", policy="neo", gpu_kv_cache_gib=gib_for_blocks(6),
              cpu_kv_cache_gib=gib_for_blocks(64), perf_model=perf_model_file(tmp_path, **overheads),
              host_pipeline="auto", max_num_seqs=8)
    try:
        engine = llm.engine
        layers = engine.model_config.num_layers
        executor, host_executor = engine.runner.executor, engine.runner.host_batches.executor
        recorder = StageRecorder(engine.model, executor)
        start = host_executor.hand_off.start

        def recorded_host_start(sub_batch, layer, rows, meta, k_cache, v_cache):
            recorder.calls.append(f"attn_host({recorder.sub_batch_of[id(meta)]},{layer})")
            return start(sub_batch, layer, rows, meta, k_cache, v_cache)

        host_executor.hand_off.start = recorded_host_start
        walked = []

        def recording(run, kind):
            def recorded_run(batches, order, swap_out, swap_in):
                recorder.expect(batches)
                logits = run(batches, order, swap_out, swap_in)
                with_host = {index for index, inputs in enumerate(batches) if inputs.metadata.num_host_decodes}
                walked.append((kind, order, recorder.calls, with_host))
                return logits
            return recorded_run

        executor.run = recording(executor.run, "iteration")
        # A host batch is walked in layer parts: its walk runs from ``prepare`` to ``end``.
        prepare, end = host_executor.prepare, host_executor.end
        walking = []

        def recorded_prepare(metadata):
            recorder.expect_metadata(metadata)
            walking[:] = metadata
            prepare(metadata)

        def recorded_end(*args):
            end(*args)
            with_host = {index for index, meta in enumerate(walking) if meta.num_host_decodes}
            walked.append(("host batch", HOST_BATCH, recorder.calls, with_host))

        host_executor.prepare, host_executor.end = recorded_prepare, recorded_end
        outputs = llm.generate(engine_prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                ignore_eos=True))
        metrics = llm.get_metrics()
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == gpu_only_tokens
    ran = {"lockstep" if kind == "iteration" else "async" for kind, _, _, with_host in walked if with_host}
    assert ran == kinds
    for kind, order, calls, with_host in walked:
        steps = [str(step) for step in order.steps(layers)
                 if step.stage is not Stage.ATTN_HOST or step.sub_batch in with_host]
        assert calls == steps
    assert sum(kind == "host batch" for kind, *_ in walked) == metrics["host_batches"]


def test_a_host_batch_launched_after_a_lockstep_plan_with_prefills_is_marked_beside_them():
    """A host batch launched right after a plan with prefills runs beside them (async scheduling)
    and gives no sample of its rest, whichever pipeline made that plan."""
    scheduler = make_scheduler("neo", 30, 200, overheads_model(**ASYNC_CHEAPER), host_pipeline="auto", graphs=False)
    placement = scheduler.placement
    for request in requests_of(48, prompt_len=40, max_tokens=20):
        scheduler.add(request)
    choose = placement.choose
    placement.choose = lambda *arguments: placement.lockstep
    while scheduler.waiting:  # the last of these plans prefills the last prompts
        plan = scheduler.schedule()
        execute(scheduler, plan)
    assert plan.sub_batches[0].prefills and placement._planned_by is placement.lockstep
    placement.choose = choose
    launch = scheduler.schedule()
    assert launch.host_batch is not None and not launch.sub_batches[0].prefills
    assert placement.in_flight.beside_prefill
