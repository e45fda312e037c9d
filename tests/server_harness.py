"""A real uvicorn server on a loopback port for the server tests, and the HTTP helpers that
talk to it: strict SSE reading, Prometheus parsing, waiting for the engine to be idle.

Every network call has a timeout and every server start is bounded, so a stuck server fails
the test instead of hanging it.
"""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from neo import EngineConfig, LLMEngine
from neo.server.app import build_app, uvicorn_config
from neo.server.async_engine import AsyncEngine
from neo.server.settings import ServerSettings

HTTP_TIMEOUT = httpx.Timeout(60.0)
TEST_TIMEOUT_SECONDS = 120
BLOCK_BYTES = 2 * 4 * 2 * 16 * 32 * 4  # neo-tiny float32: K+V, 4 layers, 2 KV heads, 16 x 32
# Async scheduling, the default on a CUDA device, is asked for here on the CPU, where it is off
# unless set: the servers run the engine loop users on GPUs run (the neo one with host batches).
TINY_OPTIONS = dict(device="cpu", gpu_kv_cache_gib=1024 * BLOCK_BYTES / 2**30,
                    cpu_kv_cache_gib=256 * BLOCK_BYTES / 2**30, async_scheduling=True)
TOKENLESS_OPTIONS = dict(device="cpu", policy="neo", perf_model="zero",
                         gpu_kv_cache_gib=4 * BLOCK_BYTES / 2**30,
                         cpu_kv_cache_gib=64 * BLOCK_BYTES / 2**30, async_scheduling=True)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TEST_TIMEOUT_SECONDS))


# -- servers -------------------------------------------------------------------------------------


@dataclass
class LiveServer:
    url: str
    async_engine: AsyncEngine
    model: str


@contextlib.contextmanager
def live_server(model: str, options: dict, settings: ServerSettings | None = None):
    """uvicorn serving ``model`` on a free loopback port, in a thread of this process, as
    ``neo serve`` configures it (``settings``' host and port aside)."""
    settings = settings or ServerSettings()
    async_engine = AsyncEngine(LLMEngine(EngineConfig(model=model, **options)))
    # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that name it, and
    # without it each response waits for the client's delayed ACK (tens of ms).
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(build_app(async_engine, settings), settings,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", async_engine, model)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()
        assert not thread.is_alive(), "the test server did not stop"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ServedProcess:
    """A ``neo serve`` process; its stdout and stderr go to ``log_path``."""

    process: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as file:
            return file.read()


@contextlib.contextmanager
def serve_process(serve_arguments: list[str], log_path, log_level: str = "WARNING",
                  env: dict | None = None, start_timeout: float = 90.0):
    """``python -m neo.cli serve`` on a free loopback port, up once ``/health`` answers 200;
    interrupted (then killed if it lingers) at the end unless it already exited."""
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "neo.cli", "--log-level", log_level, "serve", "--port",
             str(port), *serve_arguments], stdout=log, stderr=subprocess.STDOUT,
            env=None if env is None else os.environ | env)
    served = ServedProcess(process, f"http://127.0.0.1:{port}", str(log_path))
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert process.poll() is None, served.log()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)



# -- HTTP helpers --------------------------------------------------------------------------------


@dataclass
class StreamResult:
    status: int
    chunks: list  # decoded JSON payloads, without [DONE]
    done: bool  # [DONE] arrived
    error_body: dict | None = None  # the JSON body of a non-200 response

    @property
    def token_ids(self) -> list[int]:
        return [token for chunk in self.chunks for choice in chunk["choices"]
                for token in choice["token_ids"]]

    @property
    def text(self) -> str:
        parts = []
        for chunk in self.chunks:
            for choice in chunk["choices"]:
                parts.append(choice["delta"].get("content", "") if "delta" in choice else choice["text"])
        return "".join(parts)

    @property
    def finish_reason(self) -> str | None:
        reasons = [choice["finish_reason"] for chunk in self.chunks for choice in chunk["choices"]]
        assert all(reason is None for reason in reasons[:-1]), reasons
        return reasons[-1]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict,
                         stop_after: int | None = None) -> StreamResult:
    """POST with ``stream``; reads SSE events strictly (``data: ...`` + blank line). With
    ``stop_after``, the connection is dropped after that many events."""
    async with client.stream("POST", path, json=body | {"stream": True}) as response:
        if response.status_code != 200:
            return StreamResult(response.status_code, [], False, json.loads(await response.aread()))
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks, done, expect_blank = [], False, False
        async for line in response.aiter_lines():
            if expect_blank:
                assert line == "", f"an event must end with a blank line, got {line!r}"
                expect_blank = False
                continue
            assert line.startswith("data: ") and not done, f"unexpected line {line!r}"
            expect_blank = True
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
            else:
                chunks.append(json.loads(data))
                if stop_after is not None and len(chunks) >= stop_after:
                    return StreamResult(200, chunks, False)
        return StreamResult(200, chunks, done)


def client_for(server: LiveServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def get(server: LiveServer, path: str) -> httpx.Response:
    return httpx.get(server.url + path, timeout=HTTP_TIMEOUT)


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=HTTP_TIMEOUT)


def parse_prometheus(text: str) -> dict[str, dict[tuple, float]]:
    """Strict parse of the text exposition format: ``{name: {sorted label items: value}}``.

    Each family has one HELP and one TYPE line before its samples; counters end in _total; a
    histogram's samples are ``<name>_bucket`` (with ``le``), ``<name>_sum`` and
    ``<name>_count``, filed under ``<name>``'s family with the suffix as a ``sample`` label.
    """
    name_pattern = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    sample = re.compile(rf"^({name_pattern})(?:\{{(.*)\}})? (\S+)$")
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')
    families: dict[str, dict[tuple, float]] = {}
    types: dict[str, str] = {}
    helps: set[str] = set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert re.fullmatch(name_pattern, name) and name not in helps, line
            helps.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name in helps and name not in types, line
            assert kind in ("counter", "gauge", "histogram"), line
            assert kind != "counter" or name.endswith("_total"), line
            types[name] = kind
            families[name] = {}
        else:
            match = sample.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels_text, value = match.groups()
            found = label.findall(labels_text or "")
            suffix = re.fullmatch(r"(.*)_(bucket|sum|count)", name)
            if suffix and types.get(suffix[1]) == "histogram":
                name = suffix[1]
                found.append(("sample", suffix[2]))
            assert name in types, f"sample before its TYPE line: {line!r}"
            labels = tuple(sorted(found))
            assert labels not in families[name], f"duplicate sample: {line!r}"
            families[name][labels] = float(value)
    return families


def metric(families, name: str, **labels) -> float:
    return families[name][tuple(sorted(labels.items()))]


async def wait_for_idle(client: httpx.AsyncClient, timeout: float = 30.0) -> dict:
    """Poll /metrics until no request runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        families = parse_prometheus((await client.get("/metrics")).text)
        busy = (metric(families, "neo_requests_running") + metric(families, "neo_requests_waiting")
                + sum(families["neo_kv_cache_blocks_used"].values()))
        if busy == 0:
            return families
        assert time.monotonic() < deadline, "the server did not become idle"
        await asyncio.sleep(0.05)


def histogram_buckets(families, name: str) -> list[tuple[float, float]]:
    """``[(upper bound, cumulative count), ...]`` of a parsed histogram, +Inf last; checks
    that the counts never decrease and that +Inf equals ``_count``."""
    buckets = sorted((float(dict(labels)["le"]), value)
                     for labels, value in families[name].items()
                     if dict(labels)["sample"] == "bucket")
    counts = [count for _, count in buckets]
    assert counts == sorted(counts) and buckets[-1][0] == float("inf"), buckets
    assert buckets[-1][1] == metric(families, name, sample="count")
    return buckets
