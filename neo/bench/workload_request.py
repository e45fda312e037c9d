"""One request of a benchmark workload."""

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadRequest:
    """Prompt and output length in tokens, and the arrival time in seconds after the workload's
    first request; ``arrival_offset`` is None where the workload has no arrival times
    (synthetic workloads, trace files without a time column)."""

    prompt_len: int
    output_len: int
    arrival_offset: float | None = None
