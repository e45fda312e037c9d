"""The server as users of the official ``openai`` client and of ``vllm serve`` meet it: a real
uvicorn server on a loopback port (CPU, neo-tiny, served as ``tiny`` behind an API key), driven
through ``openai.OpenAI``. Expected outputs come from ``LLM.generate`` on a separate engine.
Every call has a timeout and the client never retries, so a stuck server fails the test.
"""

import logging
import socket
import subprocess
import sys
from functools import partial

import httpx
import openai
import pytest

from neo import LLM, SamplingParams
from neo.cli import build_parser
from neo.request import Request, RequestStatus
from neo.server.latency import Histogram, RequestLatencies
from neo.server.settings import ServerSettings
from server_harness import (
    TINY_OPTIONS,
    histogram_buckets,
    live_server,
    metric,
    parse_prometheus,
    serve_process,
)

SERVED_NAME = "tiny"
API_KEY = "test-key-123"
CLIENT_TIMEOUT_SECONDS = 60.0
HISTOGRAMS = ("neo:time_to_first_token_seconds", "neo:inter_token_latency_seconds",
              "neo:e2e_request_latency_seconds", "neo:request_queue_time_seconds")


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(served_model_name=SERVED_NAME, api_key=API_KEY)
    with live_server("neo-tiny", TINY_OPTIONS, settings) as live:
        yield live


def client_of(url: str, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                         timeout=CLIENT_TIMEOUT_SECONDS)


@pytest.fixture(scope="module")
def client(server):
    with client_of(server.url) as openai_client:
        yield openai_client


@pytest.fixture(scope="module")
def reference_llm():
    llm = LLM("neo-tiny", **TINY_OPTIONS)
    yield llm
    llm.close()


def expected_text(llm: LLM, prompt, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate(prompt, params)[0].outputs[0].text


GREEDY = dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True})


# -- models and keys -----------------------------------------------------------------------------


def test_models_list_and_retrieve(client):
    assert [model.id for model in client.models.list()] == [SERVED_NAME]
    model = client.models.retrieve(SERVED_NAME)
    assert model.id == SERVED_NAME and model.object == "model" and model.owned_by == "neo"
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("neo-tiny")
    assert error.value.code == "model_not_found"


def test_request_naming_another_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="neo-tiny", prompt="hi", max_tokens=2)
    assert error.value.code == "model_not_found" and error.value.param == "model"
    assert "this server serves 'tiny'" in error.value.message


@pytest.mark.parametrize("api_key", ["wrong-key", API_KEY + "x"])
def test_wrong_api_key_is_an_authentication_error(server, api_key):
    with client_of(server.url, api_key) as wrong:
        with pytest.raises(openai.AuthenticationError) as error:
            wrong.models.list()
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=2)
    assert error.value.code == "invalid_api_key"
    assert set(error.value.body) == {"message", "type", "param", "code"}


def test_missing_api_key_is_401_in_openai_shape(server):
    response = httpx.get(server.url + "/v1/models/" + SERVED_NAME, timeout=CLIENT_TIMEOUT_SECONDS)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


# -- completions and chat ------------------------------------------------------------------------


def test_completion_and_stream_equal_generate(client, reference_llm):
    prompt = "The quick brown fox"
    expected = expected_text(reference_llm, prompt, 10)
    completion = client.completions.create(model=SERVED_NAME, prompt=prompt, **GREEDY)
    assert completion.choices[0].text == expected and completion.choices[0].index == 0
    assert completion.usage.completion_tokens == 10
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(choice.text for chunk in chunks for choice in chunk.choices) == expected
    assert chunks[-1].usage.total_tokens == completion.usage.total_tokens


def test_chat_and_stream_agree(client):
    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)
    content = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                                 stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == content


# -- batch prompts -------------------------------------------------------------------------------

BATCH_PROMPTS = {"text": ["Hello there", "a", "Once upon a time, far away"],
                 "token-ids": [[257, 72, 101], [300, 301, 302, 303, 304], [65]]}


@pytest.mark.parametrize("kind", list(BATCH_PROMPTS))
def test_batch_prompts(kind, client, reference_llm):
    prompts = BATCH_PROMPTS[kind]
    expected = [expected_text(reference_llm, prompt, 10) for prompt in prompts]
    completion = client.completions.create(model=SERVED_NAME, prompt=prompts, **GREEDY)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert [choice.text for choice in completion.choices] == expected
    prompt_tokens = sum(len(reference_llm.generate(prompt, SamplingParams(max_tokens=1))[0]
                            .prompt_token_ids) for prompt in prompts)
    assert completion.usage.prompt_tokens == prompt_tokens
    assert completion.usage.completion_tokens == 30

    streamed = {index: "" for index in range(3)}
    finish_reasons = {}
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=prompts, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert choice.index not in finish_reasons, "a chunk after its choice finished"
        streamed[choice.index] += choice.text
        if choice.finish_reason is not None:
            finish_reasons[choice.index] = choice.finish_reason
    assert list(streamed.values()) == expected
    assert finish_reasons == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30


# -- n, log-probabilities, penalties and min_tokens ----------------------------------------------

CHAT_MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def stream_by_choice(chunks, chat: bool) -> tuple[dict, dict, dict]:
    """The streamed text, finish reason and chunks of each choice index; fails on a chunk that
    comes after its choice's finish reason."""
    texts, finish_reasons, by_choice = {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index not in finish_reasons, "a chunk after its choice finished"
            text = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + text
            by_choice.setdefault(choice.index, []).append(choice)
            if choice.finish_reason is not None:
                finish_reasons[choice.index] = choice.finish_reason
    return texts, finish_reasons, by_choice


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_with_seed_equals_generate(chat, client, reference_llm):
    """n=3 seeded completions: choice i is LLM.generate's completion i, streamed or not; usage
    counts all three. Completion 0's second token is a stop token, so the choices finish at
    different iterations and each finish reason comes once, in its choice's last chunk."""
    def reference(**options) -> list:
        params = SamplingParams(n=3, seed=11, max_tokens=6, temperature=1.0, ignore_eos=True,
                                **options)
        output = (reference_llm.chat(CHAT_MESSAGES, params) if chat
                  else reference_llm.generate("Once upon", params))[0]
        return output.outputs

    stop_token = reference()[0].token_ids[1]
    expected = reference(stop_token_ids=[stop_token])
    assert len({len(completion.token_ids) for completion in expected}) > 1
    assert len({completion.text for completion in expected}) == 3
    fields = dict(model=SERVED_NAME, n=3, seed=11, max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_token]})
    create = (partial(client.chat.completions.create, messages=CHAT_MESSAGES, **fields) if chat
              else partial(client.completions.create, prompt="Once upon", **fields))
    response = create()
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    texts = [choice.message.content if chat else choice.text for choice in response.choices]
    assert texts == [completion.text for completion in expected]
    assert [choice.finish_reason for choice in response.choices] == [
        completion.finish_reason for completion in expected]
    num_tokens = sum(len(completion.token_ids) for completion in expected)
    assert response.usage.completion_tokens == num_tokens
    chunks = list(create(stream=True, stream_options={"include_usage": True}))
    streamed, finish_reasons, _ = stream_by_choice(chunks[:-1], chat)
    assert [streamed[index] for index in range(3)] == texts
    assert finish_reasons == {completion.index: completion.finish_reason
                              for completion in expected}
    assert chunks[-1].usage.completion_tokens == num_tokens


def test_n_with_batch_prompts_orders_choices_by_prompt_then_completion(client, reference_llm):
    prompts = ["Hello there", "a"]
    params = SamplingParams(n=2, seed=3, max_tokens=4, temperature=1.0, ignore_eos=True)
    expected = [completion.text for prompt in prompts
                for completion in reference_llm.generate(prompt, params)[0].outputs]
    fields = dict(model=SERVED_NAME, prompt=prompts, n=2, seed=3, max_tokens=4, temperature=1.0,
                  extra_body={"ignore_eos": True})
    completion = client.completions.create(**fields)
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in completion.choices] == expected
    assert completion.usage.completion_tokens == 16
    streamed, finish_reasons, _ = stream_by_choice(
        client.completions.create(stream=True, **fields), chat=False)
    assert [streamed[index] for index in range(4)] == expected
    assert set(finish_reasons) == {0, 1, 2, 3}


def engine_logprobs(completion) -> list[tuple[float, list[float]]]:
    """Each token's (sampled log-probability, the others' log-probabilities most likely
    first) from ``CompletionOutput.logprobs``."""
    return [(entry[token_id].logprob,
             [logprob.logprob for logprob in sorted(entry.values(), key=lambda lp: lp.rank)])
            for token_id, entry in zip(completion.token_ids, completion.logprobs)]


def test_chat_logprobs_equal_generate(client, reference_llm):
    expected = reference_llm.chat(CHAT_MESSAGES, SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))[0].outputs[0]
    tokenizer = reference_llm.get_tokenizer()
    fields = dict(model=SERVED_NAME, messages=CHAT_MESSAGES, max_tokens=5, temperature=0,
                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(**fields)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry, token_id, (sampled, ranked) in zip(content, expected.token_ids,
                                                   engine_logprobs(expected)):
        assert entry.token == tokenizer.decode([token_id], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(sampled, abs=1e-5)
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx(ranked[:3], abs=1e-5)
    chunks = list(client.chat.completions.create(stream=True, **fields))
    streamed = [entry for chunk in chunks for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    assert [entry.model_dump() for entry in streamed] == [entry.model_dump() for entry in content]
    plain = client.chat.completions.create(model=SERVED_NAME, messages=CHAT_MESSAGES,
                                           max_tokens=2, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)


def test_completion_logprobs_equal_generate(client, reference_llm):
    expected = reference_llm.generate("The quick brown fox", SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))[0].outputs[0]
    tokenizer = reference_llm.get_tokenizer()
    fields = dict(model=SERVED_NAME, prompt="The quick brown fox", max_tokens=5, temperature=0,
                  logprobs=2, extra_body={"ignore_eos": True})
    logprobs = client.completions.create(**fields).choices[0].logprobs
    texts = [tokenizer.decode([token_id], skip_special_tokens=False)
             for token_id in expected.token_ids]
    assert logprobs.tokens == texts
    assert logprobs.text_offset == [sum(map(len, texts[:index])) for index in range(5)]
    pairs = engine_logprobs(expected)
    assert logprobs.token_logprobs == pytest.approx([sampled for sampled, _ in pairs], abs=1e-5)
    for top, text, (sampled, ranked) in zip(logprobs.top_logprobs, texts, pairs):
        assert 1 <= len(top) <= 3 and top[text] == pytest.approx(sampled, abs=1e-5)
        assert sorted(top.values(), reverse=True) == pytest.approx(
            sorted(set(top.values()), reverse=True))
        assert all(any(value == pytest.approx(other, abs=1e-5) for other in ranked)
                   for value in top.values())
    chunks = list(client.completions.create(stream=True, **fields))
    pieces = [choice.logprobs for chunk in chunks for choice in chunk.choices]
    assert [token for piece in pieces for token in piece.tokens] == logprobs.tokens
    assert [value for piece in pieces for value in piece.token_logprobs] == \
        logprobs.token_logprobs
    assert [offset for piece in pieces for offset in piece.text_offset] == logprobs.text_offset
    assert [top for piece in pieces for top in piece.top_logprobs] == logprobs.top_logprobs


PENALTIES = {"presence": dict(presence_penalty=1.5), "frequency": dict(frequency_penalty=2.0),
             "repetition": dict(repetition_penalty=1.8)}


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_penalties_change_greedy_output_as_generate_does(penalty, client, reference_llm):
    prompt, options = "Count: 1 1 1 1", PENALTIES[penalty]
    plain = expected_text(reference_llm, prompt, 12)
    expected = reference_llm.generate(prompt, SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, **options))[0].outputs[0].text
    assert expected != plain, "the penalty should change this greedy output"
    openai_fields = {name: value for name, value in options.items()
                     if name != "repetition_penalty"}
    extra = {"ignore_eos": True} | {name: value for name, value in options.items()
                                    if name == "repetition_penalty"}
    completion = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=12,
                                           temperature=0, extra_body=extra, **openai_fields)
    assert completion.choices[0].text == expected


def test_min_tokens_holds_back_stop_tokens(client, reference_llm):
    """The first greedy token is made a stop token: the request ends at once, unless
    min_tokens keeps it from being sampled for that many tokens."""
    prompt = "Once upon a time"
    first_token = reference_llm.generate(prompt, SamplingParams(
        max_tokens=1, temperature=0))[0].outputs[0].token_ids[0]
    params = dict(max_tokens=8, temperature=0, stop_token_ids=[first_token])
    for min_tokens in (0, 4):
        expected = reference_llm.generate(prompt, SamplingParams(
            min_tokens=min_tokens, **params))[0].outputs[0]
        completion = client.completions.create(
            model=SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0,
            extra_body={"stop_token_ids": [first_token], "min_tokens": min_tokens,
                        "ignore_eos": False, "return_token_ids": True})
        choice = completion.choices[0]
        assert choice.token_ids == expected.token_ids
        assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
        assert len(choice.token_ids) == 1 if min_tokens == 0 else len(choice.token_ids) > 4


# -- request fields ------------------------------------------------------------------------------


def test_documented_fields_that_keep_the_output_are_ignored(client, caplog):
    messages = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)
    with caplog.at_level(logging.WARNING, logger="neo.server.serving"):
        decorated = client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=10, temperature=0,
            metadata={"team": "search"}, store=False, service_tier="auto",
            parallel_tool_calls=False, user="user-1", reasoning_effort="low",
            prediction={"type": "content", "content": "x"}, tool_choice="none",
            response_format={"type": "text"}, modalities=["text"], logit_bias={},
            presence_penalty=0, frequency_penalty=0.0, n=1, logprobs=False,
            extra_body={"ignore_eos": True, "min_tokens": 0, "repetition_penalty": 1.0,
                        "some_future_field": {"a": 1}})
    assert decorated.choices[0].message.content == plain.choices[0].message.content
    warnings = [record.getMessage() for record in caplog.records
                if record.name == "neo.server.serving"]
    assert len(warnings) == 1 and "'some_future_field'" in warnings[0], warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="neo.server.serving"):
        again = client.chat.completions.create(
            model=SERVED_NAME, messages=messages, **GREEDY | {"extra_body": {
                "ignore_eos": True, "some_future_field": 2, "another_field": None}})
    assert again.choices[0].message.content == plain.choices[0].message.content
    warnings = [record.getMessage() for record in caplog.records
                if record.name == "neo.server.serving"]
    assert warnings == ["ignored request fields this server does not know: 'another_field'"]
    completion = client.completions.create(model=SERVED_NAME, prompt="Hi", user="u", echo=False,
                                           best_of=1, suffix=None, **GREEDY)
    assert completion.choices[0].finish_reason == "length"


CHAT_REFUSED = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "required",
    "response_format": {"type": "json_object"},
    "logit_bias": {"42": 5.0},
    "functions": [{"name": "f", "parameters": {}}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "continue_final_message": True,
    "guided_choice": ["yes", "no"],
}
COMPLETION_REFUSED = {"echo": True, "suffix": "tail", "best_of": 2,
                      "response_format": {"type": "json_object"}}


@pytest.mark.parametrize("field", list(CHAT_REFUSED))
def test_chat_fields_that_change_the_output_are_refused(field, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user",
                                                                     "content": "Hi"}],
                                       max_tokens=2, extra_body={field: CHAT_REFUSED[field]})
    assert error.value.param == field
    assert f"'{field}' is not supported" in error.value.message


@pytest.mark.parametrize("field", list(COMPLETION_REFUSED))
def test_completion_fields_that_change_the_output_are_refused(field, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=2,
                                  extra_body={field: COMPLETION_REFUSED[field]})
    assert error.value.param == field


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_histograms_after_a_request(server, client):
    """A request of 6 tokens adds one time to first token, queue time and end-to-end latency
    and 5 inter-token latencies."""
    def histograms() -> dict:
        families = parse_prometheus(httpx.get(server.url + "/metrics",
                                              timeout=CLIENT_TIMEOUT_SECONDS).text)
        info = dict(next(iter(families["neo_engine_info"])))
        assert (info["model"], info["served_model_name"]) == ("neo-tiny", SERVED_NAME)
        for name in HISTOGRAMS:
            histogram_buckets(families, name)
        return {name: (metric(families, name, sample="count"),
                       metric(families, name, sample="sum")) for name in HISTOGRAMS}

    before = histograms()
    chunks = list(client.completions.create(model=SERVED_NAME, prompt="Count:", stream=True,
                                            max_tokens=6, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    after = histograms()
    added = {name: after[name][0] - before[name][0] for name in HISTOGRAMS}
    assert added == {"neo:time_to_first_token_seconds": 1, "neo:inter_token_latency_seconds": 5,
                     "neo:e2e_request_latency_seconds": 1, "neo:request_queue_time_seconds": 1}
    for name in ("neo:time_to_first_token_seconds", "neo:e2e_request_latency_seconds"):
        assert after[name][1] > before[name][1]


def test_histogram_buckets_hold_values_up_to_their_bound():
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        histogram.observe(value)
    snapshot = histogram.snapshot()
    assert snapshot.counts == (2, 2, 1) and snapshot.count == 5
    assert snapshot.total == pytest.approx(4.65)


def test_latencies_follow_a_request_through_its_times():
    latencies = RequestLatencies()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=3), arrival_time=10.0)
    latencies.added(request)
    latencies.iteration_ran(started=10.5)  # still waiting: not scheduled yet
    request.status = RequestStatus.RUNNING
    latencies.iteration_ran(started=11.0)
    request.append_token(5)
    request.first_token_time = 11.25
    latencies.output(request, finished=False, now=11.25)
    request.append_token(6)
    request.append_token(7)
    request.finish_time = 12.25
    latencies.output(request, finished=True, now=12.25)
    snapshot = latencies.snapshot()
    assert snapshot["request_queue_time_seconds"].total == pytest.approx(1.0)
    assert snapshot["time_to_first_token_seconds"].total == pytest.approx(1.25)
    assert snapshot["inter_token_latency_seconds"].count == 2
    assert snapshot["inter_token_latency_seconds"].total == pytest.approx(1.0)
    assert snapshot["e2e_request_latency_seconds"].total == pytest.approx(2.25)


# -- the serve command ---------------------------------------------------------------------------


@pytest.mark.parametrize("arguments, message", [
    (["--port", "0"], "argument --port: must be an integer from 1 to 65535, got 0"),
    (["--port", "70000"], "argument --port: must be an integer from 1 to 65535, got 70000"),
    (["--port", "http"], "argument --port: expected an integer, got 'http'"),
    (["--body-read-timeout", "0"], "argument --body-read-timeout: must be > 0, got 0"),
    (["--keep-alive-timeout", "nan"], "argument --keep-alive-timeout: must be a finite number"),
    (["--max-request-body-bytes", "0"], "argument --max-request-body-bytes: must be an integer >= 1, got 0"),
    (["--served-model-name", " "], "expected a non-empty printable name"),
])
def test_serve_flags_are_checked_by_the_parser(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *arguments])
    assert exit_info.value.code == 2
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert message in error_lines[-1] and "Traceback" not in "\n".join(error_lines)


def test_port_in_use_fails_before_the_model_loads():
    """A model that does not exist: the port check must come first and name host and port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "neo.cli", "serve", "--model",
                                 "/no/such/model/directory", "--port", str(port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip() == (f"neo: error: cannot listen on 127.0.0.1:{port}: the "
                                     f"address is already in use")


def test_serve_prints_a_banner_and_serves_the_short_name(tmp_path):
    arguments = ["--device", "cpu", "--gpu-kv-cache-gib", str(TINY_OPTIONS["gpu_kv_cache_gib"]),
                 "--cpu-kv-cache-gib", str(TINY_OPTIONS["cpu_kv_cache_gib"]),
                 "--served-model-name", SERVED_NAME]
    with serve_process(arguments, tmp_path / "serve.log") as served:
        with client_of(served.url, "unused") as served_client:
            assert [model.id for model in served_client.models.list()] == [SERVED_NAME]
        log = served.log()
    assert "neo is serving" in log
    for row in ("model          neo-tiny", f"served as      {SERVED_NAME}",
                "policy         gpu-only",
                "GPU KV pool    1024 blocks, 16384 tokens", "CPU KV pool    256 blocks",
                "CPU attention  ", f"listening on   {served.url}/v1"):
        assert row in log, log
