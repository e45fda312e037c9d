"""Hostile clients against ``neo serve`` (a subprocess with an API key, neo-tiny on CPU): each
is answered, quickly and in OpenAI's error shape, and costs nobody else anything.

While each test's hostile requests run, legitimate traffic runs beside them on a thread of its
own: one lane per prompt (text, token ids and chat) streams its greedy request again and again.
A process of its own polls ``/health`` every 20 ms for the whole module, so the latencies it
measures are the server's, not this process's. Every legitimate stream must equal
``LLM.generate`` on a separate engine, the polls during a test must answer within
``HEALTH_P99_BOUND_SECONDS`` at the 99th percentile, and the server's log must hold no
traceback or error from a client's fault.
"""

import asyncio
import contextlib
import json
import math
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from neo import LLM, SamplingParams
from neo.cli import build_parser
from neo.server.settings import ServerSettings, default_max_request_body_bytes
from neo.tokenizer import NORMALIZER_SHRINK, Tokenizer
from server_harness import TINY_OPTIONS, serve_process

API_KEY = "neo-hostile-test-key"
AUTHORIZATION = {"authorization": f"Bearer {API_KEY}"}
JSON_HEADERS = AUTHORIZATION | {"content-type": "application/json"}
BODY_READ_TIMEOUT_SECONDS = 2.0
# neo-tiny's context is 4096 tokens, so the default limit is the 1 MiB floor.
BODY_LIMIT = default_max_request_body_bytes(4096)
HEALTH_P99_BOUND_SECONDS = 1.0
HEALTH_POLL_SECONDS = 0.02
REQUEST_TIMEOUT = httpx.Timeout(30.0)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
LEGITIMATE_MAX_TOKENS = 24
FUZZ_EXAMPLES = 200
OVERSIZED_EACH = 4  # 50 MB bodies with a Content-Length, and as many without
MALFORMED_ROUNDS = 5
API_KEY_ROUNDS = 5


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``neo serve`` with an API key (from NEO_API_KEY) and a 2 s body read timeout."""
    arguments = ["--device", "cpu", "--gpu-kv-cache-gib", str(TINY_OPTIONS["gpu_kv_cache_gib"]),
                 "--cpu-kv-cache-gib", str(TINY_OPTIONS["cpu_kv_cache_gib"]),
                 "--body-read-timeout", str(BODY_READ_TIMEOUT_SECONDS)]
    log_path = tmp_path_factory.mktemp("hostile") / "server.log"
    with serve_process(arguments, log_path, log_level="INFO",
                       env={"NEO_API_KEY": API_KEY}) as server:
        yield server


# Polls URL/health every INTERVAL seconds; one line per poll: start (time.time()), latency in
# seconds, status (or the error's name).
HEALTH_POLLER = """
import sys, time, httpx
url, interval = sys.argv[1], float(sys.argv[2])
with httpx.Client(timeout=30) as client:
    while True:
        start = time.time()
        try:
            status = client.get(url + "/health").status_code
        except httpx.HTTPError as error:
            status = type(error).__name__
        print(start, time.time() - start, status, flush=True)
        time.sleep(interval)
"""


@pytest.fixture(scope="module")
def health_log(served, tmp_path_factory):
    """The path of the ``/health`` poller's output, polled from a process of its own."""
    path = tmp_path_factory.mktemp("health") / "polls.txt"
    with open(path, "w") as output:
        poller = subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, served.url,
                                   str(HEALTH_POLL_SECONDS)], stdout=output)
    try:
        yield path
    finally:
        poller.terminate()
        poller.wait(timeout=15)


def health_polls(health_log, start: float, end: float) -> list[tuple[float, str]]:
    """(latency, status) of the polls that started between ``start`` and ``end``."""
    with open(health_log) as file:
        polls = [line.split() for line in file if line.endswith("\n")]
    return [(float(latency), status) for started, latency, status in polls
            if start <= float(started) <= end]


@dataclass
class Lane:
    """One legitimate request, streamed again and again, and the tokens it must give."""

    path: str
    body: dict
    expected: list[int]


@pytest.fixture(scope="module")
def lanes() -> list[Lane]:
    """Eight greedy requests (three text, three token-id, two chat prompts) and their tokens
    from ``LLM.generate`` on an engine of their own."""
    rng = random.Random(20261125)
    llm = LLM("neo-tiny", **TINY_OPTIONS)
    try:
        tokenizer = llm.get_tokenizer()
        params = SamplingParams(max_tokens=LEGITIMATE_MAX_TOKENS, temperature=0, ignore_eos=True)
        fields = dict(max_tokens=LEGITIMATE_MAX_TOKENS, temperature=0, ignore_eos=True,
                      stream=True, return_token_ids=True)
        requests = []
        for index in range(3):
            text = "".join(rng.choice("abcdefgh ijk,é日🎉") for _ in range(rng.randint(5, 40)))
            requests.append((COMPLETIONS, fields | {"prompt": text}, tokenizer.encode(text)))
            ids = [rng.randrange(256) for _ in range(rng.randint(3, 60))]
            requests.append((COMPLETIONS, fields | {"prompt": ids}, ids))
            if index < 2:
                messages = [{"role": "user", "content": f"question {index}: {text[::-1]}"}]
                rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
                requests.append((CHAT, fields | {"messages": messages},
                                 tokenizer.encode(rendered, add_special_tokens=False)))
        outputs = llm.generate([prompt_ids for _, _, prompt_ids in requests], params)
    finally:
        llm.close()
    return [Lane(path, body, output.outputs[0].token_ids)
            for (path, body, _), output in zip(requests, outputs)]


# -- legitimate traffic beside the hostile one ---------------------------------------------------


@dataclass
class TrafficRecord:
    streams: list[tuple[int, int, list[int], str | None, bool]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class LegitimateTraffic:
    """The lanes' streams, on a thread with its own event loop, from ``__enter__`` (once every
    lane streams) until ``__exit__`` (each lane finishes the stream it is in); ``start`` and
    ``end`` (``time.time()``) bound the time the hostile clients ran in."""

    def __init__(self, url: str, lanes: list[Lane]):
        self.url = url
        self.lanes = lanes
        self.record = TrafficRecord()
        self.stopping = threading.Event()
        self.all_streaming = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.start = self.end = 0.0

    def __enter__(self) -> "LegitimateTraffic":
        self.thread.start()
        assert self.all_streaming.wait(60), "the legitimate streams did not start"
        self.start = time.time()
        return self

    def __exit__(self, *exc_info) -> None:
        self.end = time.time()
        self.stopping.set()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "the legitimate traffic did not stop"

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT,
                                     headers=AUTHORIZATION, limits=limits) as client:
            started = set()
            await asyncio.gather(*(self._lane(client, index, started)
                                   for index in range(len(self.lanes))))

    async def _lane(self, client: httpx.AsyncClient, index: int, started: set) -> None:
        lane = self.lanes[index]
        while not self.stopping.is_set():
            try:
                tokens, finish_reason, done = [], None, False
                async with client.stream("POST", lane.path, json=lane.body) as response:
                    if response.status_code != 200:
                        self.record.failures.append(f"lane {index}: {response.status_code} "
                                                    f"{(await response.aread())[:300]!r}")
                        return
                    async for line in response.aiter_lines():
                        started.add(index)
                        if len(started) == len(self.lanes):
                            self.all_streaming.set()
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            for choice in json.loads(line[len("data: "):])["choices"]:
                                tokens += choice["token_ids"]
                                finish_reason = choice["finish_reason"] or finish_reason
                self.record.streams.append((index, response.status_code, tokens, finish_reason,
                                            done))
            except (httpx.HTTPError, ValueError) as error:
                self.record.failures.append(f"lane {index}: {type(error).__name__}: {error}")
                return

    def check(self, label: str, health_log) -> None:
        """Every legitimate stream completed with its expected tokens and /health kept
        answering fast meanwhile; prints the counts and the /health p99."""
        record = self.record
        assert not record.failures, record.failures
        assert {index for index, *_ in record.streams} == set(range(len(self.lanes)))
        for index, status, tokens, finish_reason, done in record.streams:
            assert (status, done, finish_reason) == (200, True, "length"), index
            assert tokens == self.lanes[index].expected, f"lane {index} diverged"
        time.sleep(2 * HEALTH_POLL_SECONDS)  # the poll of the window's end is written
        polls = health_polls(health_log, self.start, self.end)
        assert polls and all(status == "200" for _, status in polls), polls
        latencies = sorted(latency for latency, _ in polls)
        p99 = latencies[math.ceil(0.99 * len(latencies)) - 1]
        print(f"\n{label}: {len(record.streams)} legitimate streams in {self.end - self.start:.1f} "
              f"s, /health polled {len(polls)} times, p99 {p99 * 1000:.1f} ms, max "
              f"{latencies[-1] * 1000:.1f} ms")
        assert p99 < HEALTH_P99_BOUND_SECONDS, f"/health p99 {p99:.3f} s"


@contextlib.contextmanager
def beside_legitimate_traffic(served, lanes: list[Lane], health_log, label: str):
    """Run the block while legitimate traffic runs; then check the traffic, the /health polls
    and the server's log."""
    log_start = len(served.log())
    with LegitimateTraffic(served.url, lanes) as traffic:
        yield
    traffic.check(label, health_log)
    check_log(served.log()[log_start:])


def check_log(log: str) -> None:
    """No traceback, error or warning: client faults are answered, not logged."""
    assert "Traceback" not in log, log
    assert not re.search(r"^(ERROR|WARNING)", log, re.MULTILINE), log


# -- raw HTTP --------------------------------------------------------------------------------------


@dataclass
class RawResponse:
    status: int | None  # None: the connection closed without a response
    headers: str
    body: bytes
    seconds: float  # from sending the headers to the connection's end

    def error(self) -> dict:
        return json.loads(self.body)["error"]


async def raw_request(url: str, head: bytes, body_parts: list[bytes], pause: float = 0.0,
                      read_timeout: float = 30.0) -> RawResponse:
    """Send ``head``, then the body parts ``pause`` seconds apart, while reading until the
    server closes the connection (or ``read_timeout`` passes)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    start = time.monotonic()

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(head)
            for part in body_parts:
                await asyncio.sleep(pause)
                writer.write(part)
                await writer.drain()

    async def read() -> bytes:
        data = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                data += chunk
        return data

    sender = asyncio.ensure_future(send())
    try:
        data = await asyncio.wait_for(read(), read_timeout)
    finally:
        sender.cancel()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    seconds = time.monotonic() - start
    if not data:
        return RawResponse(None, "", b"", seconds)
    headers, _, body = data.partition(b"\r\n\r\n")
    return RawResponse(int(headers.split()[1]), headers.decode("latin-1"), body, seconds)


def request_head(path: str, extra: str, authorization: bool = True) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if authorization:
        lines.append(f"Authorization: Bearer {API_KEY}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


async def disconnect_mid_body(url: str) -> None:
    """Send half a body, then leave."""
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(request_head(COMPLETIONS, "Content-Length: 1000\r\n") + b'{"prompt": "ab')
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    await writer.wait_closed()


def server_memory_bytes(served, name: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak since the last ``reset_peak_memory``)."""
    with open(f"/proc/{served.process.pid}/status") as file:
        line = next(line for line in file if line.startswith(f"{name}:"))
    return int(line.split()[1]) * 1024


def reset_peak_memory(served) -> None:
    with open(f"/proc/{served.process.pid}/clear_refs", "w") as file:
        file.write("5")


def assert_error(response: httpx.Response, status: int, message: str,
                 param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"], error["message"]
    assert error["param"] == param, error


# -- oversized and slow bodies ------------------------------------------------------------------


def test_oversized_bodies_are_refused_without_being_held(served, lanes, health_log):
    """50 MB bodies, with and without a Content-Length, get 413 naming the limit (the rest of
    each is read only to be thrown away, so it never sits in the server's memory); a body
    exactly at the limit is served."""
    fifty_megabytes = b'{"prompt": "' + b"a" * 50_000_000 + b'", "max_tokens": 2}'

    async def chunked():
        for start in range(0, len(fifty_megabytes), 65536):
            yield fifty_megabytes[start:start + 65536]

    at_limit = b'{"prompt": [1, 2, 3], "max_tokens": 2}'
    at_limit = at_limit[:-1] + b" " * (BODY_LIMIT - len(at_limit)) + b"}"

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=REQUEST_TIMEOUT,
                                     headers=JSON_HEADERS) as client:
            declared = [client.post(COMPLETIONS, content=fifty_megabytes)
                        for _ in range(OVERSIZED_EACH)]
            undeclared = [client.post(COMPLETIONS, content=chunked())
                          for _ in range(OVERSIZED_EACH)]
            one_over = client.post(CHAT, content=at_limit + b" ")
            return await asyncio.gather(*declared, *undeclared, one_over,
                                        client.post(COMPLETIONS, content=at_limit))

    with beside_legitimate_traffic(served, lanes, health_log, "oversized bodies"):
        resident_before = server_memory_bytes(served, "VmRSS")
        reset_peak_memory(served)
        start = time.monotonic()
        *refused, served_at_limit = asyncio.run(main())
        seconds = time.monotonic() - start
        grown = server_memory_bytes(served, "VmHWM") - resident_before
    declared, undeclared = refused[:OVERSIZED_EACH], refused[OVERSIZED_EACH:-1]
    for response in declared + refused[-1:]:
        assert_error(response, 413, f"exceeds the limit of {BODY_LIMIT} bytes (the server's "
                                    f"max_request_body_bytes): its Content-Length is")
    for response in undeclared:
        assert_error(response, 413, "bytes arrived before its end")
    assert all(response.headers["connection"] == "close" for response in refused)
    assert served_at_limit.status_code == 200, served_at_limit.text
    print(f"{len(refused)} oversized bodies refused in {seconds:.2f} s; server peak RSS grew "
          f"{grown / 2**20:.1f} MiB")
    assert grown < 32 * 2**20


def test_slow_and_abandoned_bodies(served, lanes, health_log):
    """Bodies that never finish (silent, dribbled a byte at a time, an endless chunk) are
    answered 408 once the body read timeout passes, and their connections closed; endless
    bodies nobody reads (an unknown route, a missing API key) are thrown away until that
    timeout, then answered (404, 401) and their connections closed. Clients that leave
    mid-body cost no log line."""
    incomplete = request_head(COMPLETIONS, "Content-Length: 1000\r\n") + b'{"prompt": '
    chunked = "Transfer-Encoding: chunked\r\n"
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"  # 64 KiB chunks, none of them the last

    async def main():
        silent = raw_request(served.url, incomplete, [])
        dribbled = raw_request(served.url, incomplete, [b" "] * 40, pause=0.1)
        endless = raw_request(served.url, request_head(COMPLETIONS, chunked) + b"1\r\n{\r\n",
                              [b"1\r\n \r\n"] * 40, pause=0.1)
        never_read = [raw_request(served.url, request_head("/v1/nothing", chunked), [chunk] * 40,
                                  pause=0.1),
                      raw_request(served.url, request_head(COMPLETIONS, "Content-Length: "
                                                           "100000000\r\n", authorization=False),
                                  [b" " * 65536] * 40, pause=0.1)]
        leaving = [disconnect_mid_body(served.url) for _ in range(5)]
        return await asyncio.gather(silent, dribbled, endless, *never_read, *leaving)

    with beside_legitimate_traffic(served, lanes, health_log, "slow bodies"):
        responses = asyncio.run(main())
    timed_out, never_read = responses[:3], responses[3:5]
    for response in timed_out:
        assert response.status == 408, response
        assert "was not complete within 2 s (the server's body read timeout" in response.error()[
            "message"]
    assert [response.status for response in never_read] == [404, 401]
    for response in timed_out + never_read:
        assert "connection: close" in response.headers
        assert BODY_READ_TIMEOUT_SECONDS <= response.seconds < BODY_READ_TIMEOUT_SECONDS + 3


# -- bodies of the right size that must not cost the server ---------------------------------------


def test_huge_prompts_are_refused_cheaply(served, lanes, health_log):
    """Texts under the body limit but too long in bytes for the context get 400 without being
    tokenized; a text just under that bound is tokenized off the event loop and refused for
    its token count, as is a body-sized list of token ids; a request with 200k stop strings
    is refused or completes cleanly."""
    bound = Tokenizer.tiny().max_text_bytes_per_token * 4096
    many_stops = json.dumps({"prompt": "hello", "max_tokens": 2, "stop": ["a"] * 200_000},
                            separators=(",", ":")).encode()
    assert len(many_stops) < BODY_LIMIT

    over_bound = json.dumps({"prompt": "a" * 900_000}).encode()
    chat_over_bound = json.dumps({"messages": [{"role": "user", "content": "日" * 300_000}],
                                  "max_tokens": 2}, ensure_ascii=False).encode()
    under_bound = json.dumps({"prompt": "ab" * (bound // 2 - 20)}).encode()
    many_token_ids = json.dumps({"prompt": [1] * (BODY_LIMIT // 2 - 100)},
                                separators=(",", ":")).encode()

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=REQUEST_TIMEOUT,
                                     headers=JSON_HEADERS) as client:
            return await asyncio.gather(
                *(client.post(COMPLETIONS, content=over_bound) for _ in range(8)),
                *(client.post(CHAT, content=chat_over_bound) for _ in range(2)),
                *(client.post(COMPLETIONS, content=under_bound) for _ in range(4)),
                *(client.post(COMPLETIONS, content=many_token_ids) for _ in range(4)),
                client.post(COMPLETIONS, content=many_stops))

    with beside_legitimate_traffic(served, lanes, health_log, "huge prompts"):
        *refused, stops = asyncio.run(main())
    for response in refused[:8]:
        assert_error(response, 400, f"the prompt text of 900000 bytes can never fit the "
                                    f"model's context of 4096 tokens: no token of this "
                                    f"tokenizer stands for more than {bound // 4096} bytes",
                     "prompt")
    for response in refused[8:10]:
        assert_error(response, 400, "can never fit the model's context", "messages")
    for response in refused[10:]:
        assert_error(response, 400, "tokens is too long: the model's context is 4096", "prompt")
    assert_error(stops, 400, "stop holds 200000 strings; at most 64 are allowed", "stop")


# -- malformed bodies ----------------------------------------------------------------------------

DEEP = 100_000
MALFORMED = {
    # name: (path, raw body, message fragment, param)
    "surrogate-prompt": (COMPLETIONS, rb'{"prompt": "ab\ud800c"}', "lone UTF-16 surrogate (\\ud800)",
                         "prompt"),
    "surrogate-low-alone": (COMPLETIONS, rb'{"prompt": "\udc00"}', "surrogate (\\udc00)",
                            "prompt"),
    "surrogate-reversed-pair": (COMPLETIONS, rb'{"prompt": "\udf89\ud83c"}', "surrogate",
                                "prompt"),
    "surrogate-chat-content": (CHAT, rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
                               "field 'messages.0.content' is not valid Unicode", "messages.0.content"),
    "surrogate-chat-part": (CHAT, rb'{"messages": [{"role": "user", "content": [{"type": "text", '
                                  rb'"text": "x\ud801"}]}]}', "surrogate", "messages.0.content.0.text"),
    "surrogate-role": (CHAT, rb'{"messages": [{"role": "\udbff", "content": "x"}]}', "surrogate",
                       "messages.0.role"),
    "surrogate-stop": (COMPLETIONS, rb'{"prompt": "hi", "stop": ["ok", "\ud800"]}', "surrogate",
                       "stop.1"),
    "surrogate-model": (COMPLETIONS, rb'{"prompt": "hi", "model": "\ud800"}', "surrogate", "model"),
    "surrogate-user": (COMPLETIONS, rb'{"prompt": "hi", "user": "\ud800"}', "surrogate", "user"),
    "surrogate-key": (COMPLETIONS, rb'{"prompt": "hi", "\ud800": 1}', "surrogate", "\\ud800"),
    "deep-arrays": (COMPLETIONS, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}",
                    "nests arrays or objects deeper", None),
    "deep-objects": (COMPLETIONS, b'{"prompt": "hi", "user": ' + b'{"a": ' * DEEP + b"1"
                     + b"}" * DEEP + b"}", "nests arrays or objects deeper", None),
    "deep-unclosed": (COMPLETIONS, b"[" * DEEP, "not valid JSON", None),
    "bad-utf8-byte": (COMPLETIONS, b'{"prompt": "\xff"}', "not valid JSON", None),
    "bad-utf8-truncated": (COMPLETIONS, b'{"prompt": "\xe6\x97"}', "not valid JSON", None),
    "bad-utf8-overlong": (COMPLETIONS, b'{"prompt": "\xc0\xaf"}', "not valid JSON", None),
    "bad-utf8-encoded-surrogate": (COMPLETIONS, b'{"prompt": "\xed\xa0\x80"}', "not valid JSON",
                                   None),
    "integer-digits": (COMPLETIONS, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
                       "not valid JSON", None),
    "empty-body": (COMPLETIONS, b"", "not valid JSON", None),
    "not-an-object": (CHAT, b'"hello"', "must be a JSON object", None),
    "max-tokens-true": (COMPLETIONS, b'{"prompt": "hi", "max_tokens": true}',
                        "field 'max_tokens'", "max_tokens"),
    "temperature-string": (COMPLETIONS, b'{"prompt": "hi", "temperature": "hot"}',
                           "field 'temperature'", "temperature"),
    "temperature-nan": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', "temperature",
                        "temperature"),
    "top-p-infinite": (COMPLETIONS, b'{"prompt": "hi", "top_p": Infinity}', "top_p", "top_p"),
    "top-k-float": (COMPLETIONS, b'{"prompt": "hi", "top_k": 1.5}', "field 'top_k'", "top_k"),
    "top-k-true": (COMPLETIONS, b'{"prompt": "hi", "top_k": true}', "field 'top_k'", "top_k"),
    "stream-string": (COMPLETIONS, b'{"prompt": "hi", "stream": "yes"}', "field 'stream'",
                      "stream"),
    "prompt-number": (COMPLETIONS, b'{"prompt": 12}', "field 'prompt'", "prompt"),
    "prompt-nested-ids": (COMPLETIONS, b'{"prompt": [[1, [2]]]}', "list of integer token ids",
                          "prompt"),
    "messages-string": (CHAT, b'{"messages": "hello"}', "field 'messages'", "messages"),
    "message-content-number": (CHAT, b'{"messages": [{"role": "user", "content": 5}]}',
                               "field 'messages.0.content'", "messages.0.content"),
    "stop-token-ids-strings": (COMPLETIONS, b'{"prompt": "hi", "stop_token_ids": ["1"]}',
                               "field 'stop_token_ids.0'", "stop_token_ids.0"),
    "negative-max-completion-tokens": (CHAT, b'{"messages": [{"role": "user", "content": "x"}], '
                                             b'"max_completion_tokens": -1}', "max_tokens must be",
                                       "max_completion_tokens"),
}


def test_malformed_bodies_get_400_naming_the_problem(served, lanes, health_log):
    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=REQUEST_TIMEOUT,
                                     headers=JSON_HEADERS) as client:
            responses = []
            for _ in range(MALFORMED_ROUNDS):
                responses += await asyncio.gather(*(client.post(path, content=body)
                                                    for path, body, _, _ in MALFORMED.values()))
            return responses

    label = f"{MALFORMED_ROUNDS} x {len(MALFORMED)} malformed bodies"
    with beside_legitimate_traffic(served, lanes, health_log, label):
        responses = asyncio.run(main())
    for (name, (_, _, message, param)), response in zip(
            list(MALFORMED.items()) * MALFORMED_ROUNDS, responses):
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert message in error["message"], (name, error)
        assert error["param"] == param, (name, error)
        assert error["type"] == "invalid_request_error"


# -- the API key -----------------------------------------------------------------------------------


def test_api_key_guards_every_route_but_health_and_metrics(served, lanes, health_log):
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    refused = {
        "missing": {},
        "wrong-key": {"authorization": f"Bearer {API_KEY}x"},
        "key-prefix": {"authorization": f"Bearer {API_KEY[:-1]}"},
        "basic-scheme": {"authorization": f"Basic {API_KEY}"},
        "no-scheme": {"authorization": API_KEY},
        "empty-bearer": {"authorization": "Bearer"},
        "non-ascii": {"authorization": "Bearer ключ".encode()},
    }

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=REQUEST_TIMEOUT) as client:
            denied = [client.post(COMPLETIONS, json=body, headers=headers)
                      for headers in refused.values()]
            denied += [client.get("/v1/models"), client.get("/v1/nothing"), client.get("/docs"),
                       client.post(CHAT, content=b"x" * 10_000_000),
                       client.post(COMPLETIONS, json=body, headers=[
                           ("authorization", f"Bearer {API_KEY}")] * 2)]
            granted = [client.post(COMPLETIONS, json=body, headers=AUTHORIZATION),
                       client.post(COMPLETIONS, json=body,
                                   headers={"authorization": f"bearer {API_KEY}"}),
                       client.get("/v1/models", headers=AUTHORIZATION),
                       client.get("/v1/nothing", headers=AUTHORIZATION),
                       client.get("/health"), client.get("/metrics")]
            return await asyncio.gather(*denied), await asyncio.gather(*granted)

    with beside_legitimate_traffic(served, lanes, health_log,
                                   f"{API_KEY_ROUNDS} x {len(refused) + 11} API key cases"):
        rounds = [asyncio.run(main()) for _ in range(API_KEY_ROUNDS)]
    for denied, granted in rounds:
        assert len(denied) == len(refused) + 5
        for response in denied:
            assert_error(response, 401, "a valid API key is required")
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        assert denied[-2].headers["connection"] == "close"  # its body was thrown away
        assert [response.status_code for response in granted] == [200, 200, 200, 404, 200, 200]


# -- fuzzing ---------------------------------------------------------------------------------------


def check_answer(response: httpx.Response) -> None:
    """Never a server error: a completion, or a 4xx in OpenAI's error shape."""
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [line.removeprefix("data: ") for line in response.text.split("\n\n")]
            assert events[-2:] == ["[DONE]", ""], response.text
            assert all("error" not in json.loads(event) for event in events[:-2]), response.text
        else:
            assert response.json()["choices"][0]["finish_reason"] is not None
        return
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] is None or isinstance(error["param"], str)


def test_random_byte_bodies(served, lanes, health_log, seed):
    """Random bytes (often almost JSON) to both endpoints: always a 400, never a 500."""
    fragments = st.sampled_from([b"{", b"}", b"[", b"]", b'"', b":", b",", b'"prompt"', b"1",
                                 b'"\\ud800"', b"\xff", b"\xe6\x97", b"null", b" "])
    bodies = st.one_of(st.binary(max_size=512),
                       st.lists(fragments, max_size=40).map(b"".join))
    paths = st.sampled_from([COMPLETIONS, CHAT])

    label = f"{FUZZ_EXAMPLES} random byte bodies"
    with beside_legitimate_traffic(served, lanes, health_log, label), httpx.Client(
            base_url=served.url, timeout=REQUEST_TIMEOUT, headers=JSON_HEADERS) as client:
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(body=bodies, path=paths)
        def check(body, path):
            response = client.post(path, content=body)
            check_answer(response)

        hypothesis_seed(seed)(check)()


# JSON values of every kind, strings with lone surrogates among them, integers far beyond int64.
WIDE_INTEGERS = st.integers(-(2**80), 2**80)
TEXT = st.text(st.one_of(st.characters(), st.characters(min_codepoint=0xD800,
                                                        max_codepoint=0xDFFF)), max_size=20)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | WIDE_INTEGERS | st.floats() | TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(TEXT, children,
                                                                     max_size=4),
    max_leaves=12)
# Small values, and then anything: every integer max_tokens stays small so that a request the
# server accepts ends quickly.
SMALL_MAX_TOKENS = st.one_of(st.integers(-2, 6), st.booleans(), st.floats(), TEXT)
OPTIONAL_FIELDS = {name: st.one_of(values, JSON_VALUES) for name, values in {
    "temperature": st.floats() | st.integers(-2, 3),
    "top_p": st.floats(),
    "top_k": WIDE_INTEGERS,
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "stop_token_ids": st.lists(st.integers(-3, 2**63 - 1), max_size=4),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "n": st.integers(0, 3),
    "model": st.sampled_from(["neo-tiny", "other"]),
    "logit_bias": st.dictionaries(TEXT, st.floats(), max_size=2),
    "presence_penalty": st.floats(),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(),
    "min_tokens": st.integers(-1, 8),
    "logprobs": st.integers(-1, 21) | st.booleans(),
}.items()}
# Fields of one endpoint only: on the other one they are unknown, which the server notes in its
# log once per name (``test_server_openai_client``), so each goes only where it is known.
COMPLETION_ONLY_FIELDS = {"echo": JSON_VALUES}
CHAT_ONLY_FIELDS = {"top_logprobs": st.one_of(st.integers(-1, 21), JSON_VALUES)}
COMPLETION_BODIES = st.fixed_dictionaries(
    {"prompt": st.one_of(TEXT, st.lists(st.integers(-3, 400), max_size=12), JSON_VALUES),
     "max_tokens": SMALL_MAX_TOKENS}, optional=OPTIONAL_FIELDS | COMPLETION_ONLY_FIELDS)
CHAT_BODIES = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | TEXT,
         "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
             {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2),
             JSON_VALUES)}), max_size=3), JSON_VALUES),
     "max_tokens": SMALL_MAX_TOKENS}, optional=OPTIONAL_FIELDS | CHAT_ONLY_FIELDS)


def test_random_json_bodies(served, lanes, health_log, seed):
    """Random JSON values and request-shaped objects with random field values: a completion
    or a 4xx naming the problem, never a 500."""
    cases = st.one_of(st.tuples(st.just(COMPLETIONS), COMPLETION_BODIES),
                      st.tuples(st.just(CHAT), CHAT_BODIES),
                      st.tuples(st.sampled_from([COMPLETIONS, CHAT]), JSON_VALUES))

    label = f"{FUZZ_EXAMPLES} random JSON bodies"
    with beside_legitimate_traffic(served, lanes, health_log, label), httpx.Client(
            base_url=served.url, timeout=REQUEST_TIMEOUT, headers=JSON_HEADERS) as client:
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(case=cases)
        def check(case):
            path, body = case
            check_answer(client.post(path, content=json.dumps(body).encode()))

        hypothesis_seed(seed)(check)()


# -- settings and the text bound ----------------------------------------------------------------


def test_text_bound_holds_for_the_tiny_tokenizer(seed):
    """No text encodes to fewer tokens than its bytes over ``max_text_bytes_per_token``, the
    special tokens' texts included."""
    tokenizer = Tokenizer.tiny()
    per_token = tokenizer.max_text_bytes_per_token
    assert per_token == max(len(token.encode()) for token in
                            tokenizer.backend.get_vocab(with_added_tokens=True))
    specials = st.sampled_from(["<|begin_of_text|>", "<|reserved_special_token_54|>"])

    @settings(max_examples=100, deadline=None, database=None)
    @given(parts=st.lists(st.one_of(st.text(max_size=20), specials), max_size=10))
    def check(parts):
        text = "".join(parts)
        assert len(text.encode()) <= per_token * len(tokenizer.encode(text, False))

    hypothesis_seed(seed)(check)()


def byte_level_tokenizer(normalizer=None, pre_tokenizer=None, added=()) -> Tokenizer:
    """A byte-level BPE tokenizer with one token per byte, and the given parts."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab={character: index for index, character in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizer or tokenizers.pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False)
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.add_special_tokens(list(added))
    return Tokenizer(backend)


def test_text_bound_follows_what_the_tokenizer_can_drop():
    normalizers, pre_tokenizers = tokenizers.normalizers, tokenizers.pre_tokenizers
    longest = 2  # byte-level characters of bytes >= 0x80 take 2 bytes in UTF-8
    nfkc = byte_level_tokenizer(normalizers.NFKC())
    assert nfkc.max_text_bytes_per_token == NORMALIZER_SHRINK * longest
    math_bold = "\U0001d400\U0001d401" * 10  # NFKC: "AB" * 10, one token a letter
    assert len(math_bold.encode()) == nfkc.max_text_bytes_per_token * len(
        nfkc.encode(math_bold, False)) / longest
    sentencepiece_style = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                normalizers.Replace(" ", "\u2581")])
    assert byte_level_tokenizer(sentencepiece_style).max_text_bytes_per_token == longest
    dropping = [byte_level_tokenizer(normalizers.Strip()),
                byte_level_tokenizer(normalizers.Sequence([normalizers.NFC(),
                                                           normalizers.StripAccents()])),
                byte_level_tokenizer(pre_tokenizer=pre_tokenizers.WhitespaceSplit()),
                byte_level_tokenizer(added=[tokenizers.AddedToken("<x>", lstrip=True)])]
    assert [tokenizer.max_text_bytes_per_token for tokenizer in dropping] == [None] * 4


def test_server_settings_and_flags(monkeypatch):
    assert default_max_request_body_bytes(4096) == 2**20
    assert default_max_request_body_bytes(131072) == 4 * 2**20
    assert ServerSettings(max_request_body_bytes=10).body_limit(131072) == 10
    for bad, message in [(dict(port=True), "port must be"), (dict(api_key=""), "api_key must"),
                         (dict(api_key="a key"), "api_key must"),
                         (dict(max_request_body_bytes=0), "max_request_body_bytes must"),
                         (dict(body_read_timeout_seconds=math.inf), "body_read_timeout_seconds"),
                         (dict(keep_alive_timeout_seconds=0), "keep_alive_timeout_seconds")]:
        with pytest.raises(ValueError, match=message):
            ServerSettings(**bad)
    monkeypatch.delenv("NEO_API_KEY", raising=False)
    arguments = build_parser().parse_args(["serve"])
    assert (arguments.api_key, arguments.max_request_body_bytes, arguments.body_read_timeout,
            arguments.keep_alive_timeout) == (None, None, 30.0, 5.0)
    monkeypatch.setenv("NEO_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
