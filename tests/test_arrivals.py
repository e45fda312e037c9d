"""The arrival-rate estimate (``ArrivalRate``) and the scheduler's record of arrivals."""

import random

import pytest

from neo.request import Request
from neo.sampling_params import SamplingParams
from neo.sched.arrivals import NO_ARRIVALS, ArrivalRate

from scheduler_harness import execute, make_scheduler

PROMPT, OUTPUT = 10, 20  # tokens of every request here


def request_at(arrival_time: float, name: str = "r") -> Request:
    return Request(name, [1] * PROMPT, SamplingParams(max_tokens=OUTPUT), arrival_time=arrival_time)


def stream(rate: ArrivalRate, times: list[float]) -> None:
    """One request arriving before each decision, at each of ``times``."""
    for time in times:
        rate.arrive(request_at(time))
        rate.decide()


def test_a_steady_stream_gives_its_rate_in_prompt_and_output_tokens():
    rate = ArrivalRate(window=32, min_arrivals=4)
    stream(rate, [0.5 * index for index in range(10)])  # 2 requests per second
    work = rate.arriving_work()
    assert work.prompt_tokens_per_s == pytest.approx(2 * PROMPT)
    assert work.output_tokens_per_s == pytest.approx(2 * OUTPUT)


def test_an_offline_burst_is_backlog_and_no_rate():
    """Every request added before one decision: the burst opens the window and nothing follows,
    however long the engine then works."""
    rate = ArrivalRate()
    for index in range(500):
        rate.arrive(request_at(1e-6 * index))  # an engine's clock while a loop adds them
    for _ in range(100):
        rate.decide()
        rate.elapse(0.01)
    assert rate.arriving_work() == NO_ARRIVALS


def test_a_stream_after_a_burst_counts_only_the_stream():
    rate = ArrivalRate(window=32, min_arrivals=4)
    for index in range(500):
        rate.arrive(request_at(0.0, f"burst{index}"))
    rate.decide()
    stream(rate, [1.0 + index for index in range(8)])  # 1 request per second from t = 1 s
    assert rate.arriving_work().output_tokens_per_s == pytest.approx(8 * OUTPUT / 8.0)


def test_fewer_than_min_arrivals_after_the_first_give_no_rate():
    rate = ArrivalRate(window=32, min_arrivals=4)
    stream(rate, [0.0, 0.001, 0.002, 0.003])  # the first opens the window, 3 follow
    assert rate.arriving_work() == NO_ARRIVALS
    stream(rate, [0.004])
    assert rate.arriving_work().output_tokens_per_s == pytest.approx(4 * OUTPUT / 0.004)


def test_the_rate_falls_while_the_engine_works_on_after_arrivals_stop():
    rate = ArrivalRate(window=32, min_arrivals=4)
    stream(rate, [float(index) for index in range(9)])  # 1 per second, last at t = 8 s
    assert rate.arriving_work().output_tokens_per_s == pytest.approx(OUTPUT)
    for _ in range(80):
        rate.elapse(0.1)  # 8 s of iterations, no arrival
    assert rate.arriving_work().output_tokens_per_s == pytest.approx(8 * OUTPUT / 16.0)


def test_the_window_forgets_old_arrivals():
    rate = ArrivalRate(window=8, min_arrivals=4)
    stream(rate, [0.01 * index for index in range(100)])  # 100 per second for 1 s
    stream(rate, [1.0 + index for index in range(1, 9)])  # then 1 per second
    assert rate.arriving_work().output_tokens_per_s == pytest.approx(OUTPUT)


def test_poisson_arrivals_are_estimated_within_the_windows_sampling_error():
    rng = random.Random(0)
    for requests_per_s in (0.5, 2.0, 50.0):
        rate, time = ArrivalRate(window=32, min_arrivals=4), 0.0
        for _ in range(200):
            time += rng.expovariate(requests_per_s)
            stream(rate, [time])
        estimate = rate.arriving_work().output_tokens_per_s / OUTPUT
        assert 0.6 * requests_per_s <= estimate <= 1.6 * requests_per_s


@pytest.mark.parametrize("options, name", [(dict(window=1), "window"), (dict(min_arrivals=0), "min_arrivals")])
def test_bad_settings_are_named(options, name):
    with pytest.raises(ValueError, match=name):
        ArrivalRate(**options)


def test_the_scheduler_records_one_entry_per_decision_and_its_iterations_time():
    """20 requests added at t = 0 before the first decision are backlog, however long the
    iterations then take; one added before each later decision, 0.1 s apart from t = 1.1 s,
    is a stream: 10 requests from the burst's arrival until 0.1 s past the last one."""
    scheduler = make_scheduler("neo", gpu_blocks=400, host_blocks=400, host_pipeline="async")
    for index in range(20):
        scheduler.add(request_at(0.0, f"burst{index}"))
    for _ in range(10):
        execute(scheduler, scheduler.schedule(), seconds=0.1)
        assert scheduler.arrivals.arriving_work() == NO_ARRIVALS
    for step in range(1, 11):
        scheduler.add(request_at(1.0 + 0.1 * step, f"stream{step}"))
        execute(scheduler, scheduler.schedule(), seconds=0.1)
    work = scheduler.arrivals.arriving_work()
    assert work.output_tokens_per_s == pytest.approx(10 * OUTPUT / 2.1)
    assert work.prompt_tokens_per_s == pytest.approx(10 * PROMPT / 2.1)


def test_a_burst_added_to_an_idle_engine_is_backlog_again():
    """A stream of 10 requests per second, run to completion; then a second burst: the engine
    was idle in between, so the stream says nothing about the work arriving after the burst."""
    scheduler = make_scheduler("neo", gpu_blocks=400, host_blocks=400, host_pipeline="async")
    for step in range(10):
        scheduler.add(request_at(0.1 * step, f"stream{step}"))
        execute(scheduler, scheduler.schedule(), seconds=0.1)
    assert scheduler.arrivals.arriving_work() != NO_ARRIVALS
    while scheduler.has_unfinished:
        execute(scheduler, scheduler.schedule(), seconds=0.1)
    for index in range(20):
        scheduler.add(request_at(10.0, f"burst{index}"))
    execute(scheduler, scheduler.schedule(), seconds=0.1)
    assert scheduler.arrivals.arriving_work() == NO_ARRIVALS
