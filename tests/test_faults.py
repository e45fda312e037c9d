"""Faults in running work end exactly the requests that work touched, with an error, and
nothing else: no silently wrong token, no lost request, no leaked KV block.

Faults are injected (``fault_injection``) into swap copies, iterations, host-batch launches
and the host's attention kernel, in the middle of their layers so that K/V is half written.
Every token any request emits is checked against the same request run alone on a fault-free
engine (greedy, or seeded sampling); a request that completes must equal it exactly.
"""

import collections
import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from engine_reference import gib_for_blocks
from fault_injection import HOST_ATTENTION_KERNEL, Faults, register_host_attention_kernel
from neo import LLM, EngineConfig, GenerationError, LLMEngine, SamplingParams
from neo.request import KVLocation

MAX_TOKENS = 24
PROMPT_POOL = [[random.Random(index).randrange(1, 320) for _ in range(random.Random(-index).randrange(1, 41))]
               for index in range(10)]
COMMON = dict(device="cpu", cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8)
SETTINGS = {
    # name: (engine settings, the fault kinds its work has)
    "gpu-only-swapping": (dict(policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(6), host_pipeline="lockstep"),
                          ("swap", "iteration")),
    "gpu-only-async-scheduling": (dict(policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(6), host_pipeline="lockstep",
                                       async_scheduling=True), ("swap", "iteration")),
    "neo-lockstep": (dict(policy="neo", gpu_kv_cache_gib=gib_for_blocks(6), host_pipeline="lockstep",
                          cpu_attention_kernel=HOST_ATTENTION_KERNEL), ("swap", "iteration", "host_attention")),
    "neo-async": (dict(policy="neo", gpu_kv_cache_gib=gib_for_blocks(6), host_pipeline="async",
                       cpu_attention_kernel=HOST_ATTENTION_KERNEL), ("swap", "iteration", "launch", "host_attention")),
    "neo-async-scheduling": (dict(policy="neo", gpu_kv_cache_gib=gib_for_blocks(6), host_pipeline="async",
                                  cpu_attention_kernel=HOST_ATTENTION_KERNEL, async_scheduling=True),
                             ("swap", "iteration", "launch", "host_attention")),
    "full-offload-async": (dict(policy="full-offload", gpu_kv_cache_gib=gib_for_blocks(6), host_pipeline="async",
                                cpu_attention_kernel=HOST_ATTENTION_KERNEL), ("iteration", "launch", "host_attention")),
}


def sampling(max_tokens: int, seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


class References:
    """Each (prompt, seed)'s tokens run alone on a fault-free gpu-only engine, computed once."""

    def __init__(self):
        self.llm = LLM("neo-tiny", device="cpu", gpu_kv_cache_gib=gib_for_blocks(1024))
        self.tokens: dict[tuple[int, int | None], list[int]] = {}

    def __call__(self, prompt: int, seed: int | None) -> list[int]:
        key = (prompt, seed)
        if key not in self.tokens:
            output = self.llm.generate(PROMPT_POOL[prompt], sampling(MAX_TOKENS, seed))[0]
            self.tokens[key] = output.outputs[0].token_ids
        return self.tokens[key]


@pytest.fixture(scope="module", autouse=True)
def host_attention_kernel():
    register_host_attention_kernel()


@pytest.fixture(scope="module")
def references():
    references = References()
    yield references
    references.llm.close()


def faulty_engine(options: dict) -> tuple[LLMEngine, Faults]:
    engine = LLMEngine(EngineConfig(**COMMON, **options))
    faults = Faults()
    faults.install(engine)
    return engine, faults


def assert_clean(engine: LLMEngine) -> None:
    """No request left anywhere and every block of both pools free."""
    assert not engine.has_unfinished_requests()
    for pool in (KVLocation.GPU, KVLocation.HOST):
        manager = engine.block_manager
        assert manager.num_free(pool) == manager.num_total(pool), f"{pool.value} blocks leaked"


def run_mix(engine: LLMEngine, mix: list[dict], references: References, stats: collections.Counter) -> None:
    """Add the mix's requests at their arrival steps, abort some at their abort steps, step
    until everything has finished; check every output against the references."""
    arrivals = collections.defaultdict(list)
    for index, request in enumerate(mix):
        arrivals[request["arrival"]].append(index)
    aborts = collections.defaultdict(list)
    for index, request in enumerate(mix):
        if request["abort"] is not None:
            aborts[request["arrival"] + request["abort"]].append(index)
    finals: dict[str, object] = {}
    aborted: set[str] = set()
    last_arrival = max(arrivals)
    step = 0
    while step <= last_arrival or engine.has_unfinished_requests():
        assert step < 2000, "the mix did not finish"
        for index in arrivals.get(step, []):
            request = mix[index]
            engine.add_request(PROMPT_POOL[request["prompt"]], sampling(request["max_tokens"], request["seed"]),
                               request_id=str(index))
        for index in aborts.get(step, []):
            if engine.abort_request(str(index)):
                aborted.add(str(index))
        for output in engine.step():
            request = mix[int(output.request_id)]
            expected = references(request["prompt"], request["seed"])[:request["max_tokens"]]
            tokens = output.outputs[0].token_ids
            assert tokens == expected[:len(tokens)], f"request {output.request_id}: a wrong token"
            if output.finished:
                assert output.request_id not in finals, f"request {output.request_id} finished twice"
                finals[output.request_id] = output
        step += 1
    for index in range(len(mix)):
        request_id = str(index)
        assert (request_id in finals) != (request_id in aborted), f"request {request_id} was lost"
        if request_id in aborted:
            stats["aborted"] += 1
            continue
        output = finals[request_id]
        reason = output.outputs[0].finish_reason
        if reason == "error":
            assert "InjectedFault" in output.error, output.error
            stats["failed"] += 1
        else:
            assert reason == "length" and len(output.outputs[0].token_ids) == mix[index]["max_tokens"]
            stats["completed"] += 1
    assert_clean(engine)


REQUEST = st.fixed_dictionaries({
    "prompt": st.integers(0, len(PROMPT_POOL) - 1),
    "max_tokens": st.integers(1, MAX_TOKENS),
    "seed": st.one_of(st.none(), st.integers(0, 3)),
    "arrival": st.integers(0, 6),
    "abort": st.one_of(st.none(), st.integers(0, 30)),
})


# Every prompt of the pool at once, each to MAX_TOKENS: it fills the pools, so every setting
# swaps, decodes on the host and launches host batches.
FULL_MIX = [dict(prompt=index, max_tokens=MAX_TOKENS, seed=None if index % 2 else index, arrival=0, abort=None)
            for index in range(len(PROMPT_POOL))]


def fault(kinds: tuple[str, ...]):
    """(kind, which call of that kind raises); swaps are rare in a mix, so only their first
    calls are chosen."""
    return st.sampled_from(kinds).flatmap(
        lambda kind: st.tuples(st.just(kind), st.integers(0, 1 if kind == "swap" else 6)))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_random_mixes_with_aborts_and_faults(setting, references, seed):
    options, kinds = SETTINGS[setting]
    engine, faults = faulty_engine(options)
    stats = collections.Counter()

    @hypothesis_seed(seed)
    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mix=st.lists(REQUEST, min_size=1, max_size=8), injected=st.lists(fault(kinds), max_size=3))
    def check(mix, injected):
        faults.reset()
        for kind, call in injected:
            faults.fail_at(kind, [call])
        run_mix(engine, mix, references, stats)
        stats.update({f"fired {kind}": count for kind, count in faults.fired.items()})
        stats["mixes"] += 1

    for kind in kinds:  # besides the random examples, each kind of fault once in a full mix
        check = example(mix=FULL_MIX, injected=[(kind, 0)])(check)
    try:
        check()
        # The engine serves a request normally after all of that.
        faults.reset()
        run_mix(engine, [dict(prompt=0, max_tokens=MAX_TOKENS, seed=None, arrival=0, abort=None)], references,
                stats)
    finally:
        engine.close()
    print(f"{setting}: {dict(stats)}")
    assert stats["failed"] > 0 and stats["completed"] > 0
    for kind in kinds:
        assert stats[f"fired {kind}"] > 0, f"no {kind} fault fired: the mixes do not exercise it"


def test_failed_host_batch_launch_ends_its_requests_and_the_plan_still_runs(references):
    """The plan's prefill runs and decodes correctly although the host batch launched in the
    same step failed (its requests end with an error)."""
    engine, faults = faulty_engine(SETTINGS["full-offload-async"][0])
    try:
        first = engine.add_request(PROMPT_POOL[1], sampling(MAX_TOKENS, None), request_id="on-host")
        engine.step()  # its prefill
        assert first.location is KVLocation.HOST
        faults.fail_at("launch", [0])  # the next step launches its decode as a host batch
        second = engine.add_request(PROMPT_POOL[2], sampling(MAX_TOKENS, None), request_id="prefilled")
        outputs = engine.step()
        assert faults.fired["launch"] == 1
        failed = [output for output in outputs if output.request_id == "on-host"]
        assert failed and failed[0].outputs[0].finish_reason == "error"
        assert second.num_output_tokens == 1 and second.is_prefilled
        while engine.has_unfinished_requests():
            engine.step()
        assert second.output_token_ids == references(2, None)
        assert_clean(engine)
    finally:
        engine.close()


def test_failed_swap_ends_the_requests_it_moves(references):
    """A swap-out that fails half way through the layers ends its victims, which are in no
    sub-batch of the plan; the others complete exactly."""
    engine, faults = faulty_engine(SETTINGS["gpu-only-swapping"][0])
    faults.fail_at("swap", [0])
    try:
        requests = [engine.add_request(PROMPT_POOL[index], sampling(MAX_TOKENS, None), request_id=str(index))
                    for index in range(6)]
        failed = []
        while engine.has_unfinished_requests():
            failed += [output for output in engine.step() if output.outputs[0].finish_reason == "error"]
        assert faults.fired["swap"] == 1 and failed
        for request in requests:
            if request.finish_reason == "error":
                assert "swap fault" in request.error
            else:
                assert request.output_token_ids == references(int(request.request_id), None)
        assert_clean(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("setting", ["gpu-only-swapping", "neo-async"])
def test_generate_after_a_failure_or_an_interrupt_serves_the_next_call(setting, references):
    options = SETTINGS[setting][0]
    llm = LLM("neo-tiny", **COMMON, **options)
    faults = Faults()
    faults.install(llm.engine)
    prompts = PROMPT_POOL[:4]
    expected = [references(index, None)[:8] for index in range(4)]
    try:
        faults.fail_at("iteration", [2])
        with pytest.raises(GenerationError, match="InjectedFault") as failure:
            llm.generate(prompts, sampling(8, None))
        outputs = failure.value.outputs
        assert len(outputs) == 4 and failure.value.failed
        for output, tokens in zip(outputs, expected):
            reason = output.outputs[0].finish_reason
            assert reason in ("error", "length")
            assert output.outputs[0].token_ids == tokens[:len(output.outputs[0].token_ids)]
        assert_clean(llm.engine)

        step = llm.engine.step
        calls = {"left": 3}

        def interrupted_step(*args, **kwargs):  # Ctrl-C during the fourth step
            if not calls["left"]:
                raise KeyboardInterrupt
            calls["left"] -= 1
            return step(*args, **kwargs)

        llm.engine.step = interrupted_step
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, sampling(8, None))
        llm.engine.step = step
        assert_clean(llm.engine)
        assert [output.outputs[0].token_ids for output in llm.generate(prompts, sampling(8, None))] == expected
    finally:
        llm.close()


@pytest.mark.parametrize("policy, host_pipeline", [("gpu-only", "lockstep"), ("neo", "lockstep"), ("neo", "async"),
                                                   ("full-offload", "async")])
def test_generate_after_close_is_a_clear_error(policy, host_pipeline):
    llm = LLM("neo-tiny", device="cpu", policy=policy, host_pipeline=host_pipeline, perf_model="zero",
              gpu_kv_cache_gib=gib_for_blocks(64), cpu_kv_cache_gib=gib_for_blocks(64))
    llm.generate(PROMPT_POOL[0], sampling(2, None))
    llm.close()
    llm.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate(PROMPT_POOL[0], sampling(2, None))
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.engine.step()
