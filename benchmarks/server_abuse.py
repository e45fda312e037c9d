"""How fast ``/health`` answers, and how legitimate streams fare, while clients abuse the server.

Starts ``neo serve`` on a loopback port, keeps ``--streams`` greedy streaming completions
running, and polls ``/health`` every 20 ms from a process of its own. Phases of ``--seconds``
each: ``baseline`` (no abuse), ``50 MB body`` (a client sends 50 MB bodies back to back, half
with a Content-Length, half chunked without one), ``200k stop strings`` (a client sends
completions with 200,000 stop strings back to back) and ``both``. Per phase it reports the
/health latency percentiles (each against the baseline's), the abusive requests and the status
codes they got, and the legitimate streams completed and their inter-token latency.

    python benchmarks/server_abuse.py --model neo-tiny --device cpu --out results/raw/server_abuse.json
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

POLL_SECONDS = 0.02
BIG_BODY_BYTES = 50 * 2**20
STOP_STRINGS = 200_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(fraction * (len(ordered) - 1))))]


def poll_health(url: str, stop, results) -> None:
    """In a process of its own: (time, latency seconds, status) of /health every POLL_SECONDS."""
    samples = []
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                status = client.get("/health").status_code
            except httpx.HTTPError:
                status = 0
            samples.append((began, time.monotonic() - began, status))
            time.sleep(max(0.0, POLL_SECONDS - (time.monotonic() - began)))
    results.put(samples)


def run_streams(url: str, num_streams: int, max_tokens: int, stop, results) -> None:
    """In a process of its own: greedy streams back to back on ``num_streams`` lanes; each
    finished stream as (end time, status, tokens, inter-token gaps)."""
    async def lane(client: httpx.AsyncClient, index: int, finished: list) -> None:
        body = {"prompt": f"Lane {index} says hello", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        while not stop.is_set():
            gaps, tokens, last = [], 0, time.monotonic()
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        gaps.append(now - last)
                        last = now
                        tokens += 1
            finished.append((time.monotonic(), response.status_code, tokens, gaps[1:]))

    async def main() -> list:
        finished: list = []
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
            await asyncio.gather(*(lane(client, index, finished) for index in range(num_streams)))
        return finished

    results.put(asyncio.run(main()))


def chunks(total: int, size: int = 2**20):
    piece = b"x" * size
    for _ in range(total // size):
        yield piece


def abuse(url: str, kind: str, deadline: float) -> list[int]:
    """Send abusive requests of ``kind`` back to back until ``deadline``; their status codes."""
    statuses = []
    stop_body = json.dumps({"prompt": "hi", "max_tokens": 2, "stop": ["a"] * STOP_STRINGS}).encode()
    with httpx.Client(base_url=url, timeout=60.0) as client:
        while time.monotonic() < deadline:
            try:
                if kind == "stop":
                    response = client.post("/v1/completions", content=stop_body,
                                           headers={"content-type": "application/json"})
                elif len(statuses) % 2:
                    response = client.post("/v1/completions", content=chunks(BIG_BODY_BYTES),
                                           headers={"content-type": "application/json"})
                else:
                    response = client.post("/v1/completions", content=b"x" * BIG_BODY_BYTES,
                                           headers={"content-type": "application/json"})
                statuses.append(response.status_code)
            except httpx.HTTPError:
                statuses.append(0)
    return statuses


def summarize(name: str, start: float, end: float, polls: list, streams: list, statuses: list[int]) -> dict:
    latencies = [latency for began, latency, status in polls if start <= began < end]
    failed_polls = sum(1 for began, _, status in polls if start <= began < end and status != 200)
    done = [stream for stream in streams if start <= stream[0] < end]
    gaps = [gap for stream in done for gap in stream[3]]
    return {
        "phase": name, "seconds": round(end - start, 2), "health_polls": len(latencies),
        "health_failed": failed_polls,
        "health_p50_ms": round(1e3 * percentile(latencies, 0.5), 2),
        "health_p99_ms": round(1e3 * percentile(latencies, 0.99), 2),
        "health_max_ms": round(1e3 * max(latencies), 2),
        "abusive_requests": len(statuses), "abusive_statuses": sorted(set(statuses)),
        "streams_completed": len(done), "streams_not_200": sum(1 for stream in done if stream[1] != 200),
        "itl_p50_ms": round(1e3 * statistics.median(gaps), 2) if gaps else None,
        "itl_p99_ms": round(1e3 * percentile(gaps, 0.99), 2) if gaps else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="neo-tiny")
    parser.add_argument("--device", default=None)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("serve_arguments", nargs="*", help="more `neo serve` arguments (after --)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "neo.cli", "serve", "--model", args.model, "--port", str(port),
               *(["--device", args.device] if args.device else []), *args.serve_arguments]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                print(server.stderr.read(), file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in 300 s")
            time.sleep(0.2)
        print(f"serving on {url}; {args.streams} streams, {args.seconds:.0f} s per phase", flush=True)
        stop = multiprocessing.Event()
        health_results, stream_results = multiprocessing.Queue(), multiprocessing.Queue()
        workers = [multiprocessing.Process(target=poll_health, args=(url, stop, health_results)),
                   multiprocessing.Process(target=run_streams,
                                           args=(url, args.streams, args.max_tokens, stop, stream_results))]
        for worker in workers:
            worker.start()
        time.sleep(2.0)  # the streams are under way
        phases = []
        for name, kinds in (("baseline", []), ("50 MB body", ["body"]), ("200k stop strings", ["stop"]),
                            ("both", ["body", "stop"])):
            start = time.monotonic()
            end = start + args.seconds
            if kinds:
                with multiprocessing.Pool(len(kinds)) as pool:
                    statuses = [s for part in pool.starmap(abuse, [(url, kind, end) for kind in kinds]) for s in part]
            else:
                time.sleep(args.seconds)
                statuses = []
            phases.append((name, start, time.monotonic(), statuses))
            print(f"  {name}: {len(statuses)} abusive requests", flush=True)
        stop.set()
        polls, streams = health_results.get(timeout=120), stream_results.get(timeout=300)
        for worker in workers:
            worker.join(timeout=60)
        rows = [summarize(name, start, end, polls, streams, statuses) for name, start, end, statuses in phases]
        for row in rows:
            print(json.dumps(row))
        report = {"command": " ".join(sys.argv), "model": args.model, "device": args.device or "auto",
                  "cpu_count": os.cpu_count(), "phases": rows}
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as file:
                json.dump(report, file, indent=1)
        return 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
