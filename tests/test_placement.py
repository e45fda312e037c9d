"""Host-decode placements, the scheduler's pluggable part (``neo.sched.placement``): the example
placement ``hidden-host`` keeps host attention hidden under the GPU's work and serves the same
tokens; a placement written in a test file, against the same small interface, plugs into the
engine by name; wrong names and pipelines are refused clearly."""

import pytest

from engine_reference import PROMPTS, gib_for_blocks, greedy_continuations, transformers_tiny
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.sched import placement as placements
from neo.sched.placement import Placement
from neo.sched.scheduler_output import SubBatch
from neo.sched.stage_order import SEQUENTIAL

from scheduler_harness import execute, make_scheduler, requests_of, synthetic_model

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SMALL = dict(device="cpu", dtype="float32", gpu_kv_cache_gib=gib_for_blocks(6), cpu_kv_cache_gib=gib_for_blocks(64),
             perf_model="zero", max_num_seqs=8)


@pytest.fixture(scope="module")
def expected(tmp_path_factory):
    return greedy_continuations(transformers_tiny(str(tmp_path_factory.mktemp("neo-tiny"))), PROMPTS, NEW_TOKENS)


class EveryHostRequestAlone(Placement):
    """Every host request decodes every iteration, in a sub-batch of its own after the GPU's."""

    def place(self, scheduler, batch0, host_requests, plan):
        scheduler.count_host_wait(False)
        if host_requests:
            plan.sub_batches = [batch for batch in (batch0, SubBatch(host_decodes=host_requests)) if batch]
        else:
            plan.sub_batches = [batch0] if batch0 else []
        plan.stage_order = scheduler.estimates.two_sub_batch_order if len(plan.sub_batches) == 2 else SEQUENTIAL

    def economics(self, scheduler, gpu_requests, host_requests):
        return True, True


@pytest.mark.parametrize("name", ["hidden-host", "every-host-request-alone"])
def test_a_placement_serves_the_same_tokens(name, expected, monkeypatch):
    monkeypatch.setitem(placements.PLACEMENTS, "every-host-request-alone", (EveryHostRequestAlone, "lockstep"))
    llm = LLM("neo-tiny", policy="neo", host_pipeline="lockstep", placement=name, **SMALL)
    try:
        assert type(llm.engine.scheduler.placement) is placements.PLACEMENTS[name][0]
        outputs = llm.generate(PROMPTS, GREEDY)
        metrics = llm.get_metrics()
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert metrics["host_decode_tokens"] > 0 and metrics["two_batch_iterations"] > 0


def test_hidden_host_decodes_only_what_the_gpu_work_hides():
    """Host attention 1 us per context token, the GPU's linear stages 10 ms per sub-batch
    whatever its size: host decodes of 1000-token requests (1 ms each) join the two sub-batches
    while the estimated iteration stays the time of its GPU work (20 ms), about ten per side;
    the rest wait, and each gets its turn (oldest first)."""
    model = synthetic_model(0.0, 0.0, 1e-6)
    model.table.linear_seconds = [0.01] * len(model.table.linear_tokens)
    scheduler = make_scheduler("neo", gpu_blocks=700, host_blocks=4000, perf_model=model, placement="hidden-host",
                               max_num_seqs=128, graphs=False)
    for request in requests_of(70, prompt_len=1000, max_tokens=1000):
        scheduler.add(request)
    while scheduler.waiting:
        execute(scheduler, scheduler.schedule())
    host_population = [r for r in scheduler.running if r.location.value == "host"]
    assert len(host_population) > 40
    decoded = set()
    for _ in range(8):
        plan = scheduler.schedule()
        host = [r for batch in plan.sub_batches for r in batch.host_decodes]
        assert len(plan.sub_batches) == 2 and 10 <= len(host) < len(host_population)
        assert plan.predicted_time == pytest.approx(0.02)  # the GPU's work: the host never holds it up
        assert plan.predicted_host_time > 0.01
        decoded.update(map(id, host))
        execute(scheduler, plan)
    assert decoded == set(map(id, host_population))  # round robin: every host request had its turn


@pytest.mark.parametrize("options, message", [
    (dict(placement="scatter"), "unknown placement 'scatter'; choose one of two-sub-batches, hidden-host, host-batches"),
    (dict(placement="hidden-host", host_pipeline="async"),
     "placement 'hidden-host' plans for the lockstep host pipeline, not 'async': set host_pipeline='lockstep'"),
    (dict(placement="host-batches", host_pipeline="lockstep"),
     "placement 'host-batches' plans for the async host pipeline"),
])
def test_a_placement_that_does_not_fit_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(policy="neo", **{**SMALL, **options}))
