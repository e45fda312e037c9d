"""No request's parameters can end another request.

Sampling parameters are drawn from far outside their ranges (huge integers, bools, NaN,
infinities, subnormal floats, long stop lists): each is refused with a ``ValueError`` when the
request is made, or the request runs to a normal finish beside two ordinary requests, whose
tokens must equal the same requests run alone.
"""

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from engine_reference import gib_for_blocks
from neo import LLM, EngineConfig, LLMEngine, SamplingParams

ORDINARY_PROMPTS = [[257, 72, 101, 108, 108, 111], [257] + list(range(60, 80))]
ORDINARY = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)]
# A short context, so that any accepted max_tokens ends soon.
ENGINE = dict(model="neo-tiny", device="cpu", max_model_len=48, gpu_kv_cache_gib=gib_for_blocks(256))

HUGE = st.integers(-(2**80), 2**80)
NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=1e-30),
                   HUGE, st.booleans(), st.none(), st.text(max_size=3))
VALID = {
    "max_tokens": st.integers(1, 2**70),
    "temperature": st.one_of(st.just(0.0), st.floats(0.01, 1e30)),
    "top_k": st.integers(-1, 2**63 - 1),
    "top_p": st.floats(1e-320, 1.0, exclude_min=False),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop_token_ids": st.lists(st.integers(0, 2**63 - 1), max_size=1024),
    "stop": st.lists(st.text(min_size=1, max_size=256), max_size=64),
    "ignore_eos": st.booleans(),
}
WILD = {
    "max_tokens": st.one_of(st.integers(-3, 0), NUMBER),
    "temperature": st.one_of(st.floats(-3, 0.0099), NUMBER),
    "top_k": NUMBER,
    "top_p": st.one_of(st.floats(1.0000001, 3), NUMBER),
    "seed": st.one_of(st.integers(-(2**80), -(2**63) - 1), st.integers(2**64, 2**80), NUMBER),
    "stop_token_ids": st.one_of(st.lists(st.integers(0, 400), min_size=1025, max_size=1100),
                                st.lists(st.one_of(st.integers(-(2**80), -1), st.integers(2**63, 2**80)),
                                         min_size=1, max_size=3), NUMBER),
    "stop": st.one_of(st.lists(st.text(min_size=1), min_size=65, max_size=200_000),
                      st.lists(st.text(min_size=257, max_size=300), min_size=1, max_size=2),
                      st.just([""]), NUMBER),
    "ignore_eos": st.one_of(HUGE, st.text(max_size=3)),
}
# Valid values everywhere, or valid values and one field from far outside its range.
PARAMETERS = st.one_of(
    st.fixed_dictionaries({}, optional=VALID),
    st.sampled_from(sorted(WILD)).flatmap(lambda name: st.fixed_dictionaries(
        {name: WILD[name]}, optional={key: value for key, value in VALID.items() if key != name})))


@pytest.fixture(scope="module")
def alone():
    llm = LLM(**ENGINE)
    try:
        yield [llm.generate(prompt, params)[0].outputs[0].token_ids for prompt, params in zip(ORDINARY_PROMPTS, ORDINARY)]
    finally:
        llm.close()


def test_no_parameter_value_ends_another_request(alone, seed):
    engine = LLMEngine(EngineConfig(**ENGINE))
    counts = collections.Counter()

    @hypothesis_seed(seed)
    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(options=PARAMETERS)
    def check(options):
        counts["tried"] += 1
        try:
            params = SamplingParams(**options)
        except ValueError as error:
            assert str(error).split(" ")[0] in options or "stop" in str(error), error
            counts["refused"] += 1
            return
        ordinary = [engine.add_request(prompt, params) for prompt, params in zip(ORDINARY_PROMPTS, ORDINARY)]
        hostile = engine.add_request([257, 1, 2, 3], params)
        while engine.has_unfinished_requests():
            engine.step()
        assert hostile.finish_reason in ("stop", "length"), hostile.error
        assert [request.output_token_ids for request in ordinary] == alone
        counts["accepted"] += 1

    try:
        check()
    finally:
        engine.close()
    print(dict(counts))
    assert counts["refused"] > 0 and counts["accepted"] > 0
