"""``Estimates``: the seconds of the sub-batches and iterations a scheduler weighs, from the
``PerfModel``'s stage times, the corrections measured while serving (``TimeCalibration``), the
runner's ``GraphCoverage`` and the cost function of the plan's ``StageOrder``. Whole-model
seconds."""

import math
from dataclasses import dataclass

from neo.request import KVLocation, Request

from .arrivals import ArrivingWork
from .block_manager import BlockManager
from .calibration import TimeCalibration
from .cost import StageTimes
from .graph_coverage import GraphCoverage, widest_gpu_table
from .perf_model import PerfModel
from .scheduler_output import SchedulerOutput, SubBatch
from .stage_order import HOST_BATCH, SEQUENTIAL, StageOrder, host_batch_sub_batches


def remaining_output(request: Request) -> int:
    """Tokens ``request`` may still generate: its ``max_tokens`` less those it has, at least 1
    (an end-of-sequence token may end it sooner; this is the bound)."""
    return max(1, request.sampling_params.max_tokens - request.num_output_tokens)


@dataclass
class GpuWork:
    """A sub-batch's GPU work apart from its host decodes: tokens through the linear stages and
    the seconds of its GPU (decode and prefill) attention."""

    linear_tokens: int
    attention_seconds: float


NO_GPU_WORK = GpuWork(0, 0.0)  # a sub-batch of host decodes alone


def is_gpu_decode_only(batch: SubBatch) -> bool:
    """Whether ``batch`` is GPU decodes alone: no prefill, no host decode."""
    return bool(batch.gpu_decodes) and not batch.prefills and not batch.host_decodes


@dataclass
class SteadyGpuBatch:
    """The GPU sub-batch of a steady decode iteration (``Estimates.steady_gpu_batch``): beside
    host decodes it runs its stages eagerly or in a pipeline graph; alone it replays a decode
    graph where the engine has one."""

    count: int  # GPU decodes
    stage_times: StageTimes  # beside host decodes (no host attention of its own)
    alone_time: float  # from the profile (uncorrected)
    pipeline_graphed: bool  # beside host decodes, a pipeline graph covers it


class Estimates:
    """Estimated seconds; ``two_sub_batch_order`` is the order the lockstep pipeline runs,
    ``host_batch_order`` the async host pipeline's batches'. ``host_calibration`` corrects host
    attention, ``host_batch_rest_calibration`` the rest of a host batch, ``gpu_decode_calibration``
    an iteration of GPU decodes alone (``TimeCalibration``s; None: prior 1, the rest's by sums,
    the decodes' ``TimeCalibration.for_gpu_decodes``)."""

    def __init__(self, perf_model: PerfModel, host_calibration: TimeCalibration, coverage: GraphCoverage,
                 block_manager: BlockManager, two_sub_batch_order: StageOrder,
                 host_batch_order: StageOrder = HOST_BATCH,
                 host_batch_rest_calibration: TimeCalibration | None = None,
                 gpu_decode_calibration: TimeCalibration | None = None):
        self.perf_model = perf_model
        self.host_calibration = host_calibration
        self.host_batch_rest_calibration = host_batch_rest_calibration or TimeCalibration()
        self.gpu_decode_calibration = gpu_decode_calibration or TimeCalibration.for_gpu_decodes()
        self.coverage = coverage
        self.block_manager = block_manager
        self.two_sub_batch_order = two_sub_batch_order
        self.host_batch_order = host_batch_order

    def host_attention(self, num_requests: int, context_tokens: int) -> float:
        """Host attention seconds of that many decodes: the profile's, corrected."""
        return self.perf_model.host_attention(num_requests, context_tokens) * self.host_calibration.scale

    def host_batch_time(self, requests: list[Request]) -> tuple[float, float]:
        """(seconds of a host batch of ``requests`` until its tokens, of which host attention):
        the cost function of the host-batch order over the sub-batches the runner splits the
        batch into (``host_batch_sub_batches``), its host attention and its rest (the seconds
        beside that) each corrected by its calibration."""
        order, parts = host_batch_sub_batches(self.host_batch_order, len(requests))
        sub_batches = [(len(requests[part]), sum(r.num_tokens for r in requests[part])) for part in parts]
        return self._corrected_host_batch(order, sub_batches)

    def _corrected_host_batch(self, order: StageOrder, sub_batches: list[tuple[int, int]]) -> tuple[float, float]:
        seconds, host = self.perf_model.host_batch_time(order, sub_batches, self.host_calibration.scale)
        return host + (seconds - host) * self.host_batch_rest_calibration.scale, host

    def host_batch_gpu_time(self, num_requests: int) -> float:
        """Seconds of the GPU stages of a host batch of that many decodes: each of its
        sub-batches' ``pre`` and ``post`` (decode GEMMs read every weight once per sub-batch),
        then the logits and sampling. A sub-batch within the rows of the batch's own graphs
        (``GraphCoverage.host_batch_graph``) replays them, so its GPU work costs what a decode
        graph of as many short requests does (the same GEMMs, logits and sampling; its attention
        is on the host); beyond them, or where the table has no such point, its stages are
        launched one by one (``linear``)."""
        _, parts = host_batch_sub_batches(self.host_batch_order, num_requests)
        model = self.perf_model

        def part_time(rows: int) -> float:
            graph = model.graph_decode(rows, 0) if self.coverage.host_batch_graph(rows) else None
            return model.linear(rows) if graph is None else graph

        return sum(part_time(part.stop - part.start) for part in parts)

    def host_batch_time_of(self, num_requests: int, context_tokens: int) -> float:
        """Seconds of a host batch of that many decodes over that many context tokens (each
        sub-batch its share of them)."""
        order, parts = host_batch_sub_batches(self.host_batch_order, num_requests)
        sub_batches = [(part.stop - part.start, context_tokens * (part.stop - part.start) // max(1, num_requests))
                       for part in parts]
        return self._corrected_host_batch(order, sub_batches)[0]

    def host_time(self, batch: SubBatch) -> float:
        return self.host_attention(len(batch.host_decodes), sum(r.num_tokens for r in batch.host_decodes))

    def gpu_work(self, batch: SubBatch) -> GpuWork:
        """The part of a sub-batch's GPU work that does not depend on its host decodes."""
        model = self.perf_model
        return GpuWork(batch.num_prefill_tokens + len(batch.gpu_decodes),
                       model.gpu_attention(sum(r.num_tokens for r in batch.gpu_decodes))
                       + model.prefill_attention([r.num_tokens for r in batch.prefills]))

    def sequential_time(self, batch: SubBatch, work: GpuWork | None = None, host: float | None = None) -> float:
        """One sub-batch in the sequential order, from the profile. ``work`` and ``host`` (its
        host attention seconds) when the caller has them already."""
        graph = self.graph_time(batch)
        if graph is not None:
            return graph
        work = self.gpu_work(batch) if work is None else work
        host = self.host_time(batch) if host is None else host
        times = StageTimes(self.perf_model.linear(work.linear_tokens + len(batch.host_decodes)),
                           work.attention_seconds, host)
        return self.perf_model.iteration_time(SEQUENTIAL, [times])

    def graph_time(self, batch: SubBatch) -> float | None:
        """Seconds of a sub-batch of GPU decodes alone that the runner replays from a decode
        graph; None for any other sub-batch."""
        if not self.coverage.replays_decode_graph([batch]):
            return None
        return self.perf_model.graph_decode(len(batch.gpu_decodes), sum(r.num_tokens for r in batch.gpu_decodes))

    def corrected_sequential_time(self, batch: SubBatch) -> float:
        """``sequential_time``, a sub-batch of GPU decodes alone corrected by
        ``gpu_decode_calibration``. The async host pipeline's placement estimates its
        iterations so, as it is the one that measures them; the lockstep placement weighs
        batch 0 alone against two-sub-batch plans whose GPU stages no measurement corrects, so
        it (and ``auto``'s comparison of the two) keeps the profile's times on both sides."""
        seconds = self.sequential_time(batch)
        return seconds * self.gpu_decode_calibration.scale if is_gpu_decode_only(batch) else seconds

    def replays_pipeline_graph(self, batch0: SubBatch) -> bool:
        """Whether a two-sub-batch plan with this batch 0 is one the runner replays from a
        pipeline graph (decode-only)."""
        return (not batch0.prefills
                and self.coverage.pipeline_graph(len(batch0.gpu_decodes), widest_gpu_table(batch0)))

    def sub_batch_times(self, work: GpuWork, host_decodes: int, host_seconds: float) -> StageTimes:
        """A sub-batch's stage times: ``work`` with that many host decodes taking ``host_seconds``."""
        return StageTimes(self.perf_model.linear(work.linear_tokens + host_decodes), work.attention_seconds,
                          host_seconds)

    def two_sub_batch_time(self, times: list[StageTimes], graphed: bool) -> float:
        """A two-sub-batch iteration of the lockstep pipeline's order (``graphed``: replayed from
        a pipeline graph)."""
        return self.perf_model.iteration_time(self.two_sub_batch_order, times, graphed=graphed)

    def plan_time(self, plan: SchedulerOutput) -> tuple[float, float]:
        """(estimated seconds of a plan's sub-batches, of which host attention)."""
        host = [self.host_time(batch) for batch in plan.sub_batches]
        if len(plan.sub_batches) == 2:
            batch0, batch1 = plan.sub_batches
            times = [self.sub_batch_times(self.gpu_work(batch0), len(batch0.host_decodes), host[0]),
                     self.sub_batch_times(NO_GPU_WORK, len(batch1.host_decodes), host[1])]
            seconds = self.two_sub_batch_time(times, self.replays_pipeline_graph(batch0))
        else:
            seconds = self.sequential_time(plan.sub_batches[0], host=host[0]) if plan.sub_batches else 0.0
        return seconds, sum(host)

    def gpu_drain_time(self, gpu_requests: list[Request], waiting: list[Request], gpu_rate: float,
                       max_num_batched_tokens: int, arriving: ArrivingWork) -> float:
        """Seconds the GPU alone needs to finish ``gpu_requests`` and to prefill and decode
        ``waiting`` while work keeps arriving at ``arriving``'s rates. The backlog takes ``B``
        seconds: the prompts in iterations of ``max_num_batched_tokens`` tokens, and every
        remaining output token (``remaining_output``) at ``gpu_rate`` tokens per second. The
        arriving work needs ``load`` GPU seconds per second at the same speeds, so each second
        spent draining brings ``load`` seconds more: ``B * (1 + load + load**2 + ...) =
        B / (1 - load)``. At ``load >= 1`` the arrivals keep the GPU saturated: it never drains."""
        if gpu_rate <= 0:
            return math.inf
        prefill_per_token = self.perf_model.linear(max_num_batched_tokens) / max_num_batched_tokens
        prompt_tokens = sum(r.num_tokens for r in waiting)
        output_tokens = sum(map(remaining_output, gpu_requests)) + sum(map(remaining_output, waiting))
        backlog = prefill_per_token * prompt_tokens + output_tokens / gpu_rate
        load = prefill_per_token * arriving.prompt_tokens_per_s + arriving.output_tokens_per_s / gpu_rate
        return backlog / (1 - load) if load < 1 else math.inf

    def steady_gpu_batch(self, gpu_requests: list[Request], host_requests: list[Request],
                         waiting_head: Request | None) -> SteadyGpuBatch:
        """The GPU sub-batch of a steady decode iteration: the GPU pool full of requests of the
        running requests' mean length (or the waiting head's), no prefills (an admitted request
        decodes for many iterations, most of them without prefills)."""
        model = self.perf_model
        manager = self.block_manager
        running = gpu_requests + host_requests
        lengths = [r.num_tokens for r in running] or ([waiting_head.num_tokens] if waiting_head else [1])
        mean_length = sum(lengths) / len(lengths)
        pool_tokens = manager.num_total(KVLocation.GPU) * manager.block_size
        count = max(len(gpu_requests), int(pool_tokens // mean_length))
        context = max(sum(r.num_tokens for r in gpu_requests), int(count * mean_length))
        times = StageTimes(model.linear(count), model.gpu_attention(context), 0.0) if count else StageTimes(0.0, 0.0, 0.0)
        widest = math.ceil(mean_length / manager.block_size)
        # Alone, that batch replays a decode graph where the engine has one for it.
        graph_time = model.graph_decode(count, context) if self.coverage.decode_graph(count, widest) else None
        alone_time = times.linear + times.gpu_attention + model.iteration_overhead if graph_time is None else graph_time
        return SteadyGpuBatch(count, times, alone_time, self.coverage.pipeline_graph(count, widest))
