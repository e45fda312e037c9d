"""The load-aware scheduler of the lockstep pipeline (placement ``TwoSubBatches``; neo and
full-offload), without a model."""


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neo.request import KVLocation, Request, RequestStatus
from neo.sampling_params import SamplingParams
from neo.sched.calibration import TimeCalibration
from neo.sched.cost import StageTimes
from neo.sched.perf_model import PerfModel
from neo.sched.scheduler_output import SchedulerOutput, SubBatch
from neo.sched.stage_order import ASYMMETRIC

from scheduler_harness import execute, make_scheduler, random_scheduler, requests_of, synthetic_model
from test_block_manager import check_pools

GPU, HOST = KVLocation.GPU, KVLocation.HOST


def drive(scheduler, requests: list[Request], on_plan=None, max_steps=20_000,
          arrivals_per_step: int | None = None, measure=None) -> None:
    """Stand-in for the engine loop: one token per scheduled request per iteration. Requests
    arrive all at once, or ``arrivals_per_step`` before each iteration. ``measure(plan)``
    gives the (iteration, host attention) seconds the runner reports."""
    pending = list(requests)
    for _ in range(max_steps):
        arriving = len(pending) if arrivals_per_step is None else arrivals_per_step
        for request in pending[:arriving]:
            scheduler.add(request)
        del pending[:arriving]
        if not scheduler.num_unfinished and not pending:
            return
        if not scheduler.num_unfinished:
            continue
        plan = scheduler.schedule()
        assert not plan.is_empty, "unfinished requests but the scheduler planned nothing"
        assert len(plan.sub_batches) <= 2
        for batch in plan.sub_batches:
            for request in batch.prefills + batch.gpu_decodes + batch.host_decodes:
                assert request.status is RequestStatus.RUNNING
                assert len(request.block_table) * scheduler.block_manager.block_size >= request.num_tokens
            assert all(r.location is GPU for r in batch.gpu_decodes)
            assert all(r.location is HOST for r in batch.host_decodes)
        if len(plan.sub_batches) == 2:
            assert not plan.sub_batches[1].prefills and not plan.sub_batches[1].gpu_decodes
        if on_plan is not None:
            on_plan(plan)
        seconds, host_seconds = measure(plan) if measure is not None else (0.01, 0.0)
        execute(scheduler, plan, seconds, host_seconds)
        check_pools(scheduler.block_manager, requests)
    raise AssertionError("requests did not finish")


def test_overflow_goes_to_host_and_runs_two_sub_batches():
    scheduler = make_scheduler("neo", gpu_blocks=20, host_blocks=400, perf_model=PerfModel.zero())
    requests = requests_of(24, prompt_len=40, max_tokens=20)
    seen = {"two": 0, "host_in_batch0": 0}

    def on_plan(plan):
        if len(plan.sub_batches) == 2:
            seen["two"] += 1
            seen["host_in_batch0"] += len(plan.sub_batches[0].host_decodes)

    drive(scheduler, requests, on_plan)
    assert seen["two"] > 0 and seen["host_in_batch0"] > 0
    assert scheduler.block_manager.num_free(GPU) == 20 and scheduler.block_manager.num_free(HOST) == 400


def test_slow_host_falls_back_to_gpu_only_but_never_starves():
    # Host attention far slower than anything on the GPU: two sub-batches never pay. Requests
    # evicted to the host come back to the GPU as it frees (no new request overtakes them);
    # one too large for the GPU pool decodes on the host at least every max_host_wait iterations.
    scheduler = make_scheduler("neo", gpu_blocks=30, host_blocks=400,
                               perf_model=synthetic_model(1e-6, 1e-8, 1e-2))
    requests = requests_of(16, prompt_len=40, max_tokens=30)
    huge = Request("huge", [1] * 490, SamplingParams(max_tokens=30))  # never fits the 480-token GPU pool
    progress = {}  # request -> iterations since it last decoded (anywhere)
    host_decodes_beside_gpu_work = []

    def on_plan(plan):
        decoded = {id(r) for r in plan.requests}
        for request in scheduler.running:
            if request.is_prefilled and not request.is_finished:
                progress[id(request)] = 0 if id(request) in decoded else progress.get(id(request), 0) + 1
        assert max(progress.values(), default=0) <= 2 * 30, "a request starved"
        if any(batch.prefills or batch.gpu_decodes for batch in plan.sub_batches):
            host_decodes_beside_gpu_work.append(sum(len(b.host_decodes) for b in plan.sub_batches))
        if huge.is_prefilled and not huge.is_finished:
            assert huge.location is HOST

    drive(scheduler, requests + [huge], on_plan)
    assert host_decodes_beside_gpu_work
    # Beside GPU work, host decodes run only when forced: at most one iteration in max_host_wait + 1.
    forced_share = sum(1 for n in host_decodes_beside_gpu_work if n) / len(host_decodes_beside_gpu_work)
    assert forced_share <= 1 / scheduler.max_host_wait
    assert huge.is_finished and huge.num_output_tokens == 30


def test_slow_host_admits_no_new_request_to_the_host_pool():
    # Where host decodes never pay, requests wait for GPU room as under gpu-only instead of
    # being prefilled into the host pool (where they could only decode slowly). GPU requests
    # evicted when GPU blocks run out still move to the host pool.
    scheduler = make_scheduler("neo", gpu_blocks=30, host_blocks=400,
                               perf_model=synthetic_model(1e-6, 1e-8, 1e-2))
    requests = requests_of(16, prompt_len=40, max_tokens=30)
    host_prefills = []

    def on_plan(plan):
        if any(r.location is GPU for r in scheduler.running):
            host_prefills.extend(r for batch in plan.sub_batches for r in batch.prefills if r.location is HOST)

    drive(scheduler, requests, on_plan)
    assert not host_prefills


def test_fast_host_admits_overflow_to_the_host_pool():
    scheduler = make_scheduler("neo", gpu_blocks=30, host_blocks=800,
                               perf_model=synthetic_model(2e-5, 1e-8, 2e-7), max_num_seqs=128)
    requests = requests_of(64, prompt_len=100, max_tokens=40)
    host_prefills = []
    drive(scheduler, requests,
          lambda plan: host_prefills.extend(r for b in plan.sub_batches for r in b.prefills if r.location is HOST))
    assert len(host_prefills) > 16


def test_fast_host_plans_pay_and_keep_host_attention_mostly_hidden():
    model = synthetic_model(linear_per_token=2e-5, gpu_per_token=1e-8, host_per_token=2e-7)
    scheduler = make_scheduler("neo", gpu_blocks=30, host_blocks=800, perf_model=model, max_num_seqs=128)
    requests = requests_of(64, prompt_len=100, max_tokens=40)
    checked = []

    def on_plan(plan):
        if len(plan.sub_batches) != 2:
            return
        batch0, batch1 = plan.sub_batches
        host0 = model.host_attention(len(batch0.host_decodes), sum(r.num_tokens for r in batch0.host_decodes))
        host1 = model.host_attention(len(batch1.host_decodes), sum(r.num_tokens for r in batch1.host_decodes))
        linear0 = model.linear(batch0.num_tokens)
        gpu_only = SubBatch(batch0.prefills, batch0.gpu_decodes)
        if gpu_only:  # the two-sub-batch plan beats batch 0 alone by estimated tokens/s
            alone = scheduler.estimates.sequential_time(gpu_only)
            assert len(plan.requests) / plan.predicted_time >= len(gpu_only.requests) / alone
        checked.append((host0 + host1) / (linear0 + model.linear(len(batch1.host_decodes))))

    drive(scheduler, requests, on_plan)
    assert len(checked) > 5
    # With no pipeline overhead the best plans keep host attention close to the GPU time.
    assert sorted(checked)[len(checked) // 2] < 1.5


def test_host_calibration_is_the_measured_over_profiled_ratio_of_recent_iterations():
    calibration = TimeCalibration(prior=0.5, window=3, bounds=(0.25, 4.0))
    assert calibration.scale == 0.5 and calibration.num_samples == 0
    calibration.observe(0.0, 1.0)  # no estimate: nothing learned
    calibration.observe(1.0, 0.0)
    assert calibration.num_samples == 0
    calibration.observe(1.0, 2.0)
    calibration.observe(3.0, 2.0)
    assert calibration.scale == 4.0 / 4.0
    for _ in range(3):  # the window keeps the last three
        calibration.observe(2.0, 1.0)
    assert calibration.scale == 0.5
    calibration.observe(1.0, 100.0)
    calibration.observe(1.0, 100.0)
    calibration.observe(1.0, 100.0)
    assert calibration.scale == 4.0  # bounded
    with pytest.raises(ValueError, match="prior"):
        TimeCalibration(prior=10.0)


def test_a_median_calibration_waits_for_its_minimum_and_ignores_a_stray_sample():
    calibration = TimeCalibration(window=5, statistic="median", min_samples=3)
    calibration.observe(1.0, 50.0)  # one iteration held up by the engine: 50x
    calibration.observe(1.0, 1.2)
    assert calibration.scale == 1.0  # the prior, until three samples
    calibration.observe(2.0, 2.4)
    assert calibration.scale == pytest.approx(1.2)
    for _ in range(5):  # the window keeps the last five
        calibration.observe(1.0, 0.9)
    assert calibration.scale == pytest.approx(0.9)
    with pytest.raises(ValueError, match="statistic"):
        TimeCalibration(statistic="mean")
    with pytest.raises(ValueError, match="min_samples"):
        TimeCalibration(window=4, min_samples=5)


@pytest.mark.parametrize("measured_over_profiled, admits_after_measuring", [(1.0, False), (0.3, True)])
def test_optimistic_prior_tries_host_decodes_then_follows_the_measured_host_time(measured_over_profiled,
                                                                                 admits_after_measuring):
    # On the profile alone host decodes do not pay; at the optimistic prior they would. The
    # scheduler offloads until its first measurement, then (from the iteration after next: each
    # iteration decides the next one's admissions) admits new requests to the host pool only if
    # the measured host speed makes that pay.
    model = synthetic_model(linear_per_token=2e-5, gpu_per_token=1e-8, host_per_token=4e-6)
    requests = requests_of(96, prompt_len=100, max_tokens=40)
    trusting = make_scheduler("neo", gpu_blocks=30, host_blocks=800, perf_model=model, max_num_seqs=128)
    host_prefills = []
    drive(trusting, requests_of(96, prompt_len=100, max_tokens=40), arrivals_per_step=2,
          on_plan=lambda plan: host_prefills.extend(r for b in plan.sub_batches for r in b.prefills if r.location is HOST))
    assert not host_prefills

    scheduler = make_scheduler("neo", gpu_blocks=30, host_blocks=800, perf_model=model, max_num_seqs=128,
                               host_prior=0.5)
    before, after = [], []
    calibration = scheduler.estimates.host_calibration
    measured_iterations = []

    def on_plan(plan):
        host_bound = [r for b in plan.sub_batches for r in b.prefills if r.location is HOST]
        (after if len(measured_iterations) > 1 else before).extend(host_bound)

    def measure(plan):  # what the engine measures executing the plan
        if calibration.num_samples:
            measured_iterations.append(plan)
        return plan.predicted_time, measured_over_profiled * (plan.profiled_host_time or 0.0)

    drive(scheduler, requests, on_plan, arrivals_per_step=2, measure=measure)
    assert before, "the optimistic prior should try host decodes"
    assert calibration.num_samples > 0
    assert calibration.scale == pytest.approx(measured_over_profiled)
    assert bool(after) == admits_after_measuring


@pytest.mark.parametrize("case", ["graph", "prefill", "swap", "no-graphs", "too-long"])
def test_decode_only_plans_are_estimated_as_cuda_graph_replays(case):
    """A plan the runner replays from a CUDA graph (GPU decodes alone, contexts within the
    captured width, with or without swaps, which the runner copies before the replay) is
    estimated from the graph-decode table; any other from the stages."""
    model = synthetic_model(1e-4, 1e-7, 1e-6)
    model.table.graph_decode_requests, model.table.graph_decode_seconds = [1, 64], [2e-4, 2e-4]
    model.table.graph_decode_context = 16
    scheduler = make_scheduler("neo", 64, 64, model, host_prior=0.67, graphs=case != "no-graphs",
                               cuda_graph_max_context=32 if case == "too-long" else 8192)
    first = requests_of(2, prompt_len=40, max_tokens=10)
    for request in first:
        scheduler.add(request)
    execute(scheduler, scheduler.schedule())  # prefills
    if case == "prefill":
        scheduler.add(Request("late", [1] * 20, SamplingParams(max_tokens=2)))
    if case == "swap":  # the newest request goes to the host pool and comes back this iteration
        scheduler.block_manager.move(first[1], HOST)
    plan = scheduler.schedule()
    decodes = plan.sub_batches[0].gpu_decodes
    assert len(plan.sub_batches) == 1 and len(decodes) == 2
    graph = model.graph_decode(2, sum(r.num_tokens for r in decodes))
    assert bool(plan.swap_in) == (case == "swap")
    if case in ("graph", "swap"):
        assert plan.predicted_time == pytest.approx(graph)
    else:
        assert plan.predicted_time > 2 * graph


@pytest.mark.parametrize("case", ["graph", "prefill", "swap", "no-graphs"])
def test_two_sub_batch_decode_plans_are_estimated_with_the_pipeline_graph_overhead(case):
    """The runner replays decode-only two-sub-batch plans from a pipeline graph (swaps copied
    first): their estimate takes the graph's pipeline overhead, any other the eager one."""
    model = synthetic_model(1e-4, 1e-7, 1e-6)
    model.table.pipeline_overhead, model.table.pipeline_graph_overhead = 0.05, -0.002
    scheduler = make_scheduler("neo", 64, 64, model, graphs=case != "no-graphs")
    manager = scheduler.block_manager
    gpu, host0, host1 = requests_of(3, prompt_len=40, max_tokens=10)
    for request, location in ((gpu, GPU), (host0, HOST), (host1, HOST)):
        manager.allocate(request, location)
        request.num_cached_tokens = request.num_tokens - 1
    batch0 = SubBatch(gpu_decodes=[gpu], host_decodes=[host0])
    if case == "prefill":
        late = Request("late", [1] * 20, SamplingParams(max_tokens=2))
        manager.allocate(late, GPU)
        batch0.prefills.append(late)
    plan = SchedulerOutput(sub_batches=[batch0, SubBatch(host_decodes=[host1])],
                           swap_in=[(0, 1)] if case == "swap" else [])
    seconds, host_seconds = scheduler.estimates.plan_time(plan)
    overhead = -0.002 if case in ("graph", "swap") else 0.05
    work0 = scheduler.estimates.gpu_work(batch0)
    host = model.host_attention(1, 40)
    assert host_seconds == pytest.approx(2 * host)
    times = [StageTimes(model.linear(work0.linear_tokens + 1), work0.attention_seconds, host),
             StageTimes(model.linear(1), 0.0, host)]
    assert seconds == pytest.approx(model.iteration_time(ASYMMETRIC, times, launch_overhead=overhead))


def test_full_offload_decodes_every_host_request_every_iteration():
    scheduler = make_scheduler("full-offload", gpu_blocks=0, host_blocks=400,
                               perf_model=synthetic_model(1e-5, 1e-8, 1e-6))
    requests = requests_of(12, prompt_len=30, max_tokens=10)

    def on_plan(plan):
        running = [r for r in scheduler.running if r.is_prefilled and not r.is_finished]
        decoded = [r for batch in plan.sub_batches for r in batch.host_decodes]
        assert all(r.location is HOST for r in plan.requests)
        assert set(map(id, decoded)) == set(map(id, running))

    drive(scheduler, requests, on_plan)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), policy=st.sampled_from(["neo", "full-offload"]),
       gpu_blocks=st.integers(4, 40), host_blocks=st.integers(8, 80),
       host_speed=st.sampled_from([1e-8, 1e-6, 1e-3]))
def test_random_mixes_never_leak(seed, policy, gpu_blocks, host_blocks, host_speed):
    scheduler, requests, _ = random_scheduler(seed, policy, gpu_blocks, host_blocks, host_speed, "lockstep")
    drive(scheduler, requests)
    assert scheduler.block_manager.num_free(GPU) == scheduler.block_manager.num_total(GPU)
    assert scheduler.block_manager.num_free(HOST) == host_blocks
    assert all(r.is_finished for r in requests)
