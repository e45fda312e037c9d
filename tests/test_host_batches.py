"""The scheduler of the async host pipeline (placement ``HostBatches``), without a model.

A stand-in engine loop launches each plan's host batch and completes it a given number of
iterations later; requests in flight must stay out of every plan, an abort of one frees its
blocks only when its batch is done, and no request starves.
"""


import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from neo.request import KVLocation, Request, RequestStatus
from neo.sampling_params import SamplingParams
from neo.sched.arrivals import ArrivingWork
from neo.sched.calibration import HostBatchInterference
from neo.sched.perf_model import PerfModel
from neo.sched.runner_output import HostBatchOutput
from neo.sched.scheduler import Scheduler
from neo.sched.scheduler_output import SchedulerOutput

from scheduler_harness import TOKEN, execute, random_scheduler, requests_of, synthetic_model
from scheduler_harness import make_scheduler as make_any_scheduler
from test_block_manager import check_pools

GPU, HOST = KVLocation.GPU, KVLocation.HOST


def make_scheduler(policy: str, gpu_blocks: int, host_blocks: int, perf_model: PerfModel, **options) -> Scheduler:
    return make_any_scheduler(policy, gpu_blocks, host_blocks, perf_model, host_pipeline="async", **options)


def drive(scheduler: Scheduler, requests: list[Request], batch_iterations=lambda: 3,
          on_plan=None, abort=None, between_steps: bool = False, max_steps: int = 20_000) -> None:
    """The engine loop's stand-in: each iteration decodes its sub-batch; a launched host batch
    completes ``batch_iterations()`` iterations later (``abort(request)`` may abort any
    unfinished request first, in flight or not). ``between_steps``: a batch that completes
    during an iteration is collected then and the next one launched at once
    (``Scheduler.schedule_host_batch``), as the engine does under async scheduling."""
    for request in requests:
        scheduler.add(request)
    in_flight, remaining = [], 0
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return
        if abort is not None:
            for request in [r for r in requests if not r.is_finished and abort(r)]:
                scheduler.abort(request)
        plan = scheduler.schedule()
        launched = plan.host_batch.host_decodes if plan.host_batch is not None else []
        if launched:
            assert not in_flight, "a host batch was launched while one is in flight"
            assert all(r.location is HOST and r.status is RequestStatus.RUNNING for r in launched)
            assert all(len(r.block_table) * scheduler.block_manager.block_size >= r.num_tokens for r in launched)
            in_flight, remaining = launched, batch_iterations()
        flying = {id(r) for r in in_flight}
        assert len(plan.sub_batches) <= 1 and not any(b.host_decodes for b in plan.sub_batches)
        assert not flying & {id(r) for r in plan.requests}, "a request in flight was planned"
        assert not flying & {id(r) for r in plan.finished}
        if on_plan is not None:
            on_plan(plan, in_flight)
        completed = None
        if in_flight:
            remaining -= 1
            if remaining <= 0 or not plan.requests:
                completed, in_flight = in_flight, []
        if completed and between_steps and plan.requests:
            execute(scheduler, SchedulerOutput(), host_batch=completed)
            completed, relaunch = None, scheduler.schedule_host_batch(plan)
            if relaunch is not None:
                launched = relaunch.host_batch.host_decodes
                assert not relaunch.sub_batches and not relaunch.has_swaps
                assert all(r.location is HOST and r.status is RequestStatus.RUNNING for r in launched)
                assert all(len(r.block_table) * scheduler.block_manager.block_size >= r.num_tokens for r in launched)
                assert not {id(r) for r in launched} & {id(r) for r in plan.requests}
                in_flight, remaining = launched, batch_iterations()
        execute(scheduler, plan, host_batch=completed)
        holders = [r for r in requests if not r.is_finished] + [r for r in in_flight if r.is_finished]
        check_pools(scheduler.block_manager, holders)  # aborted requests in flight still hold blocks
    raise AssertionError("requests did not finish")


def test_overflow_decodes_in_host_batches_beside_gpu_iterations():
    scheduler = make_scheduler("neo", gpu_blocks=20, host_blocks=400, perf_model=PerfModel.zero())
    requests = requests_of(24, prompt_len=40, max_tokens=20)
    seen = {"launched": 0, "beside_gpu_work": 0}

    def on_plan(plan, in_flight):
        seen["launched"] += plan.host_batch is not None
        seen["beside_gpu_work"] += bool(in_flight and plan.requests)

    drive(scheduler, requests, on_plan=on_plan)
    assert seen["launched"] > 0 and seen["beside_gpu_work"] > 0
    assert all(r.is_finished and r.num_output_tokens == 20 for r in requests)
    assert scheduler.block_manager.num_free(GPU) == 20 and scheduler.block_manager.num_free(HOST) == 400


def running_requests(scheduler, location: KVLocation, count: int, prompt_len: int = 8,
                     max_tokens: int = 1000) -> list[Request]:
    """``count`` requests already prefilled into ``location``'s pool, running."""
    requests = []
    for index in range(count):
        request = Request(f"{location.value}{index}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))
        scheduler.block_manager.allocate(request, location)
        request.num_cached_tokens = request.num_tokens
        request.append_token(5)
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        requests.append(request)
    return requests


@pytest.mark.parametrize("host_requests, pays", [(1, False), (9, False), (11, True), (40, True)])
def test_a_host_batch_pays_when_its_tokens_exceed_what_its_gpu_stages_cost(host_requests, pays):
    """GPU: 10 decodes, 10 ms an iteration (1000 tokens/s); a host batch's stages take 10 ms
    whatever its size, 10 tokens' worth of GPU time: it pays above 10 requests. A batch that
    does not pay is not launched, however long its requests wait: they wait to come back to
    the GPU pool, as a gpu-only engine's preempted requests do (next test: unless one never
    fits it)."""
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=10, host_blocks=400, perf_model=model)  # full: no moves back
    running_requests(scheduler, GPU, 10)
    running_requests(scheduler, HOST, host_requests)
    launches = []
    for _ in range(scheduler.max_host_wait + 1):
        plan = scheduler.schedule()
        assert len(plan.sub_batches[0].gpu_decodes) == 10
        launches.append(plan.host_batch is not None)
        if plan.host_batch is not None:
            assert len(plan.host_batch.host_decodes) == host_requests
        execute(scheduler, plan, host_batch=plan.host_batch.host_decodes if plan.host_batch else None,
                host_batch_seconds=None)
    assert launches == [pays] * len(launches)


def paying_host_batch_scheduler(host_requests: int) -> Scheduler:
    """The pools and costs of the test above: 10 GPU decodes fill the GPU pool, and a host
    batch pays above 10 requests. Each host request's token after the next fills its block."""
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=10, host_blocks=400, perf_model=model)
    running_requests(scheduler, GPU, 10)
    running_requests(scheduler, HOST, host_requests, prompt_len=scheduler.block_manager.block_size - 1)
    return scheduler


def complete_host_batch_during(scheduler: Scheduler) -> SchedulerOutput:
    """Launch a host batch, plan the next iteration beside it, and complete the batch while
    that iteration runs (as the engine collects it between steps); returns that plan."""
    first = scheduler.schedule()
    assert first.host_batch is not None
    execute(scheduler, first)
    beside = scheduler.schedule()
    assert beside.host_batch is None and beside.beside_host_batch
    execute(scheduler, SchedulerOutput(), host_batch=first.host_batch.host_decodes)
    return beside


def test_a_host_batch_completed_between_steps_is_followed_at_once_by_the_one_the_next_plan_launches():
    """The batch launched between steps holds what the next ``schedule`` would have launched,
    with the same slots, and nothing else; a twin scheduler that waits for that plan agrees."""
    relaunched, planned = paying_host_batch_scheduler(40), paying_host_batch_scheduler(40)
    beside = complete_host_batch_during(relaunched)
    twin_beside = complete_host_batch_during(planned)
    relaunch = relaunched.schedule_host_batch(beside)
    assert relaunch is not None and not relaunch.sub_batches and not relaunch.requests
    assert relaunched.placement.in_flight.requests == relaunch.host_batch.host_decodes
    execute(planned, twin_beside)
    next_plan = planned.schedule()
    assert [r.request_id for r in relaunch.host_batch.host_decodes] == [
        r.request_id for r in next_plan.host_batch.host_decodes]
    assert [r.block_table for r in relaunch.host_batch.host_decodes] == [
        r.block_table for r in next_plan.host_batch.host_decodes]
    assert relaunch.host_batch_predicted_time == pytest.approx(next_plan.host_batch_predicted_time)
    assert relaunched.schedule_host_batch(beside) is None  # one batch in flight at a time


@pytest.mark.parametrize("case", ["does not pay", "room on the GPU", "host pool full", "copies beside",
                                  "copies unfinished"])
def test_between_steps_no_host_batch_where_the_next_plan_might_decide_otherwise(case):
    """No batch between steps, and no slot made, where ``schedule`` weighs more than the
    batch: host requests that do not pay come back to the GPU first, one that fits the GPU
    pool comes back now, and a full host pool evicts. Nor while a plan whose device work may
    not have run copies blocks: a freed host block it reads could be a new token's slot."""
    scheduler = paying_host_batch_scheduler(9 if case == "does not pay" else 40)
    beside = complete_host_batch_during(scheduler) if case != "does not pay" else scheduler.schedule()
    manager = scheduler.block_manager
    if case == "host pool full":
        manager.pools[HOST].allocate(manager.num_free(HOST))
    if case == "room on the GPU":  # GPU requests ended since the last judgement
        for request in [r for r in scheduler.running if r.location is GPU][:5]:
            scheduler.abort(request)
        assert scheduler.host_decodes_pay and manager.num_free(GPU) >= 5
    unfinished = ()
    if case == "copies beside":
        beside.swap_in.append((0, 0))
    if case == "copies unfinished":
        unfinished = (SchedulerOutput(swap_in=[(0, 0)]),)
    tables = [list(r.block_table) for r in scheduler.running]
    assert scheduler.schedule_host_batch(beside, unfinished) is None
    assert [r.block_table for r in scheduler.running] == tables
    assert scheduler.placement.in_flight is None


def test_a_host_request_that_never_fits_the_gpu_pool_decodes_when_overdue():
    """The pools of the test above with one host request longer than the whole GPU pool: its
    batch does not pay, but it can never come back to the GPU, so it runs once the request has
    waited ``max_host_wait`` iterations."""
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=10, host_blocks=400, perf_model=model)
    running_requests(scheduler, GPU, 10)
    [long_request] = running_requests(scheduler, HOST, 1, prompt_len=10 * 16 + 1)
    assert scheduler.never_fits_gpu(long_request)
    launches = []
    for _ in range(scheduler.max_host_wait + 1):
        plan = scheduler.schedule()
        launches.append(plan.host_batch is not None)
        execute(scheduler, plan, host_batch=plan.host_batch.host_decodes if plan.host_batch else None,
                host_batch_seconds=None)
    assert launches == [False] * scheduler.max_host_wait + [True]


@pytest.mark.parametrize("waiting, admits", [(8, False), (200, True)])
def test_the_host_pool_admits_only_requests_it_finishes_before_the_gpu_drains(waiting, admits):
    """GPU: a full pool whose 10 requests have 4 tokens left, at 1700 tokens/s (17 decodes per
    10 ms iteration); a host batch takes 10 ms and gains tokens above 17 requests. A waiting
    request of 40 output tokens needs 40 host batches, 0.4 s: behind 7 more like it the GPU
    alone drains everything in about 0.19 s, so the request would come back to the GPU pool
    after a few host tokens and the host pool stays closed; behind 199 it takes about 4.7 s
    and the host pool opens."""
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=10, host_blocks=400, perf_model=model)
    gpu_requests = running_requests(scheduler, GPU, 10, max_tokens=5)
    for request in requests_of(waiting, prompt_len=8, max_tokens=40):
        scheduler.add(request)
    pays, more_pay = scheduler.placement.economics(scheduler, gpu_requests, [])
    assert (pays, more_pay) == (admits, admits)


@pytest.mark.parametrize("host_seconds_per_token, admits", [(1e-6, True), (5e-4, False)])
def test_the_host_pool_opens_only_for_a_population_the_host_finishes_in_time(host_seconds_per_token, admits):
    """The pools of the test above with 200 requests waiting (the GPU drains in about 4.7 s): a
    host population gains above 17 requests. With host attention nearly free, a host batch of
    32 takes about 10 ms, 40 tokens 0.4 s: the pool opens. At 0.5 ms per context token a batch of
    32 takes about 0.16 s, 40 tokens 6.4 s, longer than the GPU's drain: the population that
    would gain is never reached (the oldest waiting request alone would finish in time, but a
    few requests on the host do not pay and would straggle), so the pool stays closed."""
    model = synthetic_model(0.0, 0.0, host_seconds_per_token)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=10, host_blocks=400, perf_model=model)
    gpu_requests = running_requests(scheduler, GPU, 10, max_tokens=5)
    for request in requests_of(200, prompt_len=8, max_tokens=40):
        scheduler.add(request)
    placement, estimates = scheduler.placement, scheduler.estimates
    rate = 1700.0
    one_finishes = 40 * estimates.host_batch_time_of(1, 9) <= estimates.gpu_drain_time(
        gpu_requests, list(scheduler.waiting)[1:], rate, 2048, scheduler.arrivals.arriving_work())
    assert one_finishes  # the old rule, which judged one request more, would have opened the pool
    assert placement.economics(scheduler, gpu_requests, []) == (admits, admits)


@pytest.mark.parametrize("output_per_s, drain_s", [(0.0, 2.0), (500.0, 4.0), (750.0, 8.0), (1000.0, math.inf),
                                                    (1500.0, math.inf)])
def test_the_gpu_drains_its_backlog_over_one_less_the_load_of_the_arrivals(output_per_s, drain_s):
    """A backlog of 2000 output tokens at 1000 tokens/s is 2 s of GPU work; arrivals asking half
    the GPU's rate double that, three quarters of it quadruple it, and all of it or more keep
    the GPU from ever draining."""
    scheduler = make_scheduler("neo", gpu_blocks=10, host_blocks=400, perf_model=PerfModel.zero())
    gpu_requests = running_requests(scheduler, GPU, 10, max_tokens=201)  # 200 tokens left each
    drain = scheduler.estimates.gpu_drain_time(gpu_requests, [], 1000.0, 2048, ArrivingWork(0.0, output_per_s))
    assert drain == pytest.approx(drain_s)


@pytest.mark.parametrize("interval, admits", [(1.0, False), (0.01, True)])
def test_the_host_pool_stays_open_while_arrivals_saturate_the_gpu(interval, admits):
    """The pools of the test above with 8 requests waiting, after a steady stream of requests
    of 40 output tokens: one a second asks 40 tokens/s of a GPU making 1700, so the GPU still
    drains in about 0.2 s and the host pool stays closed; one every 10 ms asks 4000 tokens/s,
    more than the GPU makes, so it never drains and the host pool opens."""
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=10, host_blocks=400, perf_model=model)
    gpu_requests = running_requests(scheduler, GPU, 10, max_tokens=5)
    for index in range(32):
        scheduler.arrivals.arrive(Request(f"past{index}", [1] * 8, SamplingParams(max_tokens=40),
                                          arrival_time=index * interval))
        scheduler.arrivals.decide()
    for request in requests_of(8, prompt_len=8, max_tokens=40):
        scheduler.add(request)
    pays, more_pay = scheduler.placement.economics(scheduler, gpu_requests, [])
    assert (pays, more_pay) == (admits, admits)


def test_interference_is_the_slowdown_beside_host_batches_over_the_estimate_alone():
    interference = HostBatchInterference(window=8, min_samples=3)
    for _ in range(2):
        interference.observe(0.010, 0.030, beside_host_batch=True)
    assert interference.factor is None  # too few iterations beside a batch yet
    interference.observe(0.010, 0.030, beside_host_batch=True)
    assert interference.factor == pytest.approx(3.0)  # nothing alone yet: against the estimate itself
    interference.observe(0.010, 0.030, beside_host_batch=True, alone_scale=1.5)
    assert interference.factor == pytest.approx(2.0)  # too few alone: against the calibration given
    for measured in (0.012, 0.012, 0.012):  # alone, the estimate is 1.2x optimistic
        interference.observe(0.010, measured, beside_host_batch=False, alone_scale=1.5)
    assert interference.factor == pytest.approx(2.5)  # enough alone: against their own median
    interference.observe(0.0, 0.5, beside_host_batch=True)  # no estimate: ignored
    assert interference.factor == pytest.approx(2.5)
    for _ in range(8):  # beside as fast as alone, or faster: no slowdown
        interference.observe(0.010, 0.011, beside_host_batch=True)
    assert interference.factor == 1.0


def slow_host_batch_scheduler(host_requests: int, gpu_blocks: int = 10) -> Scheduler:
    """GPU: 10 decodes, 10 ms an iteration (1000 tokens/s); a host batch's stages take 10 ms
    and its host attention 1 ms per request. ``gpu_blocks``: the GPU pool (10: full after 8
    tokens more of each request)."""
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    model.table.host_attention_seconds = [[1e-3 * requests] * len(model.table.host_attention_tokens[0])
                                         for requests in model.table.host_attention_requests]
    scheduler = make_scheduler("neo", gpu_blocks=gpu_blocks, host_blocks=400, perf_model=model)
    running_requests(scheduler, GPU, 10)
    running_requests(scheduler, HOST, host_requests)
    return scheduler


def run_iteration(scheduler: Scheduler, slowdown: float) -> SchedulerOutput:
    """Plan, "execute" (the GPU iteration, 10 ms alone, takes ``slowdown`` times as long
    beside a host batch), and complete the host batch at once."""
    plan = scheduler.schedule()
    beside = scheduler.placement.host_batch_in_flight
    execute(scheduler, plan, seconds=0.01 * (slowdown if beside else 1.0),
            host_batch=plan.host_batch.host_decodes if plan.host_batch else None, host_batch_seconds=None)
    return plan


def test_decode_iterations_alone_calibrate_the_estimates_of_later_ones():
    """The GPU's decode iterations alone take 1.5x their profiled time (in serving the engine's
    own step adds to what the profile timed): once enough of them ran, later decode iterations
    are estimated at 1.5x, and so is the steady iteration the economics weigh host batches
    against (the lockstep placement's view, ``sequential_time``, stays the profile's). One
    iteration that took 50x (as the first of a burst did on the GPU machine) moves
    nothing: summed, it alone would have set the factor to its bound of 4, and while host
    batches ran back to back no iteration alone came to outweigh it. Iterations beside a host
    batch are no samples of it; the slowdown beside a batch is then measured against the
    calibrated estimate, not counted twice."""
    scheduler = slow_host_batch_scheduler(0, gpu_blocks=40)
    estimates = scheduler.estimates
    calibration = estimates.gpu_decode_calibration
    for index in range(calibration.min_samples):
        plan = scheduler.schedule()
        assert plan.host_batch is None and not plan.beside_host_batch
        assert plan.predicted_time == pytest.approx(plan.gpu_decode_sample)  # the prior until then
        execute(scheduler, plan, seconds=(50.0 if index == 0 else 1.5) * plan.gpu_decode_sample)
    assert calibration.scale == pytest.approx(1.5)
    plan = scheduler.schedule()
    assert plan.predicted_time == pytest.approx(1.5 * plan.gpu_decode_sample)
    assert estimates.sequential_time(plan.sub_batches[0]) == pytest.approx(plan.gpu_decode_sample)
    execute(scheduler, plan, seconds=1.5 * plan.gpu_decode_sample)

    # 14 host requests: the steady GPU iteration (the pool full of such requests: 17 decodes in
    # 10 ms) makes 1700 tokens/s, so their batch's 10 ms of GPU stages cost 17 tokens, more than
    # the 14 it makes; in the measured 15 ms, 11.3 tokens: it pays.
    scheduler = slow_host_batch_scheduler(14)
    assert not scheduler.placement.economics(scheduler, *split_running(scheduler))[0]
    for _ in range(calibration.min_samples):
        scheduler.estimates.gpu_decode_calibration.observe(0.01, 0.015)
    assert scheduler.placement.economics(scheduler, *split_running(scheduler))[0]

    scheduler = slow_host_batch_scheduler(40)  # host batches pay from the start
    calibration = scheduler.estimates.gpu_decode_calibration
    for _ in range(calibration.min_samples):  # as learned above
        calibration.observe(0.01, 0.015)
    interference = scheduler.placement.interference
    for _ in range(interference.min_samples):  # beside a batch: 3x the profile, 2x the calibrated
        plan = run_iteration(scheduler, slowdown=3.0)
        assert plan.beside_host_batch and plan.gpu_decode_sample == pytest.approx(0.01)
    assert calibration.scale == pytest.approx(1.5) and interference.factor == pytest.approx(2.0)
    assert scheduler.schedule().predicted_time == pytest.approx(3.0 * 0.01)


def test_host_batches_stop_paying_once_the_gpu_iterations_beside_them_measure_slower():
    """40 host requests: a batch lasts 50 ms (10 ms of GPU stages, 40 ms of host attention),
    so before anything is measured it costs 10 tokens of GPU time and pays. Beside it the GPU
    iterations measure 2x slower: it costs (1 - 1/2) * 50 ms, 25 tokens, and still pays; 10x
    slower: 45 tokens, more than its 40, so no batch runs: the requests wait to come back to
    the GPU pool."""
    scheduler = slow_host_batch_scheduler(40)
    launches = [run_iteration(scheduler, slowdown=2.0).host_batch is not None
                for _ in range(HostBatchInterference().min_samples + 2)]
    assert all(launches) and scheduler.placement.interference.factor == pytest.approx(2.0)
    plan = scheduler.schedule()
    assert plan.host_batch is not None and scheduler.placement.host_batch_in_flight
    assert plan.predicted_time == pytest.approx(2.0 * 0.01)  # beside a batch: the measured slowdown
    scheduler.fail_host_batch()

    scheduler = slow_host_batch_scheduler(40)
    interference = scheduler.placement.interference
    for _ in range(interference.min_samples):
        interference.observe(0.01, 0.1, beside_host_batch=True)
    launches = [run_iteration(scheduler, slowdown=10.0).host_batch is not None
                for _ in range(scheduler.max_host_wait + 1)]
    assert not any(launches) and not scheduler.host_decodes_pay


def test_a_measured_slowdown_below_the_gpu_stages_time_lets_a_small_batch_pay():
    """9 host requests: a batch lasts 19 ms (10 ms of GPU stages, 9 ms of host attention).
    Before anything is measured it costs its stages' 10 ms, 10 tokens of GPU time: more than
    its 9, so it does not pay. Beside it the GPU iterations then measure 1.05x slower: the
    stages ran in the iterations' gaps and cost them (1 - 1/1.05) * 19 ms, about 1 token, so
    the batch pays and is launched."""
    scheduler = slow_host_batch_scheduler(9)
    placement = scheduler.placement
    estimates = scheduler.estimates
    context = sum(r.num_tokens for r in scheduler.running if r.location is HOST)
    assert placement.gpu_cost(estimates, 9, context) == pytest.approx(0.01)
    assert not placement.economics(scheduler, *split_running(scheduler))[0]
    for _ in range(placement.interference.min_samples):
        placement.interference.observe(0.01, 0.0105, beside_host_batch=True)
    batch_seconds = estimates.host_batch_time_of(9, context)
    assert batch_seconds == pytest.approx(0.019, rel=0.05)
    assert placement.gpu_cost(estimates, 9, context) == pytest.approx((1 - 1 / 1.05) * batch_seconds)
    assert placement.economics(scheduler, *split_running(scheduler))[0]
    plan = scheduler.schedule()
    assert plan.host_batch is not None and len(plan.host_batch.host_decodes) == 9
    scheduler.fail_host_batch()


def split_running(scheduler: Scheduler) -> tuple[list[Request], list[Request]]:
    """(GPU requests, host requests) of the scheduler's running requests."""
    return ([r for r in scheduler.running if r.location is GPU],
            [r for r in scheduler.running if r.location is HOST])


def test_without_gpu_work_a_host_batch_runs_whatever_it_pays():
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=20, host_blocks=400, perf_model=model)
    running_requests(scheduler, HOST, 1)
    scheduler.block_manager.pools[GPU].allocate(20)  # no GPU room: the request stays on the host
    plan = scheduler.schedule()
    assert not plan.sub_batches and plan.host_batch is not None


def test_an_abort_in_flight_frees_the_blocks_when_the_batch_is_done():
    scheduler = make_scheduler("full-offload", gpu_blocks=0, host_blocks=100, perf_model=PerfModel.zero())
    requests = requests_of(3, prompt_len=20, max_tokens=10)
    for request in requests:
        scheduler.add(request)
    execute(scheduler, scheduler.schedule())  # prefills
    plan = scheduler.schedule()
    assert plan.host_batch is not None and len(plan.host_batch.host_decodes) == 3
    victim = requests[1]
    blocks = list(victim.block_table)
    scheduler.abort(victim, "abort")
    assert victim.is_finished and victim.block_table == blocks  # still held by the batch
    assert scheduler.block_manager.num_free(HOST) == 100 - sum(len(r.block_table) for r in requests)
    done = execute(scheduler, SchedulerOutput(), host_batch=plan.host_batch.host_decodes, host_batch_seconds=0.01)
    assert done == [requests[0], requests[2]]
    assert victim.block_table == [] and victim not in scheduler.running
    check_pools(scheduler.block_manager, [requests[0], requests[2]])


def test_the_measured_host_time_of_each_batch_calibrates_the_host_estimates():
    scheduler = make_scheduler("full-offload", gpu_blocks=0, host_blocks=100,
                               perf_model=synthetic_model(1e-5, 1e-8, 1e-5))
    requests = requests_of(4, prompt_len=20, max_tokens=10)
    for request in requests:
        scheduler.add(request)
    execute(scheduler, scheduler.schedule())  # prefills
    plan = scheduler.schedule()
    profiled = plan.host_batch_profiled_host_time
    assert profiled > 0 and plan.host_batch_predicted_time > plan.host_batch_predicted_host_time
    execute(scheduler, SchedulerOutput(), host_batch=plan.host_batch.host_decodes, host_batch_seconds=3 * profiled)
    assert scheduler.estimates.host_calibration.scale == pytest.approx(3.0)



def test_the_measured_rest_of_each_batch_calibrates_the_rest_of_later_batches():
    """A batch's seconds beside its host attention (its GPU stages, hand-offs) took twice their
    estimate: the next batch is estimated with its rest doubled, and the economics are judged
    again on the change. A batch that ran beside a prefill (launched right after one, or with
    one planned while it was in flight) is no sample: its GPU stages waited behind the prefill."""
    scheduler = make_scheduler("full-offload", gpu_blocks=0, host_blocks=100,
                               perf_model=synthetic_model(1e-5, 1e-8, 1e-5))
    calibration = scheduler.estimates.host_batch_rest_calibration
    requests = requests_of(4, prompt_len=20, max_tokens=10)
    for request in requests:
        scheduler.add(request)
    execute(scheduler, scheduler.schedule())  # prefills

    def run_batch(rest_factor: float) -> tuple[float, float]:
        """Launch the next batch and complete it with its rest ``rest_factor`` times the
        uncorrected estimate; returns its predicted (host, rest) seconds."""
        plan = scheduler.schedule()
        assert plan.host_batch is not None
        host = plan.host_batch_predicted_host_time
        rest = plan.host_batch_predicted_time - host
        uncorrected = scheduler.placement.in_flight.uncorrected_rest_time
        assert uncorrected == pytest.approx(rest / calibration.scale)
        execute(scheduler, SchedulerOutput(), host_batch=plan.host_batch.host_decodes, host_batch_seconds=host,
                host_batch_elapsed=host + rest_factor * uncorrected)
        return host, rest

    _, rest = run_batch(10.0)  # launched right after the prefills: ignored
    assert rest > 0 and calibration.num_samples == 0 and calibration.scale == 1.0
    corrections = scheduler.placement.measured_corrections(scheduler)
    run_batch(2.0)
    assert calibration.scale == pytest.approx(2.0)
    assert scheduler.estimates.host_calibration.scale == pytest.approx(1.0)
    assert scheduler.placement.measured_corrections(scheduler) != corrections
    # One token more of context per request: the host time grows a little, the rest not at all.
    _, doubled = run_batch(4.0)
    assert doubled == pytest.approx(2 * rest)
    assert calibration.scale == pytest.approx(3.0)  # (2 + 4) / (1 + 1)

    plan = scheduler.schedule()
    assert scheduler.placement.in_flight is not None and not scheduler.placement.in_flight.beside_prefill
    late = requests_of(1, prompt_len=20, max_tokens=10)[0]
    scheduler.add(late)
    execute(scheduler, plan)
    beside = scheduler.schedule()
    assert beside.sub_batches[0].prefills == [late] and scheduler.placement.in_flight.beside_prefill
    execute(scheduler, beside, host_batch=plan.host_batch.host_decodes, host_batch_seconds=1e-3,
            host_batch_elapsed=1.0)
    assert calibration.scale == pytest.approx(3.0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), policy=st.sampled_from(["neo", "full-offload"]),
       gpu_blocks=st.integers(4, 40), host_blocks=st.integers(8, 80),
       host_speed=st.sampled_from([1e-8, 1e-6, 1e-3]), between_steps=st.booleans())
def test_random_mixes_with_aborts_in_flight_never_leak_or_starve(seed, policy, gpu_blocks, host_blocks, host_speed,
                                                                 between_steps):
    scheduler, requests, rng = random_scheduler(seed, policy, gpu_blocks, host_blocks, host_speed, "async")
    waited = {}  # request -> iterations since its last token, while prefilled

    def on_plan(plan, in_flight):
        progressed = {id(r) for r in plan.requests} | {id(r) for r in in_flight}
        for request in scheduler.running:
            if request.is_prefilled:
                waited[id(request)] = 0 if id(request) in progressed else waited.get(id(request), 0) + 1
        assert max(waited.values(), default=0) <= 200, "a request starved"

    drive(scheduler, requests, batch_iterations=lambda: rng.randint(1, 5), on_plan=on_plan,
          abort=lambda request: rng.random() < 0.01, between_steps=between_steps)
    assert scheduler.block_manager.num_free(GPU) == scheduler.block_manager.num_total(GPU)
    assert scheduler.block_manager.num_free(HOST) == host_blocks
    assert all(r.is_finished for r in requests)



def test_under_async_scheduling_each_iteration_is_measured_against_its_own_plan():
    """Async scheduling makes the next plan before the iteration before it is measured, and
    the two may differ on whether a host batch is in flight: here the first plan launches a
    batch, which completes, and its host requests are aborted before the second plan. The first
    iteration's time (10x its estimate) counts as beside a batch, the second's (as estimated) as
    alone, whatever order the plans were made in."""
    scheduler = slow_host_batch_scheduler(40)
    first = scheduler.schedule()
    assert first.host_batch is not None and first.gpu_decode_sample == pytest.approx(0.01)
    assert first.beside_host_batch is True
    host_requests = first.host_batch.host_decodes
    scheduler.update(first, None, HostBatchOutput(host_requests, [TOKEN] * len(host_requests), 0.05, 0.04,
                                                  False, 0.0))
    for request in host_requests:
        scheduler.abort(request)
    second = scheduler.schedule()
    assert second.host_batch is None and second.gpu_decode_sample == pytest.approx(0.01)
    assert second.beside_host_batch is False
    interference = scheduler.placement.interference
    execute(scheduler, first, seconds=0.1)
    execute(scheduler, second, seconds=0.01)
    assert interference.samples == ([pytest.approx(10.0)], [pytest.approx(1.0)])
