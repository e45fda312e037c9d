"""``SamplingParams(n=...)``: n completions of one prompt, fanned out into child requests in the
engine and gathered under the parent's id.

Completion ``i`` of a seeded request must equal the same prompt run alone with seed
``seed + i``; the engine's callers see the parent's id only; aborting the parent (or naming a
child) aborts every child; a child whose work fails ends the parent with its error. Every
case ends with no request left and every KV block free.
"""

import pytest
import torch

from engine_reference import PROMPTS, gib_for_blocks
from fault_injection import Faults
from neo import LLM, EngineConfig, GenerationError, LLMEngine, SamplingParams
from neo.engine.parallel_sampling import ParentRequest
from neo.request import KVLocation
from neo.sampling_params import MAX_SEED

COMMON = dict(device="cpu", cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8)
SETTINGS = {
    "gpu-only": dict(policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(1024)),
    "neo-async": dict(policy="neo", gpu_kv_cache_gib=gib_for_blocks(10), host_pipeline="async"),
}
# The seeded children on every device this machine has (sampling on the GPU for CUDA).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MAX_TOKENS = 10


def sampled(n: int = 1, seed: int | None = 7, **options) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, ignore_eos=True, n=n, **options)


def assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    for pool in (KVLocation.GPU, KVLocation.HOST):
        assert engine.block_manager.num_free(pool) == engine.block_manager.num_total(pool)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_completion_i_equals_the_prompt_alone_with_seed_plus_i(setting, device):
    llm = LLM("neo-tiny", **(COMMON | {"device": device, "dtype": "float32"}), **SETTINGS[setting])
    try:
        parent, other = llm.generate([PROMPTS[1], PROMPTS[0]], [sampled(n=4), SamplingParams(max_tokens=4)])
        alone = [llm.generate(PROMPTS[1], sampled(seed=7 + index))[0].outputs[0] for index in range(4)]
        wrapped = llm.generate(PROMPTS[2], sampled(n=2, seed=MAX_SEED))[0]
        wrapped_alone = [llm.generate(PROMPTS[2], sampled(seed=seed))[0].outputs[0].token_ids for seed in (-1, 0)]
        metrics = llm.get_metrics()
        assert_clean(llm.engine)
    finally:
        llm.close()
    assert parent.finished and len(parent.outputs) == 4 and len(other.outputs) == 1
    assert [completion.index for completion in parent.outputs] == [0, 1, 2, 3]
    assert [completion.token_ids for completion in parent.outputs] == [completion.token_ids for completion in alone]
    assert [completion.text for completion in parent.outputs] == [completion.text for completion in alone]
    assert all(completion.finish_reason == "length" for completion in parent.outputs)
    assert len({tuple(completion.token_ids) for completion in parent.outputs}) > 1
    assert [completion.token_ids for completion in wrapped.outputs] == wrapped_alone  # seed + 1 wraps to 0
    timing = parent.metrics
    assert timing.arrival_time <= timing.first_token_time <= timing.finish_time
    if setting == "neo-async":
        assert metrics["host_batches"] > 0


def test_greedy_completions_and_their_logprobs_are_identical():
    llm = LLM("neo-tiny", **COMMON, **SETTINGS["gpu-only"])
    try:
        output = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, n=3, logprobs=2))[0]
    finally:
        llm.close()
    first = output.outputs[0]
    assert len(first.logprobs) == len(first.token_ids) and first.cumulative_logprob is not None
    for completion in output.outputs[1:]:
        assert completion.token_ids == first.token_ids and completion.logprobs == first.logprobs
        assert completion.cumulative_logprob == first.cumulative_logprob


def test_the_engine_speaks_of_the_parent_only():
    engine = LLMEngine(EngineConfig(**COMMON, **SETTINGS["gpu-only"]))
    try:
        parent = engine.add_request(PROMPTS[0], sampled(n=3), request_id="p")
        assert isinstance(parent, ParentRequest) and parent.request_id == "p"
        for used in ("p", "1_p"):
            with pytest.raises(ValueError, match=f"request id '{used}' is already in use"):
                engine.add_request(PROMPTS[0], sampled(), request_id=used)
        engine.add_request(PROMPTS[0], sampled(), request_id="1_q")
        with pytest.raises(ValueError, match="request id '1_q' is already in use"):
            engine.add_request(PROMPTS[0], sampled(n=2), request_id="q")  # its second child's id
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert_clean(engine)
    finally:
        engine.close()
    mine = [output for output in outputs if output.request_id == "p"]
    assert {output.request_id for output in outputs} == {"p", "1_q"}
    assert all(len(output.outputs) == 3 for output in mine)
    assert [output.finished for output in mine] == [False] * (len(mine) - 1) + [True]
    assert [len(completion.token_ids) for completion in mine[-1].outputs] == [MAX_TOKENS] * 3


@pytest.mark.parametrize("by", ["parent id", "child id"])
def test_aborting_the_parent_aborts_every_child(by):
    engine = LLMEngine(EngineConfig(**COMMON, **SETTINGS["neo-async"]))
    try:
        engine.add_request(PROMPTS[1], sampled(n=4), request_id="p")
        other = engine.add_request(PROMPTS[0], sampled(), request_id="q")
        engine.step()
        engine.step()
        assert engine.abort_request("p" if by == "parent id" else "2_p")
        assert not engine.abort_request("p") and not engine.abort_request("0_p")
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert {output.request_id for output in outputs} <= {"q"}
        assert other.finish_reason == "length"
        assert_clean(engine)
        engine.add_request(PROMPTS[1], sampled(n=2), request_id="p")  # the id is free again
        assert engine.abort_all() == 1
        assert_clean(engine)
    finally:
        engine.close()


def test_a_failed_child_ends_its_parent_with_the_error():
    """A swap fault ends the children it moves; their siblings are aborted, the parent finishes
    with the error and ``generate`` raises it; the engine serves the next call."""
    llm = LLM("neo-tiny", **COMMON, policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(6), host_pipeline="lockstep")
    faults = Faults()
    faults.install(llm.engine)
    faults.fail_at("swap", [0])
    try:
        with pytest.raises(GenerationError) as raised:
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, n=6))
        assert faults.fired["swap"] == 1
        [output] = raised.value.outputs
        assert output.finished and "swap fault" in output.error
        reasons = [completion.finish_reason for completion in output.outputs]
        assert "error" in reasons and "abort" in reasons and set(reasons) <= {"error", "abort", "length"}
        assert_clean(llm.engine)
        again = llm.generate(PROMPTS[0], sampled(n=2))[0]
        assert again.error is None and len(again.outputs) == 2
    finally:
        llm.close()
