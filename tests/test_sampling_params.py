"""``SamplingParams`` refuses every value the sampler or the request's generator could fail on
(or turn into NaN), naming the field; the extreme values it accepts sample correctly without
touching the other requests of the batch."""

import math
import re

import numpy
import pytest
import torch

from neo import LLM, SamplingParams
from neo.request import Request
from neo.runner.sampler import Sampler
from neo.sampling_params import (FLOAT32_MAX, INT64_MAX, MAX_LOGPROBS, MAX_N, MAX_REPETITION_PENALTY, MAX_SEED,
                                  MIN_REPETITION_PENALTY, MIN_SEED, MIN_TEMPERATURE)

SMALLEST_TOP_P = 5e-324  # the smallest positive float: float32 rounds it to 0

BAD_VALUES = [
    # (field, value, what the message says besides the field's name)
    ("max_tokens", 0, ">= 1"), ("max_tokens", -1, ">= 1"), ("max_tokens", True, "integer"),
    ("max_tokens", False, "integer"), ("max_tokens", 2.0, "integer"), ("max_tokens", "5", "integer"),
    ("max_tokens", None, "integer"),
    ("temperature", -1, ">= 0"), ("temperature", -1e-300, ">= 0"), ("temperature", math.nan, ">= 0"),
    ("temperature", math.inf, "finite"), ("temperature", -math.inf, ">= 0"),
    ("temperature", 1e-45, str(MIN_TEMPERATURE)), ("temperature", 0.0099, str(MIN_TEMPERATURE)),
    ("temperature", 3.5e38, re.escape(str(FLOAT32_MAX))), ("temperature", 10**39, "float32"),
    ("temperature", 10**400, "float32"), ("temperature", True, "number"),
    ("temperature", "0.5", "number"), ("temperature", None, "number"), ("temperature", 1j, "number"),
    ("top_k", -2, "-1, 0"), ("top_k", 2**63, r"2\*\*63 - 1"), ("top_k", 2**70, r"2\*\*63 - 1"),
    ("top_k", -(2**70), "-1, 0"), ("top_k", True, "integer"), ("top_k", 1.5, "integer"),
    ("top_k", "3", "integer"), ("top_k", None, "integer"),
    ("top_p", 0, r"\(0, 1\]"), ("top_p", -0.1, r"\(0, 1\]"), ("top_p", 1.0000001, r"\(0, 1\]"),
    ("top_p", 1.5, r"\(0, 1\]"), ("top_p", math.nan, r"\(0, 1\]"), ("top_p", math.inf, r"\(0, 1\]"),
    ("top_p", True, r"\(0, 1\]"), ("top_p", "0.5", r"\(0, 1\]"), ("top_p", None, r"\(0, 1\]"),
    ("seed", MIN_SEED - 1, r"\[-2\*\*63, 2\*\*64 - 1\]"), ("seed", MAX_SEED + 1, r"\[-2\*\*63, 2\*\*64 - 1\]"),
    ("seed", 2**70, r"\[-2\*\*63, 2\*\*64 - 1\]"), ("seed", True, "integer"), ("seed", 1.0, "integer"),
    ("seed", "7", "integer"),
    ("stop_token_ids", [-1], "non-negative"), ("stop_token_ids", [2**63], r"below 2\*\*63"),
    ("stop_token_ids", [2**70], r"below 2\*\*63"), ("stop_token_ids", [True], "integers"),
    ("stop_token_ids", [1.0], "integers"), ("stop_token_ids", 5, "list"), ("stop_token_ids", "ab", "list"),
    ("stop_token_ids", None, "list"), ("stop_token_ids", [0] * 1025, "at most 1024"),
    ("stop", [""], "non-empty"), ("stop", "", "non-empty"), ("stop", [1], "strings"),
    ("stop", ["x" * 257], "at most 256 characters"), ("stop", ["a"] * 65, "at most 64"),
    ("stop", 5, "string or a list"), ("stop", None, "string or a list"),
    ("ignore_eos", 1, "True or False"), ("ignore_eos", "yes", "True or False"), ("ignore_eos", None, "True or False"),
    ("n", 0, r"\[1, 128\]"), ("n", 129, r"\[1, 128\]"), ("n", -1, r"\[1, 128\]"), ("n", True, "integer"),
    ("n", 2.0, "integer"), ("n", None, "integer"),
    ("logprobs", -1, r"\[0, 20\]"), ("logprobs", 21, r"\[0, 20\]"), ("logprobs", True, "integer"),
    ("logprobs", 1.0, "integer"), ("logprobs", "5", "integer"),
    ("min_tokens", -1, r"\[0, max_tokens=16\]"), ("min_tokens", 17, r"\[0, max_tokens=16\]"),
    ("min_tokens", True, "integer"), ("min_tokens", 1.0, "integer"), ("min_tokens", None, "integer"),
    ("repetition_penalty", 0, r"\[0.01, 100.0\]"), ("repetition_penalty", -1.0, r"\[0.01, 100.0\]"),
    ("repetition_penalty", 0.0099, r"\[0.01, 100.0\]"), ("repetition_penalty", 100.5, r"\[0.01, 100.0\]"),
    ("repetition_penalty", math.nan, r"\[0.01, 100.0\]"), ("repetition_penalty", math.inf, r"\[0.01, 100.0\]"),
    ("repetition_penalty", True, "number"), ("repetition_penalty", None, "number"),
    ("presence_penalty", 2.01, r"\[-2.0, 2.0\]"), ("presence_penalty", -2.01, r"\[-2.0, 2.0\]"),
    ("presence_penalty", math.nan, r"\[-2.0, 2.0\]"), ("presence_penalty", True, "number"),
    ("presence_penalty", "1", "number"),
    ("frequency_penalty", 2.01, r"\[-2.0, 2.0\]"), ("frequency_penalty", -math.inf, r"\[-2.0, 2.0\]"),
    ("frequency_penalty", False, "number"), ("frequency_penalty", None, "number"),
]


@pytest.mark.parametrize("field, value, bound", BAD_VALUES,
                         ids=[f"{field}={str(value)[:20]}" for field, value, _ in BAD_VALUES])
def test_bad_value_is_refused_naming_the_field(field, value, bound):
    with pytest.raises(ValueError, match=bound) as error:
        SamplingParams(**{field: value})
    message = str(error.value)
    assert message.startswith(field), message
    assert len(message) < 300, message  # a long value is not echoed whole


GOOD_VALUES = [
    # (field, value, the value stored)
    ("max_tokens", 1, 1), ("max_tokens", 2**70, 2**70), ("max_tokens", numpy.int64(3), 3),
    ("temperature", 0, 0.0), ("temperature", 0.0, 0.0), ("temperature", 1, 1.0),
    ("temperature", MIN_TEMPERATURE, MIN_TEMPERATURE), ("temperature", FLOAT32_MAX, FLOAT32_MAX),
    ("temperature", numpy.float32(0.5), 0.5),
    ("top_k", -1, -1), ("top_k", 0, 0), ("top_k", 1, 1), ("top_k", INT64_MAX, INT64_MAX),
    ("top_p", SMALLEST_TOP_P, SMALLEST_TOP_P), ("top_p", 1e-46, 1e-46), ("top_p", 1, 1.0), ("top_p", 0.5, 0.5),
    ("seed", None, None), ("seed", MIN_SEED, MIN_SEED), ("seed", -1, -1), ("seed", 0, 0), ("seed", MAX_SEED, MAX_SEED),
    ("stop_token_ids", [], []), ("stop_token_ids", [0, INT64_MAX], [0, INT64_MAX]), ("stop_token_ids", (4, 5), [4, 5]),
    ("stop_token_ids", list(range(1024)), list(range(1024))),
    ("stop", "x" * 256, ["x" * 256]), ("stop", ("a", "\ufffd"), ["a", "\ufffd"]), ("stop", ["a"] * 64, ["a"] * 64),
    ("ignore_eos", True, True),
    ("n", 1, 1), ("n", MAX_N, MAX_N), ("n", numpy.int64(3), 3),
    ("logprobs", None, None), ("logprobs", 0, 0), ("logprobs", MAX_LOGPROBS, MAX_LOGPROBS),
    ("min_tokens", 0, 0), ("min_tokens", 16, 16),
    ("repetition_penalty", MIN_REPETITION_PENALTY, MIN_REPETITION_PENALTY), ("repetition_penalty", 1, 1.0),
    ("repetition_penalty", MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    ("presence_penalty", -2, -2.0), ("presence_penalty", 2.0, 2.0), ("frequency_penalty", -2.0, -2.0),
    ("frequency_penalty", 2, 2.0), ("frequency_penalty", numpy.float32(0.5), 0.5),
]


@pytest.mark.parametrize("field, value, stored", GOOD_VALUES,
                         ids=[f"{field}={str(value)[:20]}" for field, value, _ in GOOD_VALUES])
def test_good_edge_value_is_accepted(field, value, stored):
    params = SamplingParams(**{field: value})
    assert getattr(params, field) == stored
    assert type(getattr(params, field)) is type(stored)
    Request("r", [1], params)  # the generator takes every accepted seed


def test_min_tokens_is_bounded_by_the_max_tokens_given():
    assert SamplingParams(max_tokens=100, min_tokens=100).min_tokens == 100
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=5\], got 6"):
        SamplingParams(max_tokens=5, min_tokens=6)


def test_a_negative_seed_is_its_twos_complement():
    def draws(seed):
        generator = Request("r", [1], SamplingParams(seed=seed)).generator
        return torch.empty(4).exponential_(generator=generator).tolist()

    assert draws(-1) == draws(MAX_SEED) and draws(MIN_SEED) == draws(2**63) and draws(-1) != draws(1)


def test_sampler_rows_at_the_extremes_are_well_defined(generator):
    """The smallest top_p samples the top token; the smallest temperature over logits 1e4
    apart is finite and samples the top token; the largest temperature samples any token."""
    logits = torch.randn(4, 320, generator=generator) * 1e4
    params = [SamplingParams(top_p=SMALLEST_TOP_P), SamplingParams(temperature=MIN_TEMPERATURE),
              SamplingParams(temperature=FLOAT32_MAX, top_k=INT64_MAX, top_p=SMALLEST_TOP_P),
              SamplingParams(temperature=FLOAT32_MAX, top_k=2**62, seed=MAX_SEED)]
    generators = [Request("r", [1], p).generator for p in params]
    tokens = Sampler()(logits, params, generators)
    top = logits.argmax(dim=-1)
    assert tokens[:3].tolist() == top[:3].tolist()
    assert 0 <= tokens[3] < 320


PROMPTS = [[257, 72, 101, 108, 108, 111], [257] + list(range(60, 97)), list(range(40, 80))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
EXTREMES = [
    SamplingParams(max_tokens=12, temperature=MIN_TEMPERATURE, top_k=2**62, top_p=SMALLEST_TOP_P, seed=MAX_SEED,
                   ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=FLOAT32_MAX, top_k=INT64_MAX, seed=MIN_SEED, ignore_eos=True,
                   stop_token_ids=[INT64_MAX] + list(range(400, 1423)), stop=["\U0010ffff" * 256] * 64),
]


def test_extreme_requests_leave_the_others_of_their_batch_alone():
    llm = LLM("neo-tiny", device="cpu", perf_model="zero")
    try:
        alone = [llm.generate([prompt], params)[0].outputs[0].token_ids
                 for prompt, params in [(PROMPTS[0], GREEDY), (PROMPTS[1], SEEDED)]]
        greedy_of_third = llm.generate([PROMPTS[2]], GREEDY)[0].outputs[0].token_ids
        outputs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2]],
                               [GREEDY, EXTREMES[0], SEEDED, EXTREMES[1]])
        assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == alone
        assert all(len(output.outputs[0].token_ids) == 12 for output in outputs)
        assert all(output.outputs[0].finish_reason == "length" for output in outputs)
        # top_p below float32's range keeps only the top token: greedy.
        assert outputs[1].outputs[0].token_ids == greedy_of_third
    finally:
        llm.close()
