"""Schedulers without a model: how the tests build one, and a stand-in for the runner.

``make_scheduler`` wires a ``Scheduler`` as ``neo.engine.build`` does, from a synthetic perf
model and a ``GraphCoverage`` like a CUDA engine's (or none). ``execute`` plays the runner: one
token (5) per planned request, handed back through ``Scheduler.update`` with the measured
times the test chooses.
"""

import random

from neo.config import EngineConfig
from neo.request import Request
from neo.sampling_params import SamplingParams
from neo.sched.block_manager import BlockManager
from neo.sched.calibration import TimeCalibration
from neo.sched.estimates import Estimates
from neo.sched.graph_coverage import GraphCoverage
from neo.sched.perf_model import PerfModel, PerfTable
from neo.sched.placement import make_placement
from neo.sched.runner_output import HostBatchOutput, IterationOutput
from neo.sched.scheduler import Scheduler
from neo.sched.scheduler_output import SchedulerOutput
from neo.sched.stage_order import two_sub_batch_order
from neo.sim.parts import graph_coverage

TOKEN = 5


def synthetic_model(linear_per_token: float, gpu_per_token: float, host_per_token: float) -> PerfModel:
    """Straight-line stage times (seconds), with a fixed cost so small batches are not free."""
    tokens = [1, 64, 4096, 65536, 1 << 20]
    return PerfModel(PerfTable(
        linear_tokens=tokens, linear_seconds=[1e-3 + linear_per_token * t for t in tokens],
        gpu_attention_tokens=tokens, gpu_attention_seconds=[gpu_per_token * t for t in tokens],
        prefill_lengths=tokens, prefill_seconds=[gpu_per_token * t * t / 64 for t in tokens],
        host_attention_requests=[1, 512], host_attention_tokens=[tokens, tokens],
        host_attention_seconds=[[host_per_token * t for t in tokens] for _ in range(2)],
    ))


def make_scheduler(policy: str, gpu_blocks: int, host_blocks: int, perf_model: PerfModel | None = None, *,
                   host_pipeline: str = "lockstep", placement: str | None = None, stage_order: str = "asymmetric",
                   max_num_seqs: int = 64, block_size: int = 16, max_num_batched_tokens: int = 2048,
                   host_prior: float = 1.0, graphs: bool = True, cuda_graph_max_context: int = 8192,
                   return_order: str = "oldest") -> Scheduler:
    """By default the profile is taken as exact (calibration prior 1, nothing observed), and
    the runner has the CUDA graphs a CUDA engine of these limits captures (``graphs``)."""
    config = EngineConfig(policy=policy, block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, host_pipeline=host_pipeline,
                          cuda_graph_max_context=cuda_graph_max_context, return_order=return_order)
    manager = BlockManager(gpu_blocks, host_blocks, block_size)
    # The graphs a CUDA engine of these limits captures, as the simulator takes them.
    coverage = graph_coverage(config, cuda_graph_max_context) if graphs else GraphCoverage()
    estimates = Estimates(perf_model or PerfModel.zero(), TimeCalibration(prior=host_prior), coverage, manager,
                          two_sub_batch_order(stage_order))
    return Scheduler(config, manager, make_placement(policy, host_pipeline, placement), estimates)


def execute(scheduler: Scheduler, plan: SchedulerOutput, seconds: float = 0.01, host_seconds: float = 0.0,
            host_batch: list[Request] | None = None, host_batch_seconds: float | None = 0.001,
            host_batch_elapsed: float = 0.0) -> list[Request]:
    """The runner's stand-in: a token for each of the plan's requests (and of ``host_batch``'s,
    a host batch completing now with ``host_batch_seconds`` of host time in
    ``host_batch_elapsed`` seconds; None and 0: not measured) through ``update``."""
    output = IterationOutput([TOKEN] * len(plan.requests), seconds, host_seconds) if plan.sub_batches else None
    completed = None
    if host_batch is not None:
        completed = HostBatchOutput(host_batch, [TOKEN] * len(host_batch), host_batch_elapsed,
                                    host_batch_seconds or 0.0, False, 0.0)
    return scheduler.update(plan, output, completed)


def requests_of(count: int, prompt_len: int, max_tokens: int) -> list[Request]:
    return [Request(str(i), [1] * prompt_len, SamplingParams(max_tokens=max_tokens)) for i in range(count)]


def random_scheduler(seed: int, policy: str, gpu_blocks: int, host_blocks: int, host_speed: float,
                     host_pipeline: str) -> tuple[object, list[Request], "random.Random"]:
    """A scheduler (a synthetic or, for one seed in three, a zero perf model) and 1-20 random
    requests (prompts of at most half the largest pool, outputs of 1-50 tokens), from ``seed``."""
    rng = random.Random(seed)
    if policy == "full-offload":
        gpu_blocks = 0
    model = synthetic_model(1e-5, 1e-8, host_speed) if seed % 3 else PerfModel.zero()
    scheduler = make_scheduler(policy, gpu_blocks, host_blocks, model, host_pipeline=host_pipeline,
                               max_num_seqs=rng.randint(1, 16), block_size=8)
    capacity_tokens = max(gpu_blocks, host_blocks) * 8
    requests = [Request(str(i), [2] * rng.randint(1, min(60, capacity_tokens // 2)),
                        SamplingParams(max_tokens=rng.randint(1, 50))) for i in range(rng.randint(1, 20))]
    return scheduler, requests, rng
