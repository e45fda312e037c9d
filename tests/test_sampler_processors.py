"""Penalties, the ``min_tokens`` mask and log-probabilities, against transformers.

The repetition penalty must equal transformers' ``RepetitionPenaltyLogitsProcessor``; presence
and frequency penalties a hand-written loop of OpenAI's formula. End to end on neo-tiny (saved
as a Hugging Face directory and loaded into transformers), greedy tokens with penalties or
``min_tokens`` must equal a step-by-step loop over transformers' full-sequence logits, and the
log-probabilities must be transformers' log_softmax of the raw logits (before penalties,
temperature, top-k and top-p), with the same ranks and top tokens, for the lockstep engine and
for host batches of the async host pipeline.
"""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engine_reference import PROMPTS, gib_for_blocks, transformers_tiny
from neo import LLM, SamplingParams
from neo.request import Request
from neo.runner.logits_processors import apply_penalties, process_logits
from neo.runner.token_logprobs import TokenLogprobs
from neo.tokenizer import Tokenizer

VOCAB = 320
POLICIES = {
    # name: engine options (gpu-only; neo with host batches of the async pipeline)
    "gpu-only": dict(policy="gpu-only", gpu_kv_cache_gib=gib_for_blocks(1024)),
    "neo-async": dict(policy="neo", gpu_kv_cache_gib=gib_for_blocks(10), host_pipeline="async"),
}
# float32 on every device this machine has: the CUDA engine samples on the GPU.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SETTINGS = {f"{name}-{device}": dict(options, device=device) for name, options in POLICIES.items()
            for device in DEVICES}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return transformers_tiny(str(tmp_path_factory.mktemp("neo-tiny")))


def make_llm(setting: str) -> LLM:
    return LLM("neo-tiny", dtype="float32", cpu_kv_cache_gib=gib_for_blocks(256), perf_model="zero", max_num_seqs=8,
               **SETTINGS[setting])


def request_with(params: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    request = Request("r", prompt, params)
    for token in output:
        request.append_token(token)
    return request


def random_history(generator: torch.Generator, length: int, low: int = 0, high: int = VOCAB) -> list[int]:
    """Tokens with repeats: drawn from a narrow range half of the time."""
    if torch.rand(1, generator=generator).item() < 0.5:
        high = low + 12
    return torch.randint(low, high, (length,), generator=generator).tolist()


def presence_frequency_reference(logits: torch.Tensor, output: list[int], presence: float,
                                 frequency: float) -> torch.Tensor:
    logits = logits.clone()
    for token in set(output):
        logits[token] -= presence + frequency * output.count(token)
    return logits


def test_repetition_penalty_equals_transformers(generator):
    penalties = [0.5, 1.0, 1.3, 2.0, 0.01, 100.0]
    logits = torch.randn(len(penalties), VOCAB, generator=generator) * 5
    logits[:, :8] = 0.0  # zero logits stay zero
    requests = [request_with(SamplingParams(repetition_penalty=penalty),
                             random_history(generator, 1 + row * 7), random_history(generator, row * 5))
                for row, penalty in enumerate(penalties)]
    penalized = apply_penalties(logits, requests)
    for row, (request, penalty) in enumerate(zip(requests, penalties)):
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        expected = processor(torch.tensor([request.all_token_ids]), logits[row:row + 1].clone())[0]
        torch.testing.assert_close(penalized[row], expected, rtol=1e-6, atol=0)


def test_presence_and_frequency_penalties_equal_the_formula(generator):
    """Over the output only (prompt tokens are not penalized), after the repetition penalty."""
    settings = [(0.0, 0.0, 1.0), (0.7, 0.0, 1.0), (0.0, -1.5, 1.0), (2.0, 2.0, 1.0), (-2.0, 0.3, 1.0),
                (0.5, 0.25, 1.4)]
    logits = torch.randn(len(settings), VOCAB, generator=generator) * 5
    requests = [request_with(SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                                            repetition_penalty=repetition),
                             random_history(generator, 20, high=160), random_history(generator, 3 + row * 6))
                for row, (presence, frequency, repetition) in enumerate(settings)]
    penalized = apply_penalties(logits, requests)
    for row, (request, (presence, frequency, repetition)) in enumerate(zip(requests, settings)):
        expected = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([request.all_token_ids]),
                                                                logits[row:row + 1].clone())[0]
        expected = presence_frequency_reference(expected, request.output_token_ids, presence, frequency)
        torch.testing.assert_close(penalized[row], expected, rtol=1e-6, atol=1e-5)


def test_rows_that_ask_nothing_are_untouched(generator):
    """A batch where no row asks gets its very logits back and no log-probabilities are
    computed; in a mixed batch the other rows are bit-identical and the input is left as it was."""
    logits = torch.randn(4, VOCAB, generator=generator)
    plain = [request_with(SamplingParams(), [1, 2, 3], [4, 4]) for _ in range(4)]
    assert process_logits(logits, plain) is logits
    assert TokenLogprobs.compute(logits, logits.argmax(dim=-1), plain) is None
    original = logits.clone()
    mixed = plain[:2] + [request_with(SamplingParams(frequency_penalty=1.0), [1, 2, 3], [4, 4])] + plain[3:]
    processed = process_logits(logits, mixed)
    assert torch.equal(logits, original)
    assert torch.equal(processed[[0, 1, 3]], original[[0, 1, 3]])
    assert processed[2, 4] == original[2, 4] - 2.0


def test_min_tokens_masks_the_stop_tokens_until_reached(generator):
    logits = torch.randn(5, VOCAB, generator=generator)
    params = SamplingParams(max_tokens=8, min_tokens=3)
    requests = [request_with(params, [1], [9] * generated) for generated in range(4)]
    requests.append(request_with(SamplingParams(), [1], []))
    for request in requests:
        request.min_tokens_stop_ids = frozenset({5, 7, VOCAB + 10})  # an id past the vocabulary is ignored
    processed = process_logits(logits, requests)
    masked = torch.isinf(processed)
    assert masked[:3, [5, 7]].all() and masked.sum() == 6
    assert torch.equal(processed[3:], logits[3:])


@torch.inference_mode()
def reference_loop(hf_model, prompt: list[int], max_tokens: int, repetition: float = 1.0, presence: float = 0.0,
                   frequency: float = 0.0, min_tokens: int = 0, stop_token_ids=()) -> list[int]:
    """Greedy tokens from transformers' full-sequence logits, penalized and masked by hand."""
    tokens = list(prompt)
    output = []
    while len(output) < max_tokens:
        logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
        logits = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([tokens]), logits[None])[0]
        logits = presence_frequency_reference(logits, output, presence, frequency)
        if len(output) < min_tokens:
            logits[list(stop_token_ids)] = float("-inf")
        token = int(logits.argmax())
        tokens.append(token)
        output.append(token)
        if token in stop_token_ids and len(output) >= min_tokens:
            break
    return output


# (prompt, penalties): each changes the prompt's greedy tokens within MAX_PENALIZED_TOKENS.
PENALIZED = [(PROMPTS[3], dict(repetition=1.6)), (PROMPTS[1], dict(presence=1.5, frequency=0.8)),
             (PROMPTS[2], dict(repetition=1.3, frequency=-0.5))]
MAX_PENALIZED_TOKENS = 12


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_with_penalties_equals_a_reference_loop(setting, hf_model):
    """Batched with the same prompts unpenalized, whose tokens the penalties change."""
    prompts = [prompt for prompt, _ in PENALIZED]
    params = [SamplingParams(max_tokens=MAX_PENALIZED_TOKENS, temperature=0, ignore_eos=True,
                             repetition_penalty=penalty.get("repetition", 1.0),
                             presence_penalty=penalty.get("presence", 0.0),
                             frequency_penalty=penalty.get("frequency", 0.0)) for _, penalty in PENALIZED]
    plain = SamplingParams(max_tokens=MAX_PENALIZED_TOKENS, temperature=0, ignore_eos=True)
    llm = make_llm(setting)
    try:
        outputs = llm.generate(prompts + prompts, params + [plain] * len(prompts))
        metrics = llm.get_metrics()
    finally:
        llm.close()
    tokens = [output.outputs[0].token_ids for output in outputs]
    penalized, unpenalized = tokens[:len(prompts)], tokens[len(prompts):]
    assert penalized == [reference_loop(hf_model, prompt, MAX_PENALIZED_TOKENS, **penalty)
                         for prompt, penalty in PENALIZED]
    assert all(a != b for a, b in zip(penalized, unpenalized))
    if setting.startswith("neo-async"):
        assert metrics["host_batches"] > 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_min_tokens_keeps_stop_tokens_out(setting, hf_model):
    """The first greedy token is made a stop token: alone it ends the request at once; with
    min_tokens it is masked for the first min_tokens tokens, then ends the request again."""
    prompt = PROMPTS[1]
    first = reference_loop(hf_model, prompt, 1)[0]
    llm = make_llm(setting)
    try:
        stopped, held = llm.generate([prompt, prompt], [
            SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first]),
            SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first], min_tokens=4)])
    finally:
        llm.close()
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].finish_reason == "stop"
    tokens = held.outputs[0].token_ids
    assert len(tokens) >= 4 and first not in tokens[:4]
    assert tokens == reference_loop(hf_model, prompt, 12, min_tokens=4, stop_token_ids=[first])


@torch.inference_mode()
def check_logprobs_against_transformers(hf_model, prompt: list[int], completion, count: int) -> None:
    tokenizer = Tokenizer.tiny()
    tokens = completion.token_ids
    logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    expected = logits.log_softmax(dim=-1)
    assert len(completion.logprobs) == len(tokens)
    total = 0.0
    for position, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
        row = expected[position]
        top_values, top_ids = row.topk(count)
        assert set(entry) == set(top_ids.tolist()) | {token}
        sampled = entry[token]
        assert sampled.logprob == pytest.approx(row[token].item(), abs=1e-4)
        if token not in top_ids.tolist():
            assert sampled.rank == int((row >= row[token]).sum())
        for rank, (value, token_id) in enumerate(zip(top_values.tolist(), top_ids.tolist()), start=1):
            assert entry[token_id].rank == rank and entry[token_id].logprob == pytest.approx(value, abs=1e-4)
        for token_id, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.decode([token_id], skip_special_tokens=False)
        total += row[token].item()
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_logprobs_are_transformers_raw_log_softmax(setting, hf_model):
    """Sampled with temperature, top-k, top-p and penalties, the log-probabilities are still
    those of the raw distribution; greedy tokens rank 1; logprobs=0 gives the sampled token
    only; a request without logprobs gets none."""
    max_tokens = 10
    processed = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_k=40, top_p=0.9, seed=11,
                               repetition_penalty=1.5, presence_penalty=0.5, ignore_eos=True, logprobs=5)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3)
    sampled_only = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5, ignore_eos=True, logprobs=0)
    without = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[3]]
    llm = make_llm(setting)
    try:
        outputs = llm.generate(prompts, [processed, greedy, sampled_only, without])
    finally:
        llm.close()
    completions = [output.outputs[0] for output in outputs]
    for prompt, completion, count in zip(prompts, completions[:3], [5, 3, 0]):
        check_logprobs_against_transformers(hf_model, prompt, completion, count)
    assert all(entry[token].rank == 1 for token, entry in zip(completions[1].token_ids, completions[1].logprobs))
    assert all(len(entry) == 1 for entry in completions[2].logprobs)
    assert completions[3].logprobs is None and completions[3].cumulative_logprob is None
