"""``StartupPhases``: where an engine's construction spends its time.

``build`` wraps each phase of the construction (loading the model, allocating the KV pools,
capturing the decode graphs, the GEMM warm-up, loading or measuring the perf model, ...) in
``phase``; the engine keeps the result as ``LLMEngine.startup_seconds`` and logs one summary
line when it is ready. A phase that queues GPU work ends with a ``torch.cuda.synchronize`` of
the device, so the work is charged to the phase that launched it and not to a later one.
"""

import time
from contextlib import contextmanager

import torch

TOTAL = "total"
OTHER = "other"


class StartupPhases:
    """Wall-clock seconds of each named phase, in the order they first ran; ``notes`` adds a
    short description to a phase in the summary (e.g. how many graphs it captured)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self.total_seconds: float | None = None

    @contextmanager
    def phase(self, name: str):
        """Time the block as phase ``name`` (added to the phase's earlier time if it ran
        before). Nothing is recorded when the block raises."""
        began = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began

    def note(self, name: str, text: str) -> None:
        self.notes[name] = text

    def finish(self) -> dict[str, float]:
        """Stop the clock (once) and return ``result``."""
        if self.total_seconds is None:
            self.total_seconds = time.perf_counter() - self.started
        return self.result()

    def result(self) -> dict[str, float]:
        """``{phase: seconds, ..., "other": the time outside every phase, "total": from
        construction to ``finish``}``: the phases and "other" add up to "total"."""
        if self.total_seconds is None:
            raise RuntimeError("the start-up clock is still running: call finish() first")
        other = max(0.0, self.total_seconds - sum(self.seconds.values()))
        return {**self.seconds, OTHER: other, TOTAL: self.total_seconds}

    def summary(self) -> str:
        """One line: ``engine ready in 12.3 s: load model 1.0 s, KV pools 0.4 s, decode CUDA
        graphs 3.1 s (17 batch sizes), ..., other 0.1 s``."""
        seconds = self.result()
        parts = [f"{name} {value:.2f} s" + (f" ({self.notes[name]})" if name in self.notes else "")
                 for name, value in seconds.items() if name != TOTAL]
        return f"engine ready in {seconds[TOTAL]:.2f} s: " + ", ".join(parts)
