"""Shared pieces of the pytest-benchmark kernel benchmarks: the machine's read-bandwidth ceiling
and a compact summary table printed at the end of the session.

A benchmark records a row with ``benchmark_summary.add(...)``; the rows are printed, grouped by
shape, after pytest-benchmark's own tables. Run with
``pytest benchmarks/test_bench_decode_attention.py --benchmark-only``.
"""

import platform
import time
from dataclasses import dataclass, field

import pytest
import torch

# The read-bandwidth probe: a float32 torch.sum over this many bytes with all threads.
PROBE_BYTES = 1 << 30
PROBE_REPEATS = 10


def machine_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), or what ``platform`` knows elsewhere."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_read_bandwidth(repeats: int = PROBE_REPEATS) -> float:
    """GB/s of the fastest of ``repeats`` float32 torch.sum calls over PROBE_BYTES."""
    data = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return PROBE_BYTES / best / 1e9


@dataclass
class SummaryRow:
    implementation: str
    shape: str
    dtype: str
    milliseconds: float
    gigabytes_per_second: float
    percent_of_ceiling: float


@dataclass
class BenchmarkSummary:
    """Rows collected during the session, printed by ``pytest_terminal_summary``."""

    ceiling_gigabytes_per_second: float | None = None
    probe_bytes: int = PROBE_BYTES
    rows: list[SummaryRow] = field(default_factory=list)

    def add(self, implementation: str, shape: str, dtype: torch.dtype, seconds: float,
            nbytes: int) -> dict:
        """Record one measurement; returns its figures for ``benchmark.extra_info``."""
        gigabytes_per_second = nbytes / seconds / 1e9
        percent = 100 * gigabytes_per_second / self.ceiling_gigabytes_per_second
        self.rows.append(SummaryRow(implementation, shape, str(dtype).removeprefix("torch."),
                                    seconds * 1e3, gigabytes_per_second, percent))
        return {"gb_per_s": round(gigabytes_per_second, 2),
                "ceiling_gb_per_s": round(self.ceiling_gigabytes_per_second, 2),
                "percent_of_ceiling": round(percent, 1)}


SUMMARY_KEY = pytest.StashKey[BenchmarkSummary]()


@pytest.fixture(scope="session")
def benchmark_summary(request) -> BenchmarkSummary:
    """The session's summary, with the read-bandwidth ceiling measured when first needed."""
    summary = request.config.stash.setdefault(SUMMARY_KEY, BenchmarkSummary())
    if summary.ceiling_gigabytes_per_second is None:
        summary.ceiling_gigabytes_per_second = measure_read_bandwidth()
    return summary


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    summary = config.stash.get(SUMMARY_KEY, None)
    if summary is None or not summary.rows:
        return
    write = terminalreporter.write_line
    terminalreporter.section("kernel bandwidth summary")
    write(f"machine: {machine_name()}; torch {torch.__version__}; "
          f"{torch.get_num_threads()} threads")
    write(f"read-bandwidth ceiling (float32 torch.sum over {PROBE_BYTES >> 30} GiB, best of "
          f"{PROBE_REPEATS}): {summary.ceiling_gigabytes_per_second:.1f} GB/s")
    write(f"{'implementation':<20}{'shape':<14}{'dtype':<10}{'ms':>9}{'GB/s':>9}"
          f"{'% ceiling':>11}")
    for row in sorted(summary.rows, key=lambda row: (row.shape, row.dtype, row.implementation)):
        write(f"{row.implementation:<20}{row.shape:<14}{row.dtype:<10}{row.milliseconds:>9.2f}"
              f"{row.gigabytes_per_second:>9.1f}{row.percent_of_ceiling:>10.0f}%")
