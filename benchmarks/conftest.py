"""Shared pieces of the pytest-benchmark kernel benchmarks: the size of the working set that makes
a kernel read from DRAM, the read-bandwidth probe measured the same way, and a compact summary
table printed at the end of the session (the probe itself: ``read_probe.py``).

A kernel that reads the same few hundred MiB on every call is served partly from the last-level
cache, and its bytes per second then exceed what DRAM delivers. The benchmarks therefore keep a
working set of ``--kv-working-set-gib`` GiB (at least four times the last-level cache and 1 GiB)
and read a different slice of it on each call, so that a slice has been evicted by the others
before it is read again. The probe the figures are ratios to, a float32 ``torch.sum``, reads a
buffer of the same size in the same rotation, timed right after each kernel it judges.

A benchmark records a row with ``benchmark_summary.add(...)``; the rows are printed, grouped by
where the data came from, thread count and shape, after pytest-benchmark's own tables. Run with
``pytest benchmarks/test_bench_decode_attention.py --benchmark-only``.
"""

import glob
import math
import os
import platform
from dataclasses import dataclass, field

import pytest
import torch

import neo.ops
from read_probe import PROBE_ROUNDS, PROBE_SLICES, ReadProbe

GIB = 1 << 30
# The kernel whose time the summary also gives every other row's as a multiple of.
REFERENCE_KERNEL = "ispc"
# The working set: this many GiB unless --kv-working-set-gib says otherwise, and never less than
# MIN_CACHE_MULTIPLE times the last-level cache or MIN_WORKING_SET_GIB.
DEFAULT_WORKING_SET_GIB = 8.0
MIN_CACHE_MULTIPLE = 4
MIN_WORKING_SET_GIB = 1.0
DEFAULT_SECONDS_PER_BENCHMARK = 1.5

# Thread counts the kernels run on: all cores, and all but one (one core left to the thread that
# drives the GPU in the engine).
THREAD_COUNTS = sorted({os.cpu_count() or 1, max(1, (os.cpu_count() or 1) - 1)}, reverse=True)

DRAM = "DRAM"
IN_CACHE = "in cache"


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


def last_level_cache_bytes() -> int | None:
    """Size of CPU 0's highest-level cache from sysfs (e.g. ``491520K``), None where unknown."""
    largest_level, size = 0, None
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "level")) as level_file:
                level = int(level_file.read())
            with open(os.path.join(index, "size")) as size_file:
                text = size_file.read().strip()
        except (OSError, ValueError):
            continue
        multiplier = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if level > largest_level and digits.isdigit():
            largest_level, size = level, int(digits) * multiplier
    return size


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def minimum_working_set_bytes() -> int:
    cache = last_level_cache_bytes() or 0
    return max(MIN_CACHE_MULTIPLE * cache, int(MIN_WORKING_SET_GIB * GIB))


def require_memory(nbytes: int, what: str) -> None:
    """Skip the test, naming the need, when the machine has less than ``nbytes`` available."""
    available = available_memory_bytes()
    if available is not None and available < nbytes:
        pytest.skip(f"{what} needs {nbytes / GIB:.1f} GiB of available memory, the machine has "
                    f"{available / GIB:.1f} GiB (lower --kv-working-set-gib, at least "
                    f"{minimum_working_set_bytes() / GIB:.1f} GiB on this machine)")


def pytest_addoption(parser):
    parser.addoption(
        "--kv-working-set-gib", type=float, default=DEFAULT_WORKING_SET_GIB,
        help="GiB of K/V (and of the read probe's buffer) the kernel benchmarks rotate through, "
             f"a different slice each call; at least {MIN_CACHE_MULTIPLE}x the last-level cache "
             f"and {MIN_WORKING_SET_GIB:g} GiB (default {DEFAULT_WORKING_SET_GIB:g})")
    parser.addoption(
        "--seconds-per-benchmark", type=float, default=DEFAULT_SECONDS_PER_BENCHMARK,
        help="about how long each kernel benchmark runs; its rounds are chosen to fill it "
             f"(default {DEFAULT_SECONDS_PER_BENCHMARK:g})")


@pytest.fixture(scope="session")
def seconds_per_benchmark(request) -> float:
    """About how long one benchmark runs (its number of rounds is chosen for it)."""
    return request.config.getoption("--seconds-per-benchmark")


def pytest_configure(config):
    seconds = config.getoption("--seconds-per-benchmark")
    if not seconds > 0:
        raise pytest.UsageError(f"--seconds-per-benchmark={seconds:g} must be positive")
    gib = config.getoption("--kv-working-set-gib")
    minimum = minimum_working_set_bytes()
    if gib * GIB < minimum:
        raise pytest.UsageError(
            f"--kv-working-set-gib={gib:g} is below {minimum / GIB:.2f} GiB: the working set must "
            f"be at least {MIN_CACHE_MULTIPLE}x the last-level cache "
            f"({(last_level_cache_bytes() or 0) / GIB:.2f} GiB) and {MIN_WORKING_SET_GIB:g} GiB")


@pytest.fixture(scope="session")
def working_set_bytes(request) -> int:
    """Bytes of the rotated working set (K and V together; the probe's buffer)."""
    return int(request.config.getoption("--kv-working-set-gib") * GIB)




@dataclass
class SummaryRow:
    source: str  # DRAM or IN_CACHE
    threads: int
    implementation: str
    shape: str
    dtype: str
    milliseconds: float
    gigabytes_per_second: float
    probe_gigabytes_per_second: float
    percent_of_probe: float


@dataclass
class BenchmarkSummary:
    """Rows collected during the session, printed by ``pytest_terminal_summary``.

    The host's read bandwidth can drift while a session runs (other work on the machine, the
    memory's own state), so a probe measured once would let a kernel's share of it drift as
    much. Each row is therefore a ratio to the probe timed right after that row's kernel, at
    the same thread count, on one rotated buffer of the working set's size (``probe``) kept
    for the session.
    """

    working_set_bytes: int
    probe: ReadProbe
    rows: list[SummaryRow] = field(default_factory=list)

    def add(self, source: str, implementation: str, shape: str, dtype: torch.dtype,
            seconds: float, nbytes: int) -> dict:
        """Record one measurement on ``torch.get_num_threads()`` threads, of ``nbytes`` read
        from ``source`` (DRAM or IN_CACHE), and time the probe beside it; returns its figures
        for ``benchmark.extra_info``."""
        threads = torch.get_num_threads()
        probe = self.probe.read_bandwidth()
        gigabytes_per_second = nbytes / seconds / 1e9
        percent = 100 * gigabytes_per_second / probe
        self.rows.append(SummaryRow(source, threads, implementation, shape,
                                    str(dtype).removeprefix("torch."), seconds * 1e3,
                                    gigabytes_per_second, probe, percent))
        return {"source": source, "gb_per_s": round(gigabytes_per_second, 2),
                "probe_gb_per_s": round(probe, 2), "percent_of_probe": round(percent, 1)}


SUMMARY_KEY = pytest.StashKey[BenchmarkSummary]()


@pytest.fixture(scope="session")
def benchmark_summary(request, working_set_bytes) -> BenchmarkSummary:
    """The session's summary and its probe buffer (allocated before any K/V working set, which
    must fit beside it), read once through to warm it."""
    summary = request.config.stash.get(SUMMARY_KEY, None)
    if summary is None:
        require_memory(working_set_bytes, "the read probe's rotated buffer")
        probe = ReadProbe.allocate(working_set_bytes)
        probe.warm_up()
        summary = request.config.stash[SUMMARY_KEY] = BenchmarkSummary(working_set_bytes, probe)
    return summary


def times_reference(row: SummaryRow, reference_ms: dict) -> str:
    """The row's time over the REFERENCE_KERNEL row's at the same source, threads, shape and dtype
    ("1.84x"), or "-" for that kernel's own rows and rows it has no match for."""
    reference = reference_ms.get((row.source, row.threads, row.shape, row.dtype))
    if row.implementation == REFERENCE_KERNEL or reference is None:
        return "-"
    return f"{row.milliseconds / reference:.2f}x"


def shape_order(shape: str) -> tuple:
    """'16x4096' sorts by its numbers; other labels after them."""
    parts = shape.split("x")
    return tuple(int(part) for part in parts) if all(p.isdigit() for p in parts) else (math.inf,)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    summary = config.stash.get(SUMMARY_KEY, None)
    if summary is None or not summary.rows:
        return
    write = terminalreporter.write_line
    terminalreporter.section("kernel bandwidth summary")
    cache = last_level_cache_bytes()
    variant = neo.ops.ispc_bf16_decode_variant()
    write(f"machine: {machine_name()}, {os.cpu_count()} CPUs, last-level cache "
          f"{'unknown' if cache is None else f'{cache / (1 << 20):.0f} MiB'}; "
          f"torch {torch.__version__}" + (f"; ispc bf16 variant {variant}" if variant else ""))
    write(f"working set {summary.working_set_bytes / GIB:.1f} GiB, a different slice each call. "
          f"Read probe: float32 torch.sum, a different 1/{PROBE_SLICES} of a "
          f"{summary.working_set_bytes / GIB:.1f} GiB buffer each call, fastest of "
          f"{PROBE_ROUNDS * PROBE_SLICES}, timed right after each row's kernel on its threads")
    write(f"% probe: the kernel's K/V bytes per second over that probe's; x {REFERENCE_KERNEL}: the "
          f"row's time over the {REFERENCE_KERNEL} row's on the same threads, shape, dtype and source")
    reference_ms = {(row.source, row.threads, row.shape, row.dtype): row.milliseconds
                    for row in summary.rows if row.implementation == REFERENCE_KERNEL}
    for source, title in ((DRAM, "from DRAM (rotated working set)"),
                          (IN_CACHE, "in cache (one small K/V set read on every call: partly "
                                     "served from the last-level cache, not a DRAM figure)")):
        rows = [row for row in summary.rows if row.source == source]
        if not rows:
            continue
        write("")
        write(title)
        write(f"{'threads':>7}  {'implementation':<20}{'shape':<11}{'dtype':<10}{'ms':>9}"
              f"{'GB/s':>9}{'/thread':>9}{'probe':>9}{'% probe':>9}{'x ' + REFERENCE_KERNEL:>9}")
        for row in sorted(rows, key=lambda row: (-row.threads, shape_order(row.shape), row.dtype,
                                                 row.implementation)):
            write(f"{row.threads:>7}  {row.implementation:<20}{row.shape:<11}{row.dtype:<10}"
                  f"{row.milliseconds:>9.2f}{row.gigabytes_per_second:>9.1f}"
                  f"{row.gigabytes_per_second / row.threads:>9.2f}"
                  f"{row.probe_gigabytes_per_second:>9.1f}{row.percent_of_probe:>8.0f}%"
                  f"{times_reference(row, reference_ms):>9}")
