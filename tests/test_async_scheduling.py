"""Async scheduling (``EngineConfig.async_scheduling``) on the CPU in float32: iteration k+1 is
planned and launched before iteration k's tokens are read, so each step returns the tokens of
the iteration before, and a request that stops has one more token computed and dropped.

The tokens of a mixed batch (different ``max_tokens``, stop token ids, stop strings,
``min_tokens``, an abort mid-run, seeded sampling at temperature > 0, parallel sampling, and
requests with penalties or log-probabilities, which take the synchronous order) must equal those
of the synchronous engine, with a GPU pool large enough for all and one so small that requests
are preempted; every KV block must be free again afterwards; greedy tokens must equal
transformers'.
"""

import pytest

from engine_reference import NEW_TOKENS, PROMPTS, gib_for_blocks, greedy_continuations, transformers_tiny
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.request import KVLocation
from neo.sched.runner_output import UNRESOLVED_TOKEN

ABORTED_AT = 3  # tokens the request aborted mid-run has when the abort comes
STEP_LIMIT = 500  # steps any run here needs at most


def engine_for(async_scheduling: bool, gpu_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="neo-tiny", device="cpu", policy="gpu-only",
                                  gpu_kv_cache_gib=gib_for_blocks(gpu_blocks), cpu_kv_cache_gib=gib_for_blocks(256),
                                  perf_model="zero", max_num_seqs=8, async_scheduling=async_scheduling))


def reference_run() -> list[tuple[list[int], str]]:
    """Greedy token ids and text of every prompt, with no stop condition but the length."""
    llm = LLM("neo-tiny", device="cpu", policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(1024), perf_model="zero",
              max_num_seqs=8, async_scheduling=False)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    return [(output.outputs[0].token_ids, output.outputs[0].text) for output in outputs]


@pytest.fixture(scope="module")
def mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    return make_mixed_requests()


def make_mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    """(prompt, parameters) of a batch that ends its requests in every way the stop rule knows,
    the stop tokens and strings taken from what the model generates."""
    reference = reference_run()
    stop_token = reference[1][0][5]  # ends request 1 at its 6th token, or earlier
    text = reference[0][1]
    stop_string = next(character for character in text[2:] if character.isascii() and character.isprintable())
    return [
        (PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop_string])),
        (PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_token])),
        (PROMPTS[2], SamplingParams(max_tokens=1, temperature=0)),
        (PROMPTS[3], SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
        (PROMPTS[4], SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=11, ignore_eos=True)),
        (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)),  # aborted mid-run
        (PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, min_tokens=6, stop_token_ids=[stop_token])),
        (PROMPTS[2], SamplingParams(max_tokens=30, temperature=0.8, seed=3, n=2, ignore_eos=True)),
        (PROMPTS[3], SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
        (PROMPTS[4], SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)),
    ]


def run_mixed(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    """Run the batch to its end, aborting request "5" once it has ``ABORTED_AT`` tokens; returns
    {request id: [(token ids, finish reason, text) per completion]}. Checks every step's outputs:
    no unresolved token, and each request's tokens only grow."""
    for index, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, request_id=str(index))
    seen: dict[str, list[list[int]]] = {}
    results = {}
    for _ in range(STEP_LIMIT):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            completions = [completion.token_ids for completion in output.outputs]
            assert all(UNRESOLVED_TOKEN not in tokens for tokens in completions), output
            before = seen.get(output.request_id, [[] for _ in completions])
            assert all(new[:len(old)] == old for new, old in zip(completions, before)), output
            seen[output.request_id] = completions
            if output.finished:
                results[output.request_id] = [(c.token_ids, c.finish_reason, c.text) for c in output.outputs]
            elif output.request_id == "5" and len(completions[0]) >= ABORTED_AT:
                assert engine.abort_request("5")
                results["5"] = [(completions[0], "abort", None)]
    assert not engine.has_unfinished_requests(), f"not done in {STEP_LIMIT} steps"
    return results


def assert_all_blocks_free(engine: LLMEngine) -> None:
    manager = engine.block_manager
    for pool in (KVLocation.GPU, KVLocation.HOST):
        assert manager.num_free(pool) == manager.num_total(pool), pool


@pytest.mark.parametrize("gpu_blocks", [1024, 12], ids=["roomy", "preempting"])
def test_mixed_batch_tokens_equal_the_synchronous_engine(gpu_blocks, mixed_requests):
    results = {}
    for async_scheduling in (False, True):
        engine = engine_for(async_scheduling, gpu_blocks)
        try:
            results[async_scheduling] = run_mixed(engine, mixed_requests)
            engine.step()  # the iteration still in flight, if any, only drops tokens
            assert_all_blocks_free(engine)
            if gpu_blocks == 12:
                assert engine.metrics.preemptions > 0
        finally:
            engine.close()
    assert results[True] == results[False]
    reasons = {request_id: completions[0][1] for request_id, completions in results[False].items()}
    assert reasons["0"] == reasons["1"] == "stop"  # the stop string and the stop token were found
    assert reasons["2"] == "length" and reasons["5"] == "abort"
    assert len(results[False]["2"][0][0]) == 1 and len(results[False]["5"][0][0]) == ABORTED_AT
    assert len(results[False]["6"][0][0]) >= 6  # min_tokens held the stop token back


def test_each_step_returns_the_previous_iterations_tokens():
    """The prefill's token is still on its way when its step returns; the next step returns it
    (and queues the next token's iteration). With the setting off, the prefill's step returns it."""
    for async_scheduling in (False, True):
        engine = engine_for(async_scheduling, 1024)
        try:
            request = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0))
            outputs = engine.step()
            if async_scheduling:
                assert outputs == [] and request.output_token_ids == [UNRESOLVED_TOKEN]
            else:
                assert len(outputs) == 1 and outputs[0].outputs[0].token_ids == request.output_token_ids
            assert len(engine.step()[0].outputs[0].token_ids) == (1 if async_scheduling else 2)
        finally:
            engine.close()


def test_async_scheduling_is_off_by_default_on_the_cpu():
    engine = LLMEngine(EngineConfig(model="neo-tiny", device="cpu", gpu_kv_cache_gib=gib_for_blocks(64)))
    try:
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
        assert len(engine.step()) == 1
    finally:
        engine.close()


@pytest.mark.parametrize("gpu_blocks", [1024, 8], ids=["roomy", "preempting"])
def test_greedy_equals_transformers(gpu_blocks, tmp_path):
    expected = greedy_continuations(transformers_tiny(str(tmp_path)))
    llm = LLM("neo-tiny", device="cpu", policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(gpu_blocks),
              cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8, async_scheduling=True)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        llm.engine.step()
        assert_all_blocks_free(llm.engine)
        preemptions = llm.get_metrics()["preemptions"]
    finally:
        llm.close()
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert (preemptions > 0) == (gpu_blocks == 8)


@pytest.mark.parametrize("settings, message", [
    (dict(policy="neo"), "async_scheduling=True needs policy 'gpu-only', got policy 'neo'"),
    (dict(tensor_parallel_size=2), "async_scheduling=True needs tensor_parallel_size 1, got 2"),
])
def test_async_scheduling_where_unsupported_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="neo-tiny", device="cpu", async_scheduling=True, **settings)
