"""Stage orders as data (``neo.sched.stage_order``) and the cost function that turns them into
iteration times (``neo.sched.cost``).

- Every order the engine runs keeps the transformer's data dependencies, and a broken one is
  refused with a message that names the problem.
- The cost of today's orders equals their formulas: ``asymmetric`` the lockstep pipeline's
  ``max(lin1 + o/2, host0) + max(lin0 + gpu0 + o/2, host1)``, ``sequential`` the sum of its
  stages; and for every order the cost is the steady state of a plain event-by-event simulation
  of the GPU and the host over many layers.
"""

import pickle
import random

import pytest

from neo.sched.cost import StageTimes, iteration_seconds, simulate
from neo.sched.stage_order import (ASYMMETRIC, ASYMMETRIC_EARLY_HOST, HOST_BATCH, SEQUENTIAL, STAGE_ORDERS,
                                   StageOrder, attn_gpu, attn_host, post, pre)


def random_times(rng: random.Random, num_sub_batches: int) -> list[StageTimes]:
    """Stage times with zeros mixed in (sub-batches without GPU attention or host decodes)."""
    def value() -> float:
        return rng.random() * rng.choice([0.0, 0.1, 1.0, 3.0])
    return [StageTimes(value(), value(), value()) for _ in range(num_sub_batches)]


# -- the declarations ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STAGE_ORDERS))
def test_every_step_comes_after_the_steps_it_waits_for(name):
    order = STAGE_ORDERS[name]
    for num_layers in (1, 2, 5):
        steps = order.steps(num_layers)
        expected = {(stage, batch, layer) for stage in ("pre", "attn_gpu", "attn_host", "post")
                    for batch in range(order.num_sub_batches) for layer in range(num_layers)}
        assert sorted((s.stage.value, s.sub_batch, s.layer) for s in steps) == sorted(expected)
        position = {step: index for index, step in enumerate(steps)}
        for step in steps:
            for needed in step.waits_for:
                if needed.layer >= 0:
                    assert position[needed] < position[step], f"{order.name}: {step} before {needed}"


def test_the_asymmetric_order_interleaves_the_sub_batches_as_the_paper_draws_it():
    steps = [str(step) for step in ASYMMETRIC.steps(2)]
    assert steps == ["pre(1,0)", "attn_gpu(1,0)", "attn_host(1,0)", "pre(0,0)", "attn_gpu(0,0)", "attn_host(0,0)",
                     "post(1,0)", "pre(1,1)", "attn_gpu(1,1)", "attn_host(1,1)",
                     "post(0,0)", "pre(0,1)", "attn_gpu(0,1)", "attn_host(0,1)",
                     "post(1,1)", "post(0,1)"]
    assert HOST_BATCH.steps(3) == SEQUENTIAL.steps(3)


@pytest.mark.parametrize("steps, message", [
    ((pre(0), attn_gpu(0), attn_host(0)), "missing \\['post\\(0\\)'\\]"),
    ((post(0), pre(0), attn_gpu(0), attn_host(0), attn_host(0)), "repeated \\['attn_host\\(0\\)'\\]"),
    ((pre(0), attn_gpu(0), attn_host(0), post(0, layer=0)), None),  # post in its own layer: valid
    ((post(0, layer=-2), pre(0), attn_gpu(0), attn_host(0)), "offset -2"),
    ((post(0), attn_gpu(0), pre(0), attn_host(0)), "issues attn_gpu\\(0,0\\) before pre\\(0,0\\)"),
    ((pre(0), post(0, layer=0), attn_gpu(0), attn_host(0)), "issues post\\(0,0\\) before attn_gpu\\(0,0\\)"),
])
def test_a_broken_declaration_is_refused_with_what_is_wrong(steps, message):
    if message is None:
        order = StageOrder("ok", 1, steps, "valid")
        assert iteration_seconds(order, [StageTimes(1.0, 0.5, 0.25)]) == pytest.approx(1.75)
        return
    with pytest.raises(ValueError, match=message):
        StageOrder("broken", 1, steps, "broken")


# -- the cost function ---------------------------------------------------------------------------


def test_the_asymmetric_cost_is_the_lockstep_formula():
    rng = random.Random(0)
    for _ in range(2000):
        times = random_times(rng, 2)
        times[1] = times[1]._replace(gpu_attention=0.0)  # batch 1 holds host decodes only
        overhead = (rng.random() - 0.5) * rng.choice([0.0, 1.0, 4.0])  # graph replays may be negative
        linear0, gpu0, host0 = times[0]
        linear1, _, host1 = times[1]
        formula = max(linear1 + overhead / 2, host0) + max(linear0 + gpu0 + overhead / 2, host1)
        for pre_fraction in (0.1, 0.5, 0.9):  # how linear splits between pre and post: irrelevant here
            cost = iteration_seconds(ASYMMETRIC, times, pre_fraction, overhead, fixed_overhead=0.25)
            assert cost == pytest.approx(formula + 0.25, abs=1e-12)


def test_the_sequential_cost_is_the_sum_of_its_stages():
    rng = random.Random(1)
    for _ in range(200):
        times = random_times(rng, 1)
        assert iteration_seconds(SEQUENTIAL, times, fixed_overhead=0.5) == pytest.approx(sum(times[0]) + 0.5)
        assert iteration_seconds(HOST_BATCH, times) == pytest.approx(sum(times[0]))


@pytest.mark.parametrize("name", sorted(STAGE_ORDERS))
def test_the_cost_is_the_steady_state_of_the_simulated_resources(name):
    """The event-by-event simulation over L layers takes the steady state's time plus at most
    one layer's worth of each stage to fill and drain the pipeline."""
    order = STAGE_ORDERS[name]
    rng = random.Random(2)
    layers = 400
    for _ in range(60):
        times = random_times(rng, order.num_sub_batches)
        overhead = rng.random() * rng.choice([0.0, 1.0])
        pre_fraction = rng.random()
        steady = iteration_seconds(order, times, pre_fraction, overhead)
        simulated = simulate(order, times, layers, pre_fraction, overhead)
        fill_and_drain = (sum(sum(t) for t in times) + overhead) * 2 / layers
        assert steady - 1e-9 <= simulated <= steady + fill_and_drain + 1e-9


def test_issuing_host_attention_before_the_gpu_attention_can_only_help():
    rng = random.Random(3)
    for _ in range(500):
        times = random_times(rng, 2)
        assert iteration_seconds(ASYMMETRIC_EARLY_HOST, times) <= iteration_seconds(ASYMMETRIC, times) + 1e-12
    # Host-bound with GPU attention in batch 0: its host attention starts while the GPU attends.
    times = [StageTimes(1.0, 0.5, 2.0), StageTimes(1.0, 0.0, 0.1)]
    assert iteration_seconds(ASYMMETRIC, times) == pytest.approx(2.0 + 1.5)
    assert iteration_seconds(ASYMMETRIC_EARLY_HOST, times) == pytest.approx(3.0)


def test_cost_needs_the_orders_number_of_sub_batches():
    with pytest.raises(ValueError, match="runs 2 sub-batches, got stage times for 1"):
        iteration_seconds(ASYMMETRIC, [StageTimes(1.0, 0.0, 0.0)])


def test_orders_that_share_a_name_are_costed_by_their_own_steps():
    """An order hashes by its name and size alone (the cost function's caches look orders up
    on every estimate); two orders of one name but different steps still get their own
    costs, and an order survives pickling (to other ranks) as an equal key."""
    first = StageOrder("shared", 2, ASYMMETRIC.layer_steps, "asymmetric's steps")
    second = StageOrder("shared", 2, ASYMMETRIC_EARLY_HOST.layer_steps, "early host's steps")
    assert hash(first) == hash(second) and first != second
    times = [StageTimes(1.0, 0.2, 1.5), StageTimes(0.8, 0.0, 0.3)]
    expected = [iteration_seconds(order, times) for order in (ASYMMETRIC, ASYMMETRIC_EARLY_HOST)]
    assert expected[0] != pytest.approx(expected[1])
    assert [iteration_seconds(order, times) for order in (first, second)] == pytest.approx(expected)
    copy = pickle.loads(pickle.dumps(first))
    assert copy == first and hash(copy) == hash(first)
    assert iteration_seconds(copy, times) == pytest.approx(expected[0])
