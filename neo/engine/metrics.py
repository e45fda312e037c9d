"""``EngineMetrics``: cumulative counters, and the optional per-iteration trace."""

import json
from dataclasses import asdict, dataclass, field


@dataclass
class EngineMetrics:
    """Counters since the engine started (``LLM.get_metrics()`` returns them as a dict)."""

    iterations: int = 0
    two_batch_iterations: int = 0
    graph_iterations: int = 0  # replayed from a captured CUDA graph
    graph_swap_iterations: int = 0  # of those, plans that also moved blocks between the pools
    host_batches: int = 0  # host batches of the async host pipeline completed
    graph_host_batches: int = 0  # of those, replayed from captured CUDA graphs
    host_batches_between_steps: int = 0  # launched while a step waited for its tokens
    prefill_tokens: int = 0
    gpu_decode_tokens: int = 0
    host_decode_tokens: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    output_tokens: int = 0
    busy_seconds: float = 0.0  # in steps that launched or ran work, the scheduler's time aside
    schedule_seconds: float = 0.0  # in the scheduler

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class IterationRecord:
    """One iteration of the trace."""

    iteration: int
    num_sub_batches: int
    prefill_tokens: int
    gpu_decodes: int
    host_decodes: int
    predicted_seconds: float | None
    predicted_host_seconds: float | None  # calibrated estimate of the host attention
    profiled_host_seconds: float | None  # the profile's estimate before calibration
    measured_seconds: float  # launching the step's host batch (if any) and executing the plan,
    # until its tokens were on the host, counted from the read of the iteration before's tokens
    # where that came later (async scheduling: ``LLMEngine._step_seconds``); of that:
    launch_seconds: float  # launching the step's host batch (async host pipeline)
    queue_seconds: float  # building the plan's inputs and queuing its device work
    host_busy_seconds: float
    gpu_busy_seconds: float | None
    schedule_seconds: float  # the scheduler's own time for this plan
    graph_replayed: bool  # replayed from a captured CUDA graph (decode-only, host decodes or not)
    # Blocks the plan moved between the pools (both ways), copied before a replayed graph or
    # beside an eager iteration's layers.
    blocks_swapped: int = 0
    # Segments the device's caching allocator returned (cudaFree waits for the whole device,
    # host batches in flight included) during the step; None off CUDA.
    device_segments_freed: int | None = None
    # A host batch of the async host pipeline (measured from its launch until its tokens were
    # on the host, beside the iterations recorded meanwhile), and how long steps with no GPU
    # work waited for it.
    host_batch: bool = False
    host_batch_wait_seconds: float | None = None
    # Whether a prefill ran beside the host batch (its rest is then no calibration sample:
    # ``neo.sched.placement.host_batches``); None for iterations.
    host_batch_beside_prefill: bool | None = None
    # Context tokens the host decodes attended over, summed over them (their K/V bytes are what
    # host attention reads: these tokens times the layout's bytes per token).
    host_context_tokens: int = 0
    # Under the async host pipeline: whether a host batch was in flight beside the iteration when
    # it was planned (None under the other pipelines).
    beside_host_batch: bool | None = None


@dataclass
class IterationTrace:
    """Per-iteration records, written as JSON on ``save``."""

    records: list[IterationRecord] = field(default_factory=list)

    def add(self, record: IterationRecord) -> None:
        self.records.append(record)

    def save(self, path: str) -> None:
        with open(path, "w") as file:
            json.dump([asdict(record) for record in self.records], file, indent=1)
