"""A mixed batch for comparing the engine with async scheduling on and off
(``EngineConfig.async_scheduling``): requests that end in every way the stop rule knows, an
abort mid-run, seeded sampling, parallel sampling, and requests whose plans take the synchronous
order (penalties, log-probabilities)."""

from engine_reference import BLOCK_BYTES, PROMPTS, gib_for_blocks
from neo import LLM, EngineConfig, LLMEngine, SamplingParams
from neo.request import KVLocation
from neo.sched.runner_output import UNRESOLVED_TOKEN

ABORTED_AT = 3  # tokens the request aborted mid-run has when the abort comes
STEP_LIMIT = 500  # steps any run here needs at most


def engine_for(async_scheduling: bool, gpu_blocks: int, device: str = "cpu", policy: str = "gpu-only",
               host_pipeline: str = "async", tensor_parallel_size: int = 1) -> LLMEngine:
    """A float32 neo-tiny engine whose pools hold ``gpu_blocks`` and 256 blocks on every rank
    (a rank's block holds 1 / ``tensor_parallel_size`` of the KV heads)."""
    block_bytes = BLOCK_BYTES // tensor_parallel_size
    return LLMEngine(EngineConfig(model="neo-tiny", device=device, dtype="float32", policy=policy,
                                  host_pipeline=host_pipeline, gpu_kv_cache_gib=gib_for_blocks(gpu_blocks, block_bytes),
                                  cpu_kv_cache_gib=gib_for_blocks(256, block_bytes), perf_model="zero", max_num_seqs=8,
                                  async_scheduling=async_scheduling, tensor_parallel_size=tensor_parallel_size))


def reference_run() -> list[tuple[list[int], str]]:
    """Greedy token ids and text of every prompt, with no stop condition but the length."""
    llm = LLM("neo-tiny", device="cpu", policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(1024), perf_model="zero",
              max_num_seqs=8, async_scheduling=False)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    return [(output.outputs[0].token_ids, output.outputs[0].text) for output in outputs]


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


def run_mixed(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[tuple]]:
    """Run the batch to its end, aborting request "5" once it has ``ABORTED_AT`` tokens; returns
    {request id: [(token ids, finish reason, text) per completion]}. Checks every step's outputs:
    no unresolved token, each request's tokens only grow, and it finishes once."""
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
                assert output.request_id not in results, f"request {output.request_id} finished twice"
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
