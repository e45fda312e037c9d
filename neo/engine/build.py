"""The composition root: builds every part of an engine for its policy and host pipeline, and
wires them (model, tokenizer, KV pools, block manager, host side, runner with its graphs, perf
model, placement, scheduler). Nothing else constructs these parts for serving."""

import logging
from dataclasses import dataclass

import torch

from neo.config import EngineConfig
from neo.kv.budget import gpu_kv_cache_bytes
from neo.kv.kv_cache import GIB, CacheLayout, KVCache, smallest_over_ranks
from neo.models.config import parse_dtype
from neo.models.loader import load_model, resolve_model_config
from neo.models.parallel import TensorParallel, check_divisible
from neo.ops import OP_NAMES, implementations, select_implementation
from neo.runner.decode_graphs import DecodeGraphs
from neo.runner.executor import PipelineExecutor
from neo.runner.gemm_rows import warm_up as warm_up_gemm_rows
from neo.runner.host_attention import HostKernels
from neo.runner.host_batches import HostBatchRunner
from neo.runner.host_cores import rank_cores
from neo.runner.host_worker import HostAttentionWorker, default_cpu_attention_threads
from neo.runner.model_runner import ModelRunner
from neo.runner.pipeline_graphs import PipelineGraphs
from neo.runner.rank_plan import PlanChannel
from neo.runner.profiler import Profiler, ProfileLimits, load_perf_model
from neo.sched.block_manager import BlockManager
from neo.sched.calibration import HOST_TIME_PRIOR, TimeCalibration
from neo.sched.estimates import Estimates
from neo.sched.perf_model import PerfModel
from neo.sched.placement import make_placement
from neo.sched.scheduler import Scheduler
from neo.sched.stage_order import SEQUENTIAL, host_batch_order, two_sub_batch_order
from neo.tokenizer import load_tokenizer

from .host_memory_check import available_host_bytes, check_host_memory
from .startup_phases import StartupPhases
from .stop import StopRule

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    model: torch.nn.Module
    tokenizer: object
    dtype: torch.dtype
    max_model_len: int
    layout: CacheLayout
    kv_cache: KVCache
    block_manager: BlockManager
    worker: HostAttentionWorker | None
    runner: ModelRunner
    profiler: Profiler | None  # measures stage times through the runner (offloading policies)
    scheduler: Scheduler
    asynchronous: bool  # the async or auto host pipeline: host batches beside the GPU's iterations
    startup: StartupPhases  # where the construction spent its time (its clock still running)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name == "auto":
        return checkpoint_dtype if device.type == "cuda" else torch.float32
    return parse_dtype(name)


def host_kernels(name: str) -> HostKernels:
    """The CPU kernels of the host side: ``name``'s decode attention (``EngineConfig.cpu_attention_kernel``;
    a ``ValueError`` lists the available ones) and the KV store of the same name where it has
    one, else the one ``torch.ops.neo`` runs."""
    attention = select_implementation("paged_decode_attention", "cpu", name)
    try:
        store = select_implementation("store_kv_cache", "cpu", attention.name)
    except ValueError:
        store = select_implementation("store_kv_cache", "cpu")
    return HostKernels(store=store, attention=attention)


def ops_without_native_kernel(device: str) -> list[str]:
    """The ops ``torch.ops.neo`` runs on ``device`` with a Python implementation."""
    return [op for op in OP_NAMES if not select_implementation(op, device).native]


def missing_kernel_note(op: str, device: str) -> str:
    """Why ``op`` has no compiled kernel on ``device``, as the registry says."""
    notes = [impl.note for impl in implementations(op, device, available_only=False)
             if impl.native and not impl.available and impl.note]
    return notes[0] if notes else f"no compiled kernel of neo.{op} for {device}"


def rank_device(config: EngineConfig, parallel: TensorParallel) -> torch.device:
    """The compute device of one rank: ``cuda:r`` for rank r of several on GPUs, else the
    configured device."""
    device = config.compute_device
    return torch.device("cuda", parallel.rank) if device.type == "cuda" and parallel.size > 1 else device


def host_attention_worker(config: EngineConfig, parallel: TensorParallel) -> HostAttentionWorker:
    """The host-attention thread of one rank. On one rank it uses ``cpu_attention_threads`` (all
    cores but one unless set); on several, each rank has its share of the host's cores
    (``rank_cores``: within one NUMA node, and pinned there, where the host has several) and
    uses ``cpu_attention_threads`` or all of its share but one (at least one)."""
    if parallel.size == 1:
        return HostAttentionWorker(config.cpu_attention_threads or default_cpu_attention_threads())
    cores, pin = rank_cores(parallel.rank, parallel.size)
    return HostAttentionWorker(config.cpu_attention_threads or max(1, len(cores) - 1), cores if pin else None)


def resolve_max_model_len(config: EngineConfig, model_config) -> int:
    """``max_model_len``, or the model's context where unset, at most the model's context."""
    return min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)


def check_host_allocations(config: EngineConfig) -> None:
    """Refuse (``ValueError``) an engine whose host allocations, over all its
    ``tensor_parallel_size`` ranks on this host, exceed the memory available now
    (``neo.engine.host_memory_check``)."""
    model_config = resolve_model_config(config.model)
    device = config.compute_device
    dtype = resolve_dtype(config.dtype, model_config.dtype, device)
    max_model_len = resolve_max_model_len(config, model_config)
    compute_pool_bytes = gpu_kv_cache_bytes(config, None, device, max_model_len) if device.type == "cpu" else 0
    check_host_memory(config.model, model_config, dtype, device, compute_pool_bytes,
                      int(config.cpu_kv_cache_gib * GIB), available_host_bytes(), config.tensor_parallel_size)


def build(config: EngineConfig, parallel: TensorParallel | None = None,
          plan_channel: PlanChannel | None = None, startup: StartupPhases | None = None) -> EngineParts:
    """The parts of one engine, or of one rank of a tensor-parallel engine: ``parallel`` is the
    rank's group (None: one rank), ``plan_channel`` the driver's channel to the other ranks
    (``neo.engine.rank_workers``; None on the other ranks, which only run their runner).
    ``startup``: the phases' clock to time the construction on (None: a new one)."""
    parallel = parallel or TensorParallel()
    device = rank_device(config, parallel)
    startup = startup or StartupPhases(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    offloading = config.policy != "gpu-only"
    stage_order = two_sub_batch_order(config.stage_order)
    batch_order = host_batch_order(config.host_batch_order)
    placement = make_placement(config.policy, config.host_pipeline, config.placement)
    kernels = host_kernels(config.cpu_attention_kernel)
    model_config = resolve_model_config(config.model)
    check_divisible(model_config, parallel.size)
    dtype = resolve_dtype(config.dtype, model_config.dtype, device)
    max_model_len = resolve_max_model_len(config, model_config)
    if parallel.size == 1:  # several ranks: checked for all of them before they start (RankWorkers)
        check_host_allocations(config)
    with startup.phase("load model"):
        model = load_model(config.model, dtype=dtype, device=device, load_format=config.load_format,
                           seed=config.seed, max_positions=max_model_len, parallel=parallel)
    with startup.phase("tokenizer"):
        tokenizer = load_tokenizer(config.model)
    eos_token_ids = frozenset(tokenizer.eos_token_ids if tokenizer and tokenizer.eos_token_ids
                              else model.config.eos_token_ids)

    with startup.phase("KV budget"):  # on a GPU: a forward of the largest batch measures the activations
        layout = CacheLayout.for_budgets(model.rank_config, dtype, config.block_size,
                                         gpu_bytes=gpu_kv_cache_bytes(config, model, device, max_model_len),
                                         host_bytes=int(config.cpu_kv_cache_gib * GIB))
    layout = smallest_over_ranks(layout, parallel)  # one block manager addresses every rank's pools
    if layout.num_gpu_blocks == 0 and config.policy != "full-offload":
        raise ValueError(f"the GPU KV pool holds no block of {layout.block_bytes} bytes: "
                         f"raise gpu_kv_cache_gib or gpu_memory_utilization")
    if layout.num_host_blocks == 0 and offloading:
        raise ValueError(f"policy {config.policy!r} decodes on the host, but the host KV pool of "
                         f"cpu_kv_cache_gib={config.cpu_kv_cache_gib} holds no block of "
                         f"{layout.block_bytes} bytes: raise cpu_kv_cache_gib")
    with startup.phase("KV pools"):
        kv_cache = KVCache(layout, device)
    if device.type == "cuda" and layout.num_host_blocks:  # page-locking takes time in proportion to the pool
        startup.note("KV pools", f"{layout.num_host_blocks * layout.block_bytes / GIB:.1f} GiB host pool page-locked")
    block_manager = BlockManager(layout.num_gpu_blocks, layout.num_host_blocks, config.block_size)

    max_blocks_per_sequence = -(-max_model_len // config.block_size)
    pad_rows = config.pad_gemm_rows if config.pad_gemm_rows is not None else device.type == "cuda"
    with startup.phase("host pipeline"):
        worker = host_attention_worker(config, parallel) if offloading else None
        executor = PipelineExecutor(model, kv_cache, device, kernels if offloading else None, worker,
                                    max_host_decodes=config.max_num_seqs,
                                    max_blocks_per_sequence=max_blocks_per_sequence,
                                    measure_gpu_busy=config.trace_path is not None, pad_rows=pad_rows)
    # "auto" runs both kinds of iteration in one engine: host batches, and lockstep iterations
    # (with their pipeline graphs) while no host batch is in flight.
    asynchronous = offloading and config.host_pipeline in ("async", "auto")
    lockstep = not offloading or config.host_pipeline in ("lockstep", "auto")
    graph_context = None
    if device.type == "cuda" and config.use_cuda_graphs:
        graph_context = min(max_model_len, config.cuda_graph_max_context)
        python_ops = ops_without_native_kernel("cuda")
        if python_ops:
            logger.warning("CUDA graphs are off: torch.ops.neo runs %s on the GPU with Python implementations "
                           "(%s), which read metadata on the host, and a graph capture forbids that; "
                           "iterations run eagerly", ", ".join(python_ops), missing_kernel_note(python_ops[0], "cuda"))
            graph_context = None
    if pad_rows and device.type == "cuda":  # before the graphs: batch sizes that are buckets capture prepared GEMMs
        with startup.phase("GEMM warm-up"):
            shapes = warm_up_gemm_rows(model, config.max_num_batched_tokens, config.max_num_seqs)
        startup.note("GEMM warm-up", f"{shapes} shapes")
    decode_graphs = pipeline_graphs = host_batches = None
    if graph_context is not None:
        with startup.phase("decode CUDA graphs"):
            decode_graphs = DecodeGraphs(model, kv_cache, config.max_num_seqs, graph_context, device)
        startup.note("decode CUDA graphs", f"{len(decode_graphs.sizes)} batch sizes")
        if executor.stream_ordered_host_work and lockstep:
            with startup.phase("host pipeline"):
                pipeline_graphs = PipelineGraphs(model, executor, config.max_num_seqs, graph_context,
                                                 config.block_size, device)
    if asynchronous:
        with startup.phase("host pipeline"):
            host_batches = HostBatchRunner(model, kv_cache, kernels, worker, device, config.max_num_seqs,
                                           max_blocks_per_sequence, graph_context, pad_rows, order=batch_order)
        if host_batches.graphs is not None:
            with startup.phase("host batch CUDA graphs"):
                captured = host_batches.capture_graphs()
            startup.note("host batch CUDA graphs", f"{captured} shapes")
    runner = ModelRunner(model, kv_cache, executor, device, {1: SEQUENTIAL, 2: stage_order}, decode_graphs,
                         pipeline_graphs, host_batches, plan_channel, max_sampled_rows=config.max_num_seqs,
                         share_samples=parallel.size > 1 and config.schedules_ahead)

    perf_model, profiler = PerfModel.zero(), None
    if offloading:  # the profiler, when it runs, measures through the runner built above
        profiler = Profiler(runner, block_manager,
                            ProfileLimits(config.max_num_batched_tokens, config.max_num_seqs, max_model_len),
                            worker.num_threads, kernels.attention.name, stage_order, host_batch_order=batch_order,
                            schedules_ahead=config.schedules_ahead)
        if parallel.rank == 0:  # the scheduler's; the other ranks profile when the driver does
            with startup.phase("perf model"):
                perf_model = load_perf_model(config.perf_model, profiler)
    estimates = Estimates(perf_model, TimeCalibration(prior=HOST_TIME_PRIOR), runner.graph_coverage, block_manager,
                          stage_order, batch_order)
    scheduler = Scheduler(config, block_manager, placement, estimates,
                          finish_reason=StopRule(eos_token_ids, tokenizer, max_model_len))
    logger.info("neo engine: %s on %s (%s), policy %s, GPU pool %d blocks (%.2f GiB), host pool %d blocks "
                "(%.2f GiB)", model.config.name or config.model, device, dtype, config.policy,
                layout.num_gpu_blocks, layout.num_gpu_blocks * layout.block_bytes / GIB, layout.num_host_blocks,
                layout.num_host_blocks * layout.block_bytes / GIB)
    return EngineParts(model, tokenizer, dtype, max_model_len, layout, kv_cache, block_manager, worker, runner,
                       profiler, scheduler, asynchronous, startup)
