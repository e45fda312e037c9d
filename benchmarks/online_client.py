"""The online benchmark's client: plan arrivals, send streaming requests, time every token.

Requests go to ``/v1/completions`` as random token ids with ``max_tokens`` = the wanted
output length and ``ignore_eos``, so every request produces exactly its output length;
``return_token_ids`` lets the client count tokens without a tokenizer.
"""

import asyncio
import contextlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from neo.bench.workloads import parse_workload, random_prompt

ARRIVALS = ("poisson", "trace", "scaled")


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    send_offset: float  # seconds after the first request is due
    prompt_len: int
    output_len: int


def plan_requests(workload: str, arrivals: str, rate: float | None, duration: float,
                  max_requests: int, seed: int, max_model_len: int,
                  burstiness: float = 1.0) -> list[PlannedRequest]:
    """The requests of one load level.

    arrivals: "poisson" (random gaps at ``rate`` requests/s: gamma-distributed with shape
    ``burstiness`` and mean 1 / ``rate``, as vLLM's ``--burstiness``; 1 is a Poisson process,
    below 1 burstier, above 1 more regular), "trace" (the trace's own arrival times; ``rate``
    unused) or "scaled" (the trace's first ``rate * duration`` requests, their gaps scaled so
    that their mean rate is ``rate``: the trace's bursts and lulls, at that load). Requests
    arrive within ``duration`` seconds, at most ``max_requests`` of them (fewer when a trace
    file holds fewer). Lengths come from ``neo.bench.workloads`` (synthetic +-10%, or the
    trace's), clipped so prompt + output fits ``max_model_len``.
    """
    if arrivals not in ARRIVALS:
        raise ValueError(f"unknown arrivals {arrivals!r}; choose one of {', '.join(ARRIVALS)}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if burstiness != 1.0 and arrivals != "poisson":
        raise ValueError(f"burstiness {burstiness:g} applies to poisson arrivals, not {arrivals!r}")
    if arrivals == "scaled":
        max_requests = min(max_requests, max(2, round(rate * duration)))
    items = parse_workload(workload, max_requests, seed=seed)
    if arrivals != "poisson" and items[0].arrival_offset is None:
        raise ValueError(f"arrivals {arrivals!r} need a workload with arrival times (azure-code, "
                         f"or a trace file with TIMESTAMP / arrival_s), got {workload!r}")
    if arrivals == "poisson":
        rng = random.Random(f"{seed}/{rate}")
        offsets, offset = [], 0.0
        while len(offsets) < max_requests and offset < duration:
            offsets.append(offset)
            # Gamma with shape 1 is the exponential: drawn as such, the same seed plans the
            # same Poisson arrivals as before burstiness was a setting.
            offset += (rng.expovariate(rate) if burstiness == 1.0
                       else rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
    else:
        trace = [item.arrival_offset - items[0].arrival_offset for item in items]
        scale = 1.0
        if arrivals == "scaled" and len(trace) > 1 and trace[-1] > 0:
            scale = (len(trace) - 1) / trace[-1] / rate
        offsets = [offset * scale for offset in trace if offset * scale <= duration]
    planned = []
    for index, (offset, item) in enumerate(zip(offsets, items)):
        prompt_len = max(1, min(item.prompt_len, max_model_len - 1))
        output_len = max(1, min(item.output_len, max_model_len - prompt_len))
        planned.append(PlannedRequest(index, offset, prompt_len, output_len))
    return planned


@dataclass
class RequestRecord:
    """What one request measured (seconds; None where it does not apply)."""

    index: int
    prompt_tokens: int
    requested_output_tokens: int
    scheduled_offset: float
    send_offset: float | None = None
    output_tokens: int = 0
    ttft: float | None = None  # send -> first token
    latency: float | None = None  # send -> last token (end-to-end latency, E2EL)
    tpot: float | None = None  # (last token - first token) / (output tokens - 1)
    per_token_latency: float | None = None  # latency / output tokens
    itl: list[float] = field(default_factory=list)  # gaps between token events, to the microsecond
    finish_reason: str | None = None
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.latency is not None

    def as_dict(self) -> dict:
        return asdict(self)


def completion_body(model: str, prompt_ids: list[int], output_len: int) -> dict:
    return {"model": model, "prompt": prompt_ids, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}


async def timed_stream(client: httpx.AsyncClient, body: dict, record: RequestRecord,
                       origin: float) -> list[float]:
    """Send one streaming request; fill ``record``; returns the arrival time of each token
    batch (``time.perf_counter``)."""
    token_times: list[float] = []
    start = time.perf_counter()
    record.send_offset = start - origin
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return token_times
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return token_times
                now = time.perf_counter()
                for choice in chunk["choices"]:
                    new_tokens = len(choice.get("token_ids", []))
                    if new_tokens:
                        if token_times:
                            record.itl.append(round(now - token_times[-1], 6))
                        token_times.append(now)
                        record.output_tokens += new_tokens
                    record.finish_reason = choice["finish_reason"] or record.finish_reason
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
        return token_times
    if record.output_tokens != record.requested_output_tokens:
        record.error = (f"ended after {record.output_tokens} of {record.requested_output_tokens} "
                        f"tokens (finish reason {record.finish_reason})")
        return token_times
    record.ttft = token_times[0] - start
    record.latency = token_times[-1] - start
    record.per_token_latency = record.latency / record.output_tokens
    if record.output_tokens > 1:
        record.tpot = (token_times[-1] - token_times[0]) / (record.output_tokens - 1)
    return token_times


async def run_load(url: str, model: str, planned: list[PlannedRequest], vocab_size: int,
                   seed: int, request_timeout: float, drain_timeout: float,
                   max_concurrency: int | None = None) -> list[RequestRecord]:
    """Send ``planned`` on schedule; wait for the last one at most ``drain_timeout`` seconds
    after the last is due, then cancel what is left (recorded with an error).

    ``max_concurrency``: at most this many requests in flight; a request due while that many
    are in flight waits for one to finish, and its times (``send_offset``, TTFT, E2EL) start
    when it is sent, as vLLM's ``--max-concurrency`` measures them."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def send(body: dict, record: RequestRecord) -> list[float]:
        async with slots:
            return await timed_stream(client, body, record, origin)

    rng = random.Random(f"prompts/{seed}")
    prompts = [random_prompt(item.prompt_len, vocab_size, rng) for item in planned]
    records = [RequestRecord(item.index, item.prompt_len, item.output_len, item.send_offset)
               for item in planned]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout, connect=60.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        origin = time.perf_counter()
        tasks = []
        for item, prompt, record in zip(planned, prompts, records):
            delay = origin + item.send_offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = completion_body(model, prompt, item.output_len)
            tasks.append(asyncio.ensure_future(send(body, record)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.latency is None and record.error is None:
            record.error = f"unfinished {drain_timeout:.0f} s after the last request was sent"
    return records


async def single_request_token_times(url: str, model: str, prompt_ids: list[int],
                                     output_len: int, timeout: float) -> list[float]:
    """Arrival times (``time.perf_counter``) of the token events of one streaming request."""
    record = RequestRecord(0, len(prompt_ids), output_len, 0.0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout)) as client:
        times = await timed_stream(client, completion_body(model, prompt_ids, output_len), record,
                                   time.perf_counter())
    if record.error is not None or record.output_tokens != output_len:
        raise RuntimeError(f"the overhead request failed: {record.error or record.output_tokens}")
    return times
