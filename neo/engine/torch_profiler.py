"""``TorchProfiler``: a ``torch.profiler`` timeline of a stretch of serving, on every rank.

``LLM.start_profile()`` and ``LLM.stop_profile()`` (vLLM's names) bracket the stretch; the
engine needs ``EngineConfig.torch_profiler_dir``. Between them each rank records its operators
and, on CUDA, every kernel, copy and collective on every stream with its start and end (CUPTI),
and at the stop writes them as a Chrome trace, ``<dir>/trace-<n>-rank<r>.json`` for the ``n``-th
stretch (from 1) of rank ``r``: Perfetto (ui.perfetto.dev) or ``chrome://tracing`` shows the
ranks' files side by side. Above one rank the driver tells the other ranks to start and stop
through the plan channel, so each starts before the same next plan.

The timeline answers what per-iteration figures cannot: which stream runs what while a host
batch is in flight, where a collective waits for another rank, when the launching thread queued
the work the GPU ran. Recording costs time of its own (each launched kernel is recorded on the
host), so a stretch of a few dozen iterations is enough, and its timings are not the engine's
undisturbed ones.
"""

import os

import torch
from torch.profiler import ProfilerActivity


class TorchProfiler:
    """One rank's recorder: ``start``, then ``stop`` writes the trace and returns its path."""

    def __init__(self, directory: str, rank: int, device_type: str):
        self.directory = directory
        self.rank = rank
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
        self.stretches = 0  # started so far
        self._profile: torch.profiler.profile | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self._profile is not None:
            raise RuntimeError("the torch profiler is already recording: stop_profile() first")
        os.makedirs(self.directory, exist_ok=True)
        self.stretches += 1
        self._profile = torch.profiler.profile(activities=self.activities)
        self._profile.start()

    def stop(self) -> str:
        """End the stretch and write its trace; returns the file's path."""
        if self._profile is None:
            raise RuntimeError("the torch profiler is not recording: start_profile() first")
        profile, self._profile = self._profile, None
        profile.stop()
        path = self.trace_path(self.stretches, self.rank)
        profile.export_chrome_trace(path)
        return path

    def trace_path(self, stretch: int, rank: int) -> str:
        return os.path.join(self.directory, f"trace-{stretch}-rank{rank}.json")
