"""The OpenAI-compatible server, through a real uvicorn server on a loopback port (CPU, neo-tiny).

Two servers run for the module: neo-tiny with its tokenizer (gpu-only policy), and neo-tiny
saved as a directory without ``tokenizer.json`` (neo policy, a GPU pool of 4 blocks, so
requests decode on the host). Expected outputs come from ``LLM.generate`` on a separate
engine. Every network call has a timeout and every server start is bounded, so a stuck
server fails the test instead of hanging it.
"""

import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from neo import LLM, SamplingParams
from neo.models.tiny import save_tiny
from neo.server.detokenizer import IncrementalDetokenizer
from neo.server.streaming import sse_event
from neo.tokenizer import Tokenizer
from benchmark_modules import BENCHMARKS, benchmark_module
from server_harness import (
    BLOCK_BYTES,
    HTTP_TIMEOUT,
    TINY_OPTIONS,
    TOKENLESS_OPTIONS,
    LiveServer,
    StreamResult,
    client_for,
    get,
    live_server,
    metric,
    parse_prometheus,
    post,
    run,
    serve_process,
    stream_request,
    wait_for_idle,
)



@pytest.fixture(scope="module")
def tiny_server():
    with live_server("neo-tiny", TINY_OPTIONS) as server:
        yield server


@pytest.fixture(scope="module")
def tokenless_directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("neo-tiny-no-tokenizer")
    save_tiny(str(directory))
    os.remove(directory / "tokenizer.json")
    return str(directory)


@pytest.fixture(scope="module")
def tokenless_server(tokenless_directory):
    with live_server(tokenless_directory, TOKENLESS_OPTIONS) as server:
        yield server


@pytest.fixture(scope="module")
def reference_llm():
    llm = LLM("neo-tiny", **TINY_OPTIONS)
    yield llm
    llm.close()


# -- HTTP helpers --------------------------------------------------------------------------------




# -- outputs equal LLM.generate ------------------------------------------------------------------


def random_text(rng: random.Random, length: int) -> str:
    alphabet = "abcdefghij klmnopqrstuvwxyz,.é日本🎉"
    return "".join(rng.choice(alphabet) for _ in range(length))


def generation_cases(seed: int) -> list[tuple[str, object, dict]]:
    """(case name, prompt, request fields) with fresh random prompts."""
    rng = random.Random(seed)
    return [
        ("text-greedy", random_text(rng, rng.randint(5, 30)),
         dict(max_tokens=24, temperature=0)),
        ("token-ids-greedy-ignore-eos", [rng.randrange(256) for _ in range(rng.randint(3, 40))],
         dict(max_tokens=30, temperature=0, ignore_eos=True)),
        ("text-seeded-sampling", random_text(rng, 12),
         dict(max_tokens=20, temperature=0.8, top_k=40, top_p=0.9, seed=rng.randrange(2**31))),
    ]


def sampling_params(fields: dict) -> SamplingParams:
    return SamplingParams(**{key: value for key, value in fields.items()
                             if key not in ("return_token_ids", "stream_options")})


def fetch_both(server: LiveServer, path: str, body: dict) -> tuple[dict, StreamResult]:
    """The non-streamed response and the streamed one (with usage) of the same request."""
    body = body | {"return_token_ids": True}
    response = post(server, path, body)
    assert response.status_code == 200, response.text

    async def streamed():
        async with client_for(server) as client:
            return await stream_request(client, path, body | {"stream_options": {"include_usage": True}})

    stream = run(streamed())
    assert stream.status == 200 and stream.done
    return response.json(), stream


def assert_stream_matches(stream: StreamResult, response: dict, expected_tokens: list[int],
                          expected_text: str | None) -> None:
    choice = response["choices"][0]
    assert choice["token_ids"] == expected_tokens
    assert stream.token_ids == expected_tokens
    assert stream.chunks[-1]["choices"] == [] and stream.chunks[-1]["usage"] == response["usage"]
    stream.chunks.pop()
    assert all(chunk["usage"] is None for chunk in stream.chunks)
    assert stream.finish_reason == choice["finish_reason"]
    assert response["usage"]["completion_tokens"] == len(expected_tokens)
    assert response["usage"]["total_tokens"] == (response["usage"]["prompt_tokens"]
                                                 + len(expected_tokens))
    if expected_text is not None:
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text == expected_text
        assert stream.text == expected_text


@pytest.mark.parametrize("case", range(3), ids=["text-greedy", "token-ids-greedy-ignore-eos",
                                                 "text-seeded-sampling"])
def test_streamed_equals_non_streamed_equals_generate(case, seed, tiny_server, reference_llm):
    _, prompt, fields = generation_cases(seed)[case]
    expected = reference_llm.generate(prompt, sampling_params(fields))[0]
    response, stream = fetch_both(tiny_server, "/v1/completions", dict(prompt=prompt, **fields))
    tokenizer = reference_llm.get_tokenizer()
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    assert response["usage"]["prompt_tokens"] == len(prompt_ids)
    assert response["model"] == "neo-tiny" and response["object"] == "text_completion"
    assert_stream_matches(stream, response, expected.outputs[0].token_ids, expected.outputs[0].text)


def test_stop_string_cuts_streamed_and_non_streamed_text_alike(seed, tiny_server, reference_llm):
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(10)]
    free_run = reference_llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0,
                                                             ignore_eos=True))[0].outputs[0].text
    # A two-character stop string from the middle of the text (no replacement characters).
    start = next(index for index in range(8, len(free_run) - 1)
                 if "\ufffd" not in free_run[index:index + 2])
    stop = free_run[start:start + 2]
    fields = dict(max_tokens=40, temperature=0, ignore_eos=True, stop=stop)
    expected = reference_llm.generate(prompt, sampling_params(fields))[0].outputs[0]
    assert expected.finish_reason == "stop" and stop not in expected.text
    response, stream = fetch_both(tiny_server, "/v1/completions", dict(prompt=prompt, **fields))
    assert_stream_matches(stream, response, expected.token_ids, expected.text)
    assert response["choices"][0]["finish_reason"] == "stop"


def test_chat_completion_uses_the_chat_template(tiny_server, reference_llm):
    messages = [{"role": "system", "content": "answer briefly"},
                {"role": "user", "content": "héllo wörld 日本"}]
    tokenizer = reference_llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered == "<|begin_of_text|>system: answer briefly\nuser: héllo wörld 日本\nassistant: "
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    expected = reference_llm.generate(prompt_ids, SamplingParams(max_tokens=20, temperature=0))[0]
    body = dict(model="neo-tiny", messages=messages, max_tokens=20, temperature=0)
    response, stream = fetch_both(tiny_server, "/v1/chat/completions", body)
    assert response["object"] == "chat.completion"
    assert response["choices"][0]["message"]["role"] == "assistant"
    assert response["usage"]["prompt_tokens"] == len(prompt_ids)
    assert stream.chunks[0]["object"] == "chat.completion.chunk"
    assert stream.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert_stream_matches(stream, response, expected.outputs[0].token_ids, expected.outputs[0].text)
    # Content given as text parts renders the same prompt.
    parts = [{"role": message["role"], "content": [{"type": "text", "text": message["content"]}]}
             for message in messages]
    again = post(tiny_server, "/v1/chat/completions", body | {"messages": parts}).json()
    assert again["choices"][0]["message"]["content"] == expected.outputs[0].text


def test_requests_are_prepared_off_the_event_loop(tiny_server):
    """The chat template is rendered and prompts are tokenized on the server's preparing
    threads, never on the event loop's."""
    tokenizer = tiny_server.async_engine.engine.tokenizer
    threads = []

    def recorded(method):
        def call(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return method(*args, **kwargs)
        return call

    tokenizer.encode = recorded(tokenizer.encode)
    tokenizer.apply_chat_template = recorded(tokenizer.apply_chat_template)
    try:
        text = post(tiny_server, COMPLETIONS, {"prompt": "hello", "max_tokens": 2})
        chat = post(tiny_server, CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2})
    finally:
        del tokenizer.encode, tokenizer.apply_chat_template
    assert text.status_code == chat.status_code == 200
    assert len(threads) == 3 and all(name.startswith("neo-prepare") for name in threads), threads


def test_neo_policy_streams_from_the_host_pool(seed, tokenless_server, reference_llm):
    """Token-id prompts on a model without tokenizer; with a 4-block GPU pool most requests
    decode on the host CPU. Concurrent streams still equal LLM.generate."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [output.outputs[0].token_ids for output in reference_llm.generate(prompts, params)]
    body = dict(model=tokenless_server.model, max_tokens=16, temperature=0, ignore_eos=True,
                return_token_ids=True)

    async def main():
        async with client_for(tokenless_server) as client:
            before = parse_prometheus((await client.get("/metrics")).text)
            streams = await asyncio.gather(*(stream_request(client, "/v1/completions",
                                                            body | {"prompt": prompt})
                                             for prompt in prompts))
            plain = await client.post("/v1/completions", json=body | {"prompt": prompts[0]})
            after = await wait_for_idle(client)
            return before, streams, plain.json(), after

    before, streams, plain, after = run(main())
    assert [stream.token_ids for stream in streams] == expected
    assert all(stream.done and stream.text == "" for stream in streams)
    assert plain["choices"][0]["token_ids"] == expected[0] and plain["choices"][0]["text"] == ""
    host_tokens = (metric(after, "neo_host_decode_tokens_total")
                  - metric(before, "neo_host_decode_tokens_total"))
    assert host_tokens > 0
    info = dict(next(iter(after["neo_engine_info"])))
    assert (info["model"], info["policy"]) == (tokenless_server.model, "neo")


# -- many clients, some leaving ------------------------------------------------------------------


def test_many_streams_with_disconnects_leave_no_blocks(seed, tiny_server):
    """200 concurrent streams; every fourth client drops its connection after two chunks.
    The others complete, nothing errs, and afterwards no KV block is in use."""
    rng = random.Random(seed)
    num_clients, max_tokens = 200, 8

    async def client_task(client, index):
        prompt = [rng.randrange(256) for _ in range(rng.randint(2, 20))]
        leaves = index % 4 == 0
        # Leaving requests could never finish in this test's time: they must be aborted.
        body = dict(prompt=prompt, temperature=0, ignore_eos=True, return_token_ids=True,
                    max_tokens=4000 if leaves else max_tokens)
        return leaves, await stream_request(client, "/v1/completions", body,
                                            stop_after=2 if leaves else None)

    async def main():
        async with client_for(tiny_server) as client:
            before = parse_prometheus((await client.get("/metrics")).text)
            results = await asyncio.gather(*(client_task(client, index)
                                             for index in range(num_clients)))
            after = await wait_for_idle(client)
            return before, results, after

    before, results, after = run(main())
    staying = [result for leaves, result in results if not leaves]
    leaving = [result for leaves, result in results if leaves]
    assert len(staying) == 150 and len(leaving) == 50
    assert all(result.status == 200 for _, result in results)
    for result in staying:
        assert result.done and result.finish_reason == "length"
        assert len(result.token_ids) == max_tokens
    assert all(len(result.chunks) == 2 for result in leaving)

    def delta(name):
        return metric(after, name) - metric(before, name)

    assert delta("neo_requests_aborted_total") == len(leaving)
    assert delta("neo_requests_finished_total") == len(staying)
    assert metric(after, "neo_kv_cache_blocks_used", pool="gpu") == 0


def test_batch_requests_left_early_leave_no_blocks(seed, tiny_server):
    """Clients sending a batch of 3 prompts leave early: 4 streams after 3 chunks, 4 plain
    requests by timing out. Every prompt's engine request is aborted, a batch sent alongside
    completes, and afterwards no KV block is in use."""
    rng = random.Random(seed)

    def batch() -> list[list[int]]:
        return [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(3)]

    endless = dict(temperature=0, ignore_eos=True, return_token_ids=True, max_tokens=4000)

    async def plain_leaving(client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(COMPLETIONS, json=endless | {"prompt": batch()}, timeout=0.5)

    async def main():
        async with client_for(tiny_server) as client:
            before = parse_prometheus((await client.get("/metrics")).text)
            streams = asyncio.gather(*(stream_request(client, COMPLETIONS,
                                                      endless | {"prompt": batch()},
                                                      stop_after=3) for _ in range(4)))
            plain = asyncio.gather(*(plain_leaving(client) for _ in range(4)))
            staying = client.post(COMPLETIONS, json=dict(prompt=batch(), max_tokens=5,
                                                         ignore_eos=True))
            results = await asyncio.gather(streams, plain, staying)
            after = await wait_for_idle(client)
            return before, results, after

    before, (streams, _, staying), after = run(main())
    assert all(stream.status == 200 and len(stream.chunks) == 3 for stream in streams)
    assert staying.status_code == 200
    assert [choice["index"] for choice in staying.json()["choices"]] == [0, 1, 2]
    assert metric(after, "neo_requests_aborted_total") - metric(
        before, "neo_requests_aborted_total") == 8 * 3
    assert metric(after, "neo_kv_cache_blocks_used", pool="gpu") == 0
    assert metric(after, "neo_kv_cache_usage_ratio", pool="gpu") == 0
    engine = tiny_server.async_engine.engine
    assert all(pool.num_used == 0 for pool in engine.block_manager.pools.values())
    assert not engine.has_unfinished_requests()


def test_parallel_sampling_stream_left_early_leaves_no_blocks(tiny_server):
    """A client leaves an n=4 stream after 3 chunks while another n=4 request is left by timing
    out: each parent's 4 children are aborted and afterwards no KV block is in use."""
    endless = dict(prompt=[1, 2, 3], n=4, temperature=1.0, seed=5, ignore_eos=True,
                   return_token_ids=True, max_tokens=4000)

    async def plain_leaving(client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(COMPLETIONS, json=endless, timeout=0.5)

    async def main():
        async with client_for(tiny_server) as client:
            before = parse_prometheus((await client.get("/metrics")).text)
            stream, _ = await asyncio.gather(
                stream_request(client, COMPLETIONS, endless | {"stream": True}, stop_after=3),
                plain_leaving(client))
            after = await wait_for_idle(client)
            return before, stream, after

    before, stream, after = run(main())
    assert stream.status == 200 and len(stream.chunks) == 3
    assert metric(after, "neo_requests_aborted_total") - metric(
        before, "neo_requests_aborted_total") == 2 * 4
    assert metric(after, "neo_kv_cache_blocks_used", pool="gpu") == 0
    engine = tiny_server.async_engine.engine
    assert all(pool.num_used == 0 for pool in engine.block_manager.pools.values())
    assert not engine.has_unfinished_requests()


# -- errors --------------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ERROR_CASES = {
    # name: (path, raw body or JSON body, status, message fragment, param)
    "malformed-json": (COMPLETIONS, b'{"prompt": "hi",', 400, "not valid JSON", None),
    "not-an-object": (COMPLETIONS, b"[1, 2]", 400, "must be a JSON object", None),
    "missing-prompt": (COMPLETIONS, {"max_tokens": 5}, 400, "missing field 'prompt'", "prompt"),
    "wrong-type": (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, 400,
                   "field 'max_tokens'", "max_tokens"),
    "max-tokens-zero": (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400,
                        "max_tokens must be an integer >= 1, got 0", "max_tokens"),
    "max-completion-tokens-zero": (CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                          "max_completion_tokens": 0}, 400,
                                   "max_tokens must be an integer >= 1, got 0",
                                   "max_completion_tokens"),
    "max-tokens-true": (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, 400,
                        "field 'max_tokens': Input should be a valid integer", "max_tokens"),
    "negative-temperature": (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, 400,
                             "temperature must be >= 0", "temperature"),
    "top-p-above-one": (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400,
                        "top_p must be in (0, 1]", "top_p"),
    "bad-top-k": (COMPLETIONS, {"prompt": "hi", "top_k": -2}, 400, "top_k must be -1, 0",
                  "top_k"),
    "empty-stop-string": (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400,
                          "stop strings must be non-empty", "stop"),
    "bad-stop-token-id": (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1]}, 400,
                          "stop_token_ids must be non-negative", "stop_token_ids"),
    "seed-out-of-range": (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, 400,
                          "seed must be an integer in [-2**63, 2**64 - 1]", "seed"),
    "n-zero": (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n must be an integer in [1, 128], "
               "got 0", "n"),
    "n-above-max": (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 129}, 400,
                    "n must be an integer in [1, 128], got 129", "n"),
    "logprobs-above-max": (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400,
                           "logprobs must be None or an integer in [0, 20], got 21", "logprobs"),
    "top-logprobs-above-max": (CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                      "logprobs": True, "top_logprobs": 21}, 400,
                               "top_logprobs: logprobs must be None or an integer in [0, 20]",
                               "top_logprobs"),
    "top-logprobs-without-logprobs": (CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                             "top_logprobs": 2}, 400,
                                      "top_logprobs (got 2) needs logprobs set to true",
                                      "top_logprobs"),
    "min-tokens-above-max-tokens": (COMPLETIONS, {"prompt": "hi", "max_tokens": 3,
                                                  "min_tokens": 4}, 400,
                                    "min_tokens must be an integer in [0, max_tokens=3], got 4",
                                    "min_tokens"),
    "repetition-penalty-zero": (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, 400,
                                "repetition_penalty must be a number in [0.01, 100.0]",
                                "repetition_penalty"),
    "stream-options-without-stream": (COMPLETIONS, {"prompt": "hi", "stream_options": {
        "include_usage": True}}, 400, "only allowed when stream is true", "stream_options"),
    "presence-penalty-above-max": (COMPLETIONS, {"prompt": "hi", "presence_penalty": 3}, 400,
                                   "presence_penalty must be a number in [-2.0, 2.0] (0 disables "
                                   "it), got 3.0", "presence_penalty"),
    "frequency-penalty-below-min": (CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                           "frequency_penalty": -2.5}, 400,
                                    "frequency_penalty must be a number in [-2.0, 2.0]",
                                    "frequency_penalty"),
    "batch-too-large": (COMPLETIONS, {"prompt": [[1]] * 257}, 400,
                        "a batch of 257 prompts: this server takes at most 256", "prompt"),
    "batch-mixed": (COMPLETIONS, {"prompt": ["a", [1]]}, 400, "a list of token id lists",
                    "prompt"),
    "batch-empty-member": (COMPLETIONS, {"prompt": [[1], []]}, 400,
                           "the prompt is empty (batch position 1)", "prompt"),
    "empty-prompt": (COMPLETIONS, {"prompt": ""}, 400, "the prompt is empty", "prompt"),
    "bad-token-list": (COMPLETIONS, {"prompt": [1, "a"]}, 400, "list of integer token ids",
                       "prompt"),
    "batch-token-outside-vocabulary": (COMPLETIONS, {"prompt": [[1, 2], [1, 400]]}, 400,
                                       "token id 400 is outside the vocabulary", "prompt"),
    "token-outside-vocabulary": (COMPLETIONS, {"prompt": [1, 400]}, 400,
                                 "token id 400 is outside the vocabulary [0, 320)", "prompt"),
    "prompt-longer-than-model": (COMPLETIONS, {"prompt": [65] * 4100}, 400,
                                 "prompt of 4100 tokens is too long: the model's context is 4096",
                                 "prompt"),
    "unknown-model": (COMPLETIONS, {"prompt": "hi", "model": "gpt-9"}, 404,
                      "the model 'gpt-9' does not exist: this server serves 'neo-tiny'", "model"),
    "chat-no-messages": (CHAT, {"messages": []}, 400, "at least one message", "messages"),
    "chat-image-part": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "text": "x"}]}]}, 400, "only text message content", "messages"),
    "chat-unknown-message-field": (CHAT, {"messages": [{"role": "user", "content": "x",
                                                        "mood": "ok"}]}, 400,
                                   "unknown field 'messages.0.mood'", "messages.0.mood"),
}
TOKENLESS_ERROR_CASES = {
    "text-prompt": (COMPLETIONS, {"prompt": "hello"}, 400, "has no tokenizer", "prompt"),
    "chat": (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, 400,
             "has no tokenizer, so it has no chat template", "messages"),
    "stop-string": (COMPLETIONS, {"prompt": [1, 2], "stop": "x"}, 400,
                    "stop strings need a tokenizer", "stop"),
    "prompt-larger-than-pools": (COMPLETIONS, {"prompt": [65] * 1100}, 400,
                                 "prompt of 1100 tokens can never fit the KV pools: the largest "
                                 "holds 1024 tokens (GPU pool 4 blocks, host pool 64 blocks",
                                 "prompt"),
}


def check_error_case(server: LiveServer, case: tuple, good_prompt: list[int],
                     expected_tokens: list[int]) -> None:
    """Send the bad request while a good one streams; then a good request right after."""
    path, body, status, message, param = case
    good = dict(prompt=good_prompt, max_tokens=12, temperature=0, ignore_eos=True,
                return_token_ids=True)

    async def main():
        async with client_for(server) as client:
            streaming = asyncio.ensure_future(stream_request(client, COMPLETIONS, good))
            await asyncio.sleep(0.05)
            if isinstance(body, bytes):
                bad = await client.post(path, content=body,
                                        headers={"content-type": "application/json"})
            else:
                bad = await client.post(path, json=body)
            after = await client.post(COMPLETIONS, json=good)
            return bad, await streaming, after

    bad, streamed, after = run(main())
    assert bad.status_code == status, bad.text
    error = bad.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert streamed.status == 200 and streamed.done and streamed.token_ids == expected_tokens
    assert after.status_code == 200 and after.json()["choices"][0]["token_ids"] == expected_tokens


@pytest.fixture(scope="module")
def good_request(reference_llm):
    prompt = [257, 72, 101, 108, 108, 111]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return prompt, reference_llm.generate(prompt, params)[0].outputs[0].token_ids


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_error_responses(name, tiny_server, good_request):
    check_error_case(tiny_server, ERROR_CASES[name], *good_request)


@pytest.mark.parametrize("name", list(TOKENLESS_ERROR_CASES))
def test_error_responses_without_tokenizer(name, tokenless_server, good_request):
    check_error_case(tokenless_server, TOKENLESS_ERROR_CASES[name], *good_request)


def test_failed_iteration_becomes_a_server_error(tiny_server, good_request):
    """An iteration that raises ends its requests with an error (500, or an error event once
    a stream has started); the server goes on serving."""
    engine = tiny_server.async_engine.engine
    launch = engine.runner.launch
    marker = [300, 301, 302]

    def failing_launch(plan, *args, **kwargs):  # fails the marked request's third token
        if any(request.prompt_token_ids == marker and request.num_output_tokens == 2
               for request in plan.requests):
            raise RuntimeError("injected kernel failure")
        return launch(plan, *args, **kwargs)

    async def main():
        async with client_for(tiny_server) as client:
            body = {"prompt": marker, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
            plain = await client.post(COMPLETIONS, json=body)
            streamed = await stream_request(client, COMPLETIONS, body)
            good = await client.post(COMPLETIONS, json=dict(
                prompt=good_request[0], max_tokens=12, temperature=0, ignore_eos=True,
                return_token_ids=True))
            return plain, streamed, good

    engine.runner.launch = failing_launch
    try:
        plain, streamed, good = run(main())
    finally:
        engine.runner.launch = launch
    assert plain.status_code == 500
    assert plain.json()["error"]["type"] == "server_error"
    assert "injected kernel failure" in plain.json()["error"]["message"]
    assert streamed.status == 200 and streamed.done
    assert "injected kernel failure" in streamed.chunks[-1]["error"]["message"]
    assert sum(len(chunk["choices"][0]["token_ids"]) for chunk in streamed.chunks[:-1]) == 2
    assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == good_request[1]


def test_unknown_model_error_code(tiny_server):
    response = post(tiny_server, COMPLETIONS, {"prompt": "hi", "model": "other"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_unknown_route_and_method(tiny_server):
    response = get(tiny_server, "/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["message"] == "Not Found"
    response = get(tiny_server, COMPLETIONS)
    assert response.status_code == 405 and "error" in response.json()


def test_models_and_health(tiny_server):
    models = get(tiny_server, "/v1/models").json()
    assert models["object"] == "list"
    assert [(card["id"], card["object"], card["max_model_len"]) for card in models["data"]] == [
        ("neo-tiny", "model", 4096)]
    health = get(tiny_server, "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_exposition(seed, tiny_server):
    rng = random.Random(seed)
    prompt = [rng.randrange(256) for _ in range(rng.randint(17, 40))]
    engine = tiny_server.async_engine.engine

    async def main():
        async with client_for(tiny_server) as client:
            before = await wait_for_idle(client)
            body = dict(prompt=prompt, max_tokens=500, temperature=0, ignore_eos=True,
                        return_token_ids=True)
            async with client.stream("POST", COMPLETIONS, json=body | {"stream": True}) as response:
                lines = response.aiter_lines()
                for _ in range(6):  # three events: "data: ..." and a blank line each
                    await anext(lines)
                during = parse_prometheus((await client.get("/metrics")).text)
            after = await wait_for_idle(client)
            return before, during, after

    before, during, after = run(main())
    info = next(iter(during["neo_engine_info"]))
    assert dict(info)["model"] == "neo-tiny" and dict(info)["policy"] == "gpu-only"
    assert metric(during, "neo_requests_running") == 1
    assert metric(during, "neo_requests_waiting") == 0
    assert metric(during, "neo_requests_in_kv_pool", pool="gpu") == 1
    assert metric(during, "neo_requests_in_kv_pool", pool="host") == 0
    used = metric(during, "neo_kv_cache_blocks_used", pool="gpu")
    total = metric(during, "neo_kv_cache_blocks", pool="gpu")
    assert total == engine.layout.num_gpu_blocks
    assert metric(during, "neo_kv_cache_blocks", pool="host") == engine.layout.num_host_blocks
    assert math.ceil((len(prompt) + 3) / 16) <= used <= math.ceil((len(prompt) + 500) / 16)
    assert metric(during, "neo_kv_cache_usage_ratio", pool="gpu") == pytest.approx(used / total)
    assert metric(during, "neo_generation_tokens_per_second") > 0
    assert 0 <= metric(during, "neo_two_batch_iteration_ratio") <= 1
    generated = (metric(after, "neo_output_tokens_total")
                 - metric(before, "neo_output_tokens_total"))
    assert 3 <= generated < 500
    assert metric(after, "neo_requests_aborted_total") - metric(before, "neo_requests_aborted_total") == 1
    assert metric(after, "neo_requests_running") == 0
    counters = [name for name in after if name.endswith("_total")]
    assert {"neo_iterations_total", "neo_two_batch_iterations_total", "neo_prefill_tokens_total",
            "neo_gpu_decode_tokens_total", "neo_host_decode_tokens_total"} <= set(counters)


# -- detokenizer ---------------------------------------------------------------------------------


def test_detokenizer_holds_back_split_characters():
    tokenizer = Tokenizer.tiny()
    text = "héllo wörld 日本 🎉!"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) == len(text.encode())  # one token per byte
    detokenizer = IncrementalDetokenizer(tokenizer, stop=[])
    deltas = [detokenizer.update(token_ids[:end]) for end in range(1, len(token_ids) + 1)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[text.encode().index("é".encode()) + 1] == "é"
    assert detokenizer.finish(text) == ""


def test_detokenizer_holds_back_a_possible_stop_string():
    tokenizer = Tokenizer.tiny()
    token_ids = tokenizer.encode("abcdef", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["xyz", "cd"])
    deltas = [detokenizer.update(token_ids[:end]) for end in range(1, 5)]
    assert deltas == ["", "", "a", "b"]  # two characters wait: "cd" might be forming
    assert detokenizer.finish("ab") == ""  # the engine cut the text at "cd"


def test_sse_event_is_one_line_whatever_the_text():
    text = "a\u2028b\u2029c\u0085d\x1ce\rf\ng日本"
    event = sse_event({"text": text})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    line = event[len(b"data: "):-2].decode()
    assert line.isascii() and len(line.splitlines()) == 1
    assert json.loads(line) == {"text": text}


# -- shutdown ------------------------------------------------------------------------------------


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_shutdown_on_signal_aborts_streams_and_exits(signal_number, tmp_path):
    with serve_process(["--device", "cpu", "--gpu-kv-cache-gib", "0.01", "--cpu-kv-cache-gib",
                        "0.01"], tmp_path / "server.log") as served:
        process, url = served.process, served.url
        body = dict(prompt="hello", max_tokens=3000, temperature=0, ignore_eos=True,
                    stream=True, return_token_ids=True)
        events = []
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=HTTP_TIMEOUT) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                if len(events) == 3:
                    break
            sent = time.monotonic()
            process.send_signal(signal_number)
            events += [line[len("data: "):] for line in lines if line.startswith("data: ")]
        returncode = process.wait(timeout=15)
        elapsed = time.monotonic() - sent
    output = served.log()
    assert elapsed < 5, f"the server took {elapsed:.1f} s to exit"
    assert returncode in (0, -signal_number), output
    assert "Traceback" not in output and "ERROR" not in output, output
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])["choices"][0]
    assert final["finish_reason"] == "abort"
    tokens = sum(len(json.loads(event)["choices"][0]["token_ids"]) for event in events[:-1])
    assert 3 <= tokens < 3000


# -- the load generator (benchmarks/online.py) ---------------------------------------------------

TINY_SERVE_ARGS = ["--device", "cpu", "--gpu-kv-cache-gib", str(4 * BLOCK_BYTES / 2**30),
                   "--cpu-kv-cache-gib", str(256 * BLOCK_BYTES / 2**30), "--perf-model", "zero"]


def run_benchmark(arguments: list[str], output_dir) -> str:
    completed = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "online.py"), *arguments,
         "--output-dir", str(output_dir), "--", *TINY_SERVE_ARGS],
        capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    return completed.stdout


def test_sustainable_rate_interpolates_the_crossing():
    online_stats = benchmark_module("online_stats")
    knees, sustainable_rate = online_stats.knees, online_stats.sustainable_rate
    points = [(1.0, 0.010), (2.0, 0.012), (3.0, 0.030), (4.0, math.inf)]
    assert sustainable_rate(points, 0.021) == {"rate": pytest.approx(2.5), "bound": "exact"}
    assert sustainable_rate(points, 0.5) == {"rate": 3.0, "bound": "at least"}
    assert sustainable_rate(points, 0.005)["bound"] == "below"
    result = knees({"gpu-only": points, "neo": [(1.0, 0.011), (2.0, 0.011), (4.0, 0.016)]},
                   "gpu-only", factor=2.0, slo=None)
    assert result["reference_threshold_s"] == pytest.approx(0.020)
    assert result["own"]["gpu-only"]["rate"] == pytest.approx(2 + 8 / 18)
    assert result["at_reference"]["neo"] == {"rate": 4.0, "bound": "at least",
                                             "ratio_to_reference": pytest.approx(4 / (2 + 8 / 18))}


@pytest.mark.parametrize("rate", [0.5, 2.0, 10.0])
def test_scaled_trace_arrivals_reach_the_rate(rate):
    """The Azure trace re-timed to a rate: rate x duration requests within the duration, in the
    trace's order and relative timing (its lulls included)."""
    plan_requests = benchmark_module("online_client").plan_requests
    from neo.bench.workloads import parse_workload
    duration = 40.0
    planned = plan_requests("azure-code", "scaled", rate, duration, 1000, 0, 8192)
    assert len(planned) == round(rate * duration)
    offsets = [request.send_offset for request in planned]
    assert offsets[0] == 0.0 and offsets == sorted(offsets) and offsets[-1] <= duration
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(rate)
    trace = [item.arrival_offset for item in parse_workload("azure-code", len(planned), seed=0)]
    scale = offsets[-1] / (trace[-1] - trace[0])
    assert offsets == pytest.approx([(t - trace[0]) * scale for t in trace])


@pytest.mark.slow
def test_load_generator_sweep_end_to_end(tmp_path):
    """One policy per command (--append merges them), as on a machine with a time limit per
    command. Prompt + output stay within the 4-block (64-token) GPU pool of gpu-only. At most
    3 requests in flight; goodput objectives loose enough for a slow CPU."""
    options = ["--rates", "3,20", "--duration-per-rate", "2", "--workload",
               "synthetic:input=30,output=20", "--warmup-requests", "1", "--append", "--tag", "tiny",
               "--max-concurrency", "3", "--goodput", "ttft:5000", "tpot:1000"]
    run_benchmark(["--policies", "gpu-only", *options], tmp_path)
    stdout = run_benchmark(["--policies", "neo", *options], tmp_path)
    with open(tmp_path / "online-tiny-sweep.json") as file:
        results = json.load(file)
    assert {"command", "date", "device", "knee", "records", "summaries"} <= set(results)
    assert [run["policies"] for run in results["runs"]] == [["gpu-only"], ["neo"]]
    assert set(results["knee"]["at_reference"]) == {"gpu-only", "neo"}
    assert [(summary["policy"], summary["rate"]) for summary in results["summaries"]] == [
        ("gpu-only", 3.0), ("gpu-only", 20.0), ("neo", 3.0), ("neo", 20.0)]
    for summary in results["summaries"]:
        assert summary["sent"] >= 1 and summary["completed"] == summary["sent"]
        for name in ("ttft", "tpot", "itl", "e2el", "per_token_latency"):
            assert 0 < summary[name]["median"] <= summary[name]["p99"] and summary[name]["left_out"] == 0
        assert summary["ttft"]["mean"] < summary["e2el"]["mean"]
        assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
        assert summary["goodput"]["fraction"] == 1.0 and summary["goodput"]["good"] == summary["sent"]
    assert set(results["goodput"]["policies"]) == {"gpu-only", "neo"}
    assert results["goodput"]["policies"]["gpu-only"] == {"rate": 20.0, "bound": "at least",
                                                         "ratio_to_reference": 1.0, "ratio_bound": "exact"}
    assert len(results["records"]) == sum(summary["sent"] for summary in results["summaries"])
    for record in results["records"]:
        assert 27 <= record["prompt_tokens"] <= 33
        assert record["output_tokens"] == record["requested_output_tokens"]
        assert record["ttft"] <= record["latency"]
        assert 1 <= len(record["itl"]) <= record["output_tokens"] - 1
        assert sum(record["itl"]) == pytest.approx(record["latency"] - record["ttft"], abs=1e-4)
    for summary in results["summaries"]:  # --max-concurrency 3: never more in flight
        level = [(record["send_offset"], record["send_offset"] + record["latency"]) for record in results["records"]
                 if (record["policy"], record["rate"]) == (summary["policy"], summary["rate"])]
        assert max(sum(start <= moment < end for start, end in level) for moment, _ in level) <= 3
    # At 20 requests/s several requests overlap: neo decodes the overflow on the host.
    assert results["summaries"][-1]["engine"]["host_decode_share"] > 0
    assert results["summaries"][1]["engine"]["host_decode_share"] == 0
    for name in ("online-tiny-latency-goodput-vs-rate.png", "online-tiny-latency-vs-rate.png",
                 "online-tiny-latency-cdf.png"):
        with open(tmp_path / name, "rb") as file:
            assert file.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "goodput rate" in stdout and "knee threshold" in stdout and "latency distribution plotted at" in stdout.splitlines()[-1]
    check_report_merges_split_sweeps(results, tmp_path)


def check_report_merges_split_sweeps(results: dict, tmp_path) -> None:
    """``--mode report --merge``: the sweep split into one file per policy, and neo's into one
    file per rate (as separate machine starts would write them), merges back to the same knees
    and comparison, with plots."""
    parts = {"gpu-only": ("gpu-only", None), "neo-3": ("neo", 3.0), "neo-20": ("neo", 20.0)}
    for name, (policy, rate) in parts.items():
        def kept(entry):
            return entry["policy"] == policy and rate in (None, entry["rate"])
        part = {**results, "policies": {policy: results["policies"][policy]},
                "runs": [run for run in results["runs"] if run["policies"] == [policy]],
                "summaries": [entry for entry in results["summaries"] if kept(entry)],
                "records": [entry for entry in results["records"] if kept(entry)]}
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "online-tiny-sweep.json", "w") as file:
            json.dump(part, file)
    completed = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, "online.py"), "--mode", "report", "--tag", "tiny",
         "--output-dir", str(tmp_path / "gpu-only"), "--merge", str(tmp_path / "neo-3" / "online-tiny-sweep.json"),
         str(tmp_path / "neo-20" / "online-tiny-sweep.json")],
        capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    with open(tmp_path / "gpu-only" / "online-tiny-sweep.json") as file:
        merged = json.load(file)
    assert merged["knee"] == results["knee"] and merged["comparison"] == results["comparison"]
    assert merged["goodput"] == results["goodput"]
    assert len(merged["records"]) == len(results["records"])
    assert set(merged["policies"]) == {"gpu-only", "neo"}
    for name in ("online-tiny-latency-vs-rate.png", "online-tiny-latency-cdf.png"):
        with open(tmp_path / "gpu-only" / name, "rb") as file:
            assert file.read(8) == b"\x89PNG\r\n\x1a\n"
    again = subprocess.run(  # the same load level twice is refused
        [sys.executable, os.path.join(BENCHMARKS, "online.py"), "--mode", "report", "--tag", "tiny",
         "--output-dir", str(tmp_path / "gpu-only"), "--merge", str(tmp_path / "neo-20" / "online-tiny-sweep.json")],
        capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "holds load levels (policy, rate) [('neo', 20.0)]" in again.stderr


@pytest.mark.slow
def test_load_generator_server_overhead_mode(tmp_path):
    stdout = run_benchmark(["--mode", "overhead", "--policies", "gpu-only", "--overhead-repeats", "2",
                            "--workload", "synthetic:input=30,output=20"], tmp_path)
    with open(tmp_path / "online-overhead.json") as file:
        entry = json.load(file)["policies"]["gpu-only"]
    assert len(entry["http_tpot_s"]) == len(entry["generate_tpot_s"]) == 2
    assert entry["ratio"] == pytest.approx(entry["http_tpot_median_s"] / entry["generate_tpot_median_s"])
    assert "server overhead" in stdout and stdout.splitlines()[-1].startswith("gpu-only")
