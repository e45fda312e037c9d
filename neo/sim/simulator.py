"""The simulation loop: the real scheduler against a simulated clock.

Each step is the engine's (``neo.engine.engine``): ``schedule`` -> execute -> ``update``.
Executing a plan advances the clock by the time the cost function gives it
(``Estimates.plan_time`` on the simulated machine's table: the plan's stage order, its CUDA
graph where the engine would replay one), plus its swaps' block copies over the host link,
and hands the scheduler the outputs the engine would: one token per planned request, the
iteration's seconds and host-attention seconds. Prompts' K/V copied out to the host pool during
a prefill overlap the prefill's layers and are not counted.

Async scheduling (on unless the engine config turns it off, as on one GPU): a step planned
while the previous iteration runs costs the GPU nothing; a step that runs in the synchronous
order (``SchedulerOutput.runs_ahead`` false, or the GPU pool short of room for the next tokens:
``Scheduler.can_plan_ahead``), and the step after it, make the GPU wait for the host's work
(``Hardware.sync_step_us`` and ``sync_step_request_us``).

Under the async host pipeline a plan's host batch is launched when it is planned and runs on the
host's own timeline: it completes after its cost (``PerfModel.host_batch_time``), and is
collected, as in the engine, after the first step whose GPU work ends past that (a step with no
GPU work waits for it, or for the next arrival); under async scheduling the engine collects it
when it completes during an iteration launched ahead, and launches the next one then
(``Scheduler.schedule_host_batch``), and so does the simulation. Its ``pre``/``post`` stages share the GPU with
the iterations that run beside it: an iteration alone ``d`` seconds long progresses at
``1 / (1 + G / T)`` of its speed while a batch lasting ``T`` is in flight, ``G`` the batch's
GPU stages' time (``Estimates.host_batch_gpu_time``: for ``n`` decodes in one sub-batch a
decode graph's time of ``n`` rows where the batch's graphs replay, else ``linear(n)``; its
halves' sum in ``host-batch-pair``). The engine queues a batch's layers in parts
(``neo.runner.host_batches``), at most ``PARTS_PENDING`` parts of ``DEFAULT_LAYERS_PER_PART``
layers pending, one host function per layer; where the CUDA driver queues fewer host functions
than that (``Hardware.queued_host_functions``), launching the batch holds the engine's thread,
and so the GPU's next iteration, until the first layers' host attention has run.

Requests arrive at their workload offsets (all at once without them); outputs are forced to
their lengths, as ``neo bench`` forces them.
"""

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from neo.bench.offline import head_and_tail_seconds, steady_throughput
from neo.bench.workload_request import WorkloadRequest
from neo.config import EngineConfig
from neo.models.config import ModelConfig
from neo.request import Request
from neo.runner.host_batches import DEFAULT_LAYERS_PER_PART, PARTS_PENDING
from neo.sampling_params import SamplingParams
from neo.sched.perf_model import PerfTable
from neo.sched.runner_output import HostBatchOutput, IterationOutput
from neo.sched.scheduler_output import SchedulerOutput

from .hardware import Hardware
from .parts import SchedulingParts, build_parts

TOKEN = 0  # the token every simulated decode samples


@dataclass
class HostBatchInFlight:
    requests: list[Request]
    done_at: float  # simulated seconds
    seconds: float
    host_seconds: float
    slowdown: float  # of the GPU iterations beside it


@dataclass
class SimulationResult:
    policy: str
    num_requests: int
    finished_requests: int
    elapsed_s: float  # simulated seconds from the first arrival to the last token (or the cut)
    prompt_tokens: int
    output_tokens: int
    iterations: int
    two_sub_batch_iterations: int
    host_batches: int
    host_decode_tokens: int
    gpu_decode_tokens: int
    preemptions: int
    steady_output_tokens_per_s: float
    # Seconds the first and the last 10% of the output tokens took (``head_and_tail_seconds``);
    # None for a run cut short.
    head_and_tail_s: tuple[float, float] | None
    cut_short: bool
    gpu_kv_pool_gib: float
    cpu_kv_pool_gib: float
    ttft_s: list[float] = field(repr=False)
    tpot_s: list[float] = field(repr=False)
    iteration_s: list[float] = field(repr=False)  # each executed plan's simulated seconds
    host_batch_s: list[float] = field(repr=False)  # each host batch's seconds
    host_batch_sizes: list[int] = field(repr=False)  # each host batch's requests
    note: str = ""

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def host_decode_share(self) -> float:
        decodes = self.host_decode_tokens + self.gpu_decode_tokens
        return self.host_decode_tokens / decodes if decodes else 0.0

    def summary(self) -> dict:
        """The figures, with the TTFT/TPOT distributions as percentiles."""
        return {
            "policy": self.policy, "num_requests": self.num_requests, "finished_requests": self.finished_requests,
            "elapsed_s": self.elapsed_s, "output_tokens_per_s": self.output_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "steady_output_tokens_per_s": self.steady_output_tokens_per_s,
            "head_and_tail_s": self.head_and_tail_s, "cut_short": self.cut_short,
            "iterations": self.iterations, "two_sub_batch_iterations": self.two_sub_batch_iterations,
            "host_batches": self.host_batches, "host_decode_share": self.host_decode_share,
            "preemptions": self.preemptions, "gpu_kv_pool_gib": self.gpu_kv_pool_gib,
            "cpu_kv_pool_gib": self.cpu_kv_pool_gib,
            "ttft_s": distribution(self.ttft_s), "tpot_s": distribution(self.tpot_s),
            "iteration_s": distribution(self.iteration_s), "host_batch_s": distribution(self.host_batch_s),
            "host_batch_requests": distribution(self.host_batch_sizes), "note": self.note,
        }


def distribution(values: list[float]) -> dict:
    """Mean and p50/p90/p99 (None for no values)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def percentile(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1)]

    return {"mean": statistics.fmean(ordered), "p50": percentile(0.5), "p90": percentile(0.9),
            "p99": percentile(0.99)}


def make_requests(workload: list[WorkloadRequest], max_model_len: int,
                  max_num_batched_tokens: int) -> list[tuple[float, Request]]:
    """(arrival offset, request) in arrival order, lengths capped as ``neo bench`` caps them."""
    requests = []
    for index, item in enumerate(workload):
        prompt_len = min(item.prompt_len, max_model_len - 1, max_num_batched_tokens)
        output_len = max(1, min(item.output_len, max_model_len - prompt_len))
        offset = item.arrival_offset or 0.0
        request = Request(str(index), [1] * prompt_len,
                          SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True), arrival_time=offset)
        requests.append((offset, request))
    return sorted(requests, key=lambda pair: pair[0])


class Simulation:
    """One policy's run (``run``). ``on_iteration(plan, seconds)`` sees each executed plan and
    its simulated seconds. Time follows ``table``; the scheduler plans with ``planning_table``
    where given (``build_parts``)."""

    def __init__(self, config: EngineConfig, model: ModelConfig, hardware: Hardware, table: PerfTable,
                 max_model_len: int, on_iteration: Callable[[SchedulerOutput, float], None] | None = None,
                 planning_table: PerfTable | None = None):
        self.config = config
        self.hardware = hardware
        self.parts: SchedulingParts = build_parts(config, model, hardware, table, max_model_len, planning_table)
        self.max_model_len = max_model_len
        self.num_layers = model.num_layers
        self.on_iteration = on_iteration
        self.clock = 0.0
        self.in_flight: HostBatchInFlight | None = None
        self.iteration_seconds: list[float] = []
        self.host_batches: list[HostBatchInFlight] = []
        # Async scheduling as the engine resolves it on a GPU (on unless set off).
        self.schedules_ahead = config.async_scheduling if config.async_scheduling is not None else True

    # -- times ---------------------------------------------------------------------------------

    def copy_seconds(self, plan: SchedulerOutput) -> float:
        """The plan's whole-request block copies between the pools over the host link."""
        block_bytes = self.parts.layout.block_bytes
        out = len(plan.swap_out) * block_bytes / (self.hardware.pcie_d2h_gbps * 1e9) if plan.swap_out else 0.0
        back = len(plan.swap_in) * block_bytes / (self.hardware.pcie_h2d_gbps * 1e9) if plan.swap_in else 0.0
        return out + back

    def beside_host_batch(self, alone: float) -> float:
        """Seconds of GPU work ``alone`` seconds long started now, beside the host batch in
        flight (see the module docstring)."""
        flight = self.in_flight
        if flight is None or flight.done_at <= self.clock:
            return alone
        slowed = alone * flight.slowdown
        overlap = flight.done_at - self.clock
        if slowed <= overlap:
            return slowed
        return overlap + (alone - overlap / flight.slowdown)

    def launch(self, plan: SchedulerOutput, at: float | None = None) -> None:
        """Launch the plan's host batch now, or at ``at`` (a launch between steps, while the
        GPU's iteration runs: it holds no step)."""
        requests = plan.host_batch.host_decodes
        timing = self.parts.timing
        seconds, host = timing.host_batch_time(requests)
        gpu_share = timing.host_batch_gpu_time(len(requests)) / seconds if seconds > 0 else 0.0
        start = self.clock if at is None else at
        self.in_flight = HostBatchInFlight(list(requests), start + seconds, seconds, host,
                                           max(1 + gpu_share, self.hardware.host_batch_slowdown))
        self.host_batches.append(self.in_flight)
        if at is None:
            self.clock += self.launch_seconds(host)

    def relaunch_between_steps(self, plan: SchedulerOutput,
                               previous: SchedulerOutput | None) -> tuple[list[Request], int]:
        """The engine's launch of a host batch between steps (``Scheduler.schedule_host_batch``,
        ``previous``: the plan before, whose tokens the engine waits for meanwhile): where the
        batch in flight completed while the GPU ran ``plan``, launched ahead, it is
        collected when it completed and the next one launched then, beside the rest of the
        iteration, which the new batch slows from there (on one rank, as the engine does).
        Returns the requests that got a token and the host decodes launched."""
        flight = self.in_flight
        if flight is None or flight.done_at > self.clock:
            return [], 0
        completed = self.collect(True, math.inf)
        scheduler = self.parts.scheduler
        decoded = scheduler.update(plan, None, completed)
        relaunch = scheduler.schedule_host_batch(plan, () if previous is None else (previous,))
        if relaunch is None:
            return decoded, 0
        self.launch(relaunch, at=flight.done_at)
        slowed = (self.clock - flight.done_at) * (self.in_flight.slowdown - 1)
        self.clock += slowed
        self.iteration_seconds[-1] += slowed
        return decoded, len(relaunch.host_batch.host_decodes)

    def launch_seconds(self, host: float) -> float:
        """How long launching a host batch of ``host`` seconds of host attention holds the
        engine's thread: until no more than ``queued_host_functions`` of the per-layer host
        functions it queues at once are left to run."""
        queued_at_launch = min(self.num_layers, PARTS_PENDING * DEFAULT_LAYERS_PER_PART)
        waited_layers = max(0, queued_at_launch - self.hardware.queued_host_functions)
        return host * waited_layers / self.num_layers

    def sync_step_seconds(self, plan: SchedulerOutput, hidden: bool) -> float:
        """Host work of the plan's step that the GPU waits for: none when the step was planned
        while the previous iteration ran (``hidden``), else the hardware's per-step and
        per-request figures."""
        if hidden or not any(plan.sub_batches):
            return 0.0
        return (self.hardware.sync_step_us + self.hardware.sync_step_request_us * len(plan.requests)) * 1e-6

    def execute(self, plan: SchedulerOutput) -> IterationOutput | None:
        if plan.is_empty:
            return None
        seconds, host_seconds = self.parts.timing.plan_time(plan)
        seconds = self.beside_host_batch(seconds + self.copy_seconds(plan))
        self.clock += seconds
        self.iteration_seconds.append(seconds)
        if self.on_iteration is not None:
            self.on_iteration(plan, seconds)
        return IterationOutput([TOKEN] * len(plan.requests), seconds, host_seconds)

    def collect(self, ran_gpu_work: bool, next_arrival: float) -> HostBatchOutput | None:
        """The host batch in flight once it is done; a step without GPU work waits for it (or
        for the next arrival, whichever comes first)."""
        flight = self.in_flight
        if flight is None:
            return None
        wait = 0.0
        if not ran_gpu_work and flight.done_at > self.clock:
            until = min(flight.done_at, next_arrival)
            wait, self.clock = until - self.clock, until
        if flight.done_at > self.clock:
            return None
        self.in_flight = None
        return HostBatchOutput(flight.requests, [TOKEN] * len(flight.requests), flight.seconds, flight.host_seconds,
                               False, wait)

    def check_fits(self, requests: list[Request]) -> None:
        manager, block_size = self.parts.block_manager, self.config.block_size
        capacity = max(manager.num_total(pool) for pool in self.parts.scheduler.placement.decode_pools) * block_size
        longest = max((request.num_tokens for request in requests), default=0)
        if longest + 1 > capacity:
            raise ValueError(f"a prompt of {longest} tokens can never fit the KV pools: the largest the "
                             f"{self.config.policy} policy decodes in holds {capacity} tokens; raise "
                             f"gpu_kv_cache_gib or cpu_kv_cache_gib")

    # -- the run -------------------------------------------------------------------------------

    def run(self, workload: list[WorkloadRequest], duration: float | None = None,
            show_progress: bool = False) -> SimulationResult:
        """Every request to completion, or until ``duration`` simulated seconds. Raises
        ``ValueError`` for a prompt that can never fit the KV pools (the engine refuses it), and
        ``RuntimeError`` if the scheduler stops making progress with nothing left to arrive."""
        scheduler = self.parts.scheduler
        arrivals = make_requests(workload, self.max_model_len, self.config.max_num_batched_tokens)
        self.check_fits([request for _, request in arrivals])
        requests = [request for _, request in arrivals]
        next_index = 0
        first_arrival = arrivals[0][0] if arrivals else 0.0
        self.clock = first_arrival
        counts = dict(two=0, host_tokens=0, gpu_tokens=0, output=0)
        log: list[tuple[float, int]] = []
        cut_short = False
        in_flight = False  # the previous step was launched ahead: the GPU runs it while this one is planned
        previous = None  # the plan of the previous step
        progress = tqdm(total=sum(r.sampling_params.max_tokens for r in requests), unit="tok",
                        desc=f"simulate {self.config.policy}", disable=not show_progress)
        while next_index < len(arrivals) or scheduler.has_unfinished:
            if duration is not None and self.clock - first_arrival >= duration:
                cut_short = True
                break
            while next_index < len(arrivals) and arrivals[next_index][0] <= self.clock:
                scheduler.add(arrivals[next_index][1])
                next_index += 1
            next_arrival = arrivals[next_index][0] if next_index < len(arrivals) else math.inf
            if not scheduler.has_unfinished:
                self.clock = next_arrival
                continue
            ahead_possible = in_flight and scheduler.can_plan_ahead()
            plan = scheduler.schedule()
            runs_ahead = self.schedules_ahead and plan.runs_ahead()
            self.clock += self.sync_step_seconds(plan, hidden=ahead_possible and runs_ahead)
            in_flight = runs_ahead
            if plan.host_batch is not None:
                self.launch(plan)
                counts["host_tokens"] += len(plan.host_batch.host_decodes)
            output = self.execute(plan)
            decoded = []
            if runs_ahead and output is not None and self.config.tensor_parallel_size == 1:
                decoded, relaunched = self.relaunch_between_steps(plan, previous)
                counts["host_tokens"] += relaunched
            previous = plan
            completed = self.collect(output is not None, next_arrival)
            decoded += scheduler.update(plan, output, completed)
            if output is not None:
                counts["two"] += len(plan.sub_batches) == 2
                counts["host_tokens"] += sum(len(batch.host_decodes) for batch in plan.sub_batches)
                counts["gpu_tokens"] += sum(len(batch.gpu_decodes) for batch in plan.sub_batches)
            for request in decoded:
                if request.first_token_time is None:
                    request.first_token_time = self.clock
                if request.is_finished:
                    request.finish_time = self.clock
            counts["output"] += len(decoded)
            progress.update(len(decoded))
            log.append((self.clock - first_arrival, counts["output"]))
            if output is None and completed is None and plan.host_batch is None and self.in_flight is None:
                if math.isinf(next_arrival):
                    raise RuntimeError(f"the {self.config.policy} scheduler made no progress with "
                                       f"{scheduler.num_unfinished} requests unfinished")
                self.clock = max(self.clock, next_arrival)
        progress.close()
        return self._result(requests, counts, log, cut_short, first_arrival)

    def _result(self, requests: list[Request], counts: dict, log: list[tuple[float, int]], cut_short: bool,
                first_arrival: float) -> SimulationResult:
        layout = self.parts.layout
        block_gib = layout.block_bytes / (1 << 30)
        started = [r for r in requests if r.first_token_time is not None]
        finished = [r for r in requests if r.finish_time is not None]
        return SimulationResult(
            policy=self.config.policy, num_requests=len(requests), finished_requests=len(finished),
            elapsed_s=self.clock - first_arrival,
            prompt_tokens=sum(len(r.prompt_token_ids) for r in started), output_tokens=counts["output"],
            iterations=len(self.iteration_seconds), two_sub_batch_iterations=counts["two"],
            host_batches=len(self.host_batches), host_decode_tokens=counts["host_tokens"],
            gpu_decode_tokens=counts["gpu_tokens"], preemptions=self.parts.scheduler.num_preemptions,
            steady_output_tokens_per_s=steady_throughput(log, cut_short),
            head_and_tail_s=head_and_tail_seconds(log, cut_short), cut_short=cut_short,
            gpu_kv_pool_gib=layout.num_gpu_blocks * block_gib, cpu_kv_pool_gib=layout.num_host_blocks * block_gib,
            ttft_s=[r.first_token_time - r.arrival_time for r in started],
            tpot_s=[(r.finish_time - r.first_token_time) / (r.num_output_tokens - 1)
                    for r in finished if r.num_output_tokens > 1],
            iteration_s=list(self.iteration_seconds), host_batch_s=[batch.seconds for batch in self.host_batches],
            host_batch_sizes=[len(batch.requests) for batch in self.host_batches],
            note="" if self.parts.host_decodes else "no host attention on this hardware: planned as gpu-only")
