"""A ``neo serve`` subprocess for the online benchmark: start, wait for health, scrape
``/metrics``, stop with SIGINT."""

import contextlib
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> ``{name: [(labels, value), ...]}`` (comments skipped)."""
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if line.startswith("#") or not match:
            continue
        name, labels, value = match.groups()
        families.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return families


def metric_value(families, name: str, **labels) -> float:
    for sample_labels, value in families.get(name, []):
        if all(sample_labels.get(key) == text for key, text in labels.items()):
            return value
    raise KeyError(f"metric {name}{labels or ''} is not in /metrics")


class ServerProcess:
    """``neo serve --policy <policy> <engine args>`` on a free port; its output goes to
    ``log_path``. Use as a context manager: entering waits until ``/health`` answers."""

    def __init__(self, policy: str, engine_args: list[str], log_path: str,
                 host: str = "127.0.0.1", startup_timeout: float = 1800.0):
        self.policy = policy
        self.host = host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self.command = [sys.executable, "-m", "neo.cli", "--log-level", "INFO", "serve",
                        "--policy", policy, "--host", host, "--port", str(self.port), *engine_args]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"neo serve ({self.policy}) exited with {self.process.returncode} "
                                   f"while starting; its log:\n{self._log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"neo serve ({self.policy}) was not healthy after "
                                   f"{self.startup_timeout:.0f} s; its log:\n{self._log_tail()}")
            time.sleep(0.5)

    def _log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as log:
            return "".join(log.readlines()[-lines:])

    def metrics(self) -> dict:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)

    def model_card(self) -> dict:
        return httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]

    def wait_until_idle(self, timeout: float = 120.0) -> None:
        """Until no request runs or waits (aborted ones leave at the next iteration)."""
        deadline = time.monotonic() + timeout
        while True:
            families = self.metrics()
            busy = sum(metric_value(families, name) for name in
                       ("neo_requests_running", "neo_requests_waiting", "neo_requests_swapped"))
            if busy == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"neo serve ({self.policy}) still had {busy:.0f} requests "
                                   f"after {timeout:.0f} s")
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGINT, then SIGKILL if it is still running after ``timeout`` seconds."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)
