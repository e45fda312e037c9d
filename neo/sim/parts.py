"""The scheduling side of an engine on a simulated machine: the KV pools sized as
``neo.engine.build`` sizes them (from the hardware's memory instead of a device), and the real
``Scheduler`` with its block manager, placement, estimates and the graph coverage a CUDA engine
of the same limits has. Nothing here decides anything the scheduler decides."""

from dataclasses import dataclass

import torch

from neo.config import EngineConfig
from neo.kv.budget import device_pool_bytes
from neo.kv.kv_cache import GIB, CacheLayout
from neo.models.config import ModelConfig
from neo.runner.decode_graphs import graph_block_width
from neo.sched.block_manager import BlockManager
from neo.sched.calibration import HOST_TIME_PRIOR, TimeCalibration
from neo.sched.estimates import Estimates
from neo.sched.graph_coverage import GraphCoverage
from neo.sched.perf_model import PerfModel, PerfTable
from neo.sched.placement import GpuOnly, make_placement
from neo.sched.scheduler import Scheduler
from neo.sched.stage_order import host_batch_order, two_sub_batch_order

from .hardware import Hardware

# Device memory the CUDA context and the framework keep outside torch's free memory (fitted so
# that Llama-3.1-8B with the whole H100 gets the KV pool the engine measured there, RESULTS.md).
CUDA_CONTEXT_GIB = 0.9
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_bytes(model: ModelConfig, element_bytes: int) -> int:
    """Bytes of the model's weights: layers, embedding, LM head (unless tied), norms."""
    hidden, q_size, kv_size = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * model.intermediate_size + 2 * hidden
    embeddings = model.vocab_size * hidden * (1 if model.tie_word_embeddings else 2)
    return (model.num_layers * layer + embeddings + hidden) * element_bytes


def activation_peak_bytes(model: ModelConfig, config: EngineConfig, element_bytes: int) -> int:
    """An estimate of the activation peak of a prefill of ``max_num_batched_tokens`` tokens
    (``neo.kv.budget`` measures it on a device): the MLP's gate/up output and activation, a few
    hidden-sized buffers, and the float32 logits of ``max_num_seqs`` rows."""
    tokens = config.max_num_batched_tokens
    per_token = 3 * model.intermediate_size + 4 * model.hidden_size
    return tokens * per_token * element_bytes + min(tokens, config.max_num_seqs) * model.vocab_size * 4


def cache_layout(config: EngineConfig, model: ModelConfig, hardware: Hardware) -> CacheLayout:
    """Both KV pools of one rank (``model`` is a rank's shapes): ``gpu_kv_cache_gib`` when set,
    else what ``gpu_memory_utilization`` of the device leaves after the CUDA context, the
    weights and the activation peak; the host pool is ``cpu_kv_cache_gib``. Raises
    ``ValueError`` when the weights do not fit, or the ranks' pools do not fit the machine's
    memory."""
    dtype = DTYPES[hardware.dtype]
    element_bytes = dtype.itemsize
    total = hardware.gpu_memory_gib * GIB
    weights = weight_bytes(model, element_bytes)
    free = total - CUDA_CONTEXT_GIB * GIB - weights
    if free <= 0:
        raise ValueError(f"the weights of {model.name or 'the model'} ({weights / GIB:.1f} GiB in {hardware.dtype}) do "
                         f"not fit gpu_memory_gib={hardware.gpu_memory_gib} of hardware {hardware.name!r}")
    activations = activation_peak_bytes(model, config, element_bytes)
    try:
        gpu_bytes = device_pool_bytes(config, free, total, activations)
    except ValueError as error:
        raise ValueError(f"{error} (hardware {hardware.name!r})") from None
    ranks = config.tensor_parallel_size
    if config.policy != "gpu-only" and config.cpu_kv_cache_gib * ranks > hardware.host_memory_gib:
        pools = (f"{ranks} ranks' host pools of cpu_kv_cache_gib={config.cpu_kv_cache_gib} exceed" if ranks > 1
                 else f"cpu_kv_cache_gib={config.cpu_kv_cache_gib} exceeds")
        raise ValueError(f"{pools} host_memory_gib={hardware.host_memory_gib} of hardware {hardware.name!r}")
    return CacheLayout.for_budgets(model, dtype, config.block_size, gpu_bytes=gpu_bytes,
                                   host_bytes=int(config.cpu_kv_cache_gib * GIB))


@dataclass
class SchedulingParts:
    scheduler: Scheduler
    block_manager: BlockManager
    layout: CacheLayout
    timing: Estimates  # the simulated machine's true times: the table, uncorrected
    perf_model: PerfModel  # the table the times come from
    host_decodes: bool  # False where the policy decodes on the host but the table has no host attention


def graph_coverage(config: EngineConfig, max_model_len: int) -> GraphCoverage:
    """The graphs a CUDA engine of these settings captures (``neo.engine.build``): decode
    graphs up to ``max_num_seqs`` requests, pipeline graphs for the lockstep and auto host
    pipelines of the offloading policies and host-batch graphs for their async and auto ones,
    all for ``cuda_graph_max_context`` tokens."""
    if not config.use_cuda_graphs:
        return GraphCoverage()
    context = min(max_model_len, config.cuda_graph_max_context)
    offloading = config.policy != "gpu-only"
    pipeline = config.max_num_seqs if offloading and config.host_pipeline != "async" else 0
    host_batch = config.max_num_seqs if offloading and config.host_pipeline != "lockstep" else 0
    return GraphCoverage(config.max_num_seqs, pipeline, graph_block_width(context, config.block_size), host_batch)


def build_parts(config: EngineConfig, model: ModelConfig, hardware: Hardware, table: PerfTable,
                max_model_len: int, planning_table: PerfTable | None = None) -> SchedulingParts:
    """The scheduler of ``config.policy`` as the engine wires it: gpu-only plans without a perf
    model, the offloading policies with ``planning_table`` (default ``table``) and a host-time
    calibration that learns from the simulated measurements; the simulated time follows
    ``table``. A policy that decodes on the host on a table without host attention (a host with
    no attention thread or no read bandwidth) gets gpu-only's placement: no host decode can run
    there."""
    layout = cache_layout(config, model, hardware)
    if layout.num_gpu_blocks == 0 and config.policy != "full-offload":
        raise ValueError(f"the GPU KV pool holds no block of {layout.block_bytes} bytes: raise gpu_kv_cache_gib")
    if layout.num_host_blocks == 0 and config.policy != "gpu-only":
        raise ValueError(f"policy {config.policy!r} decodes on the host, but the host KV pool of "
                         f"cpu_kv_cache_gib={config.cpu_kv_cache_gib} holds no block of {layout.block_bytes} bytes")
    manager = BlockManager(layout.num_gpu_blocks, layout.num_host_blocks, config.block_size)
    coverage = graph_coverage(config, max_model_len)
    order = two_sub_batch_order(config.stage_order)
    batch_order = host_batch_order(config.host_batch_order)
    perf_model = PerfModel(table)
    host_decodes = config.policy == "gpu-only" or bool(table.host_attention_requests)
    if config.policy == "gpu-only" or not host_decodes:
        placement, planning_model = GpuOnly(), PerfModel.zero()
    else:
        placement = make_placement(config.policy, config.host_pipeline, config.placement)
        planning_model = perf_model if planning_table is None else PerfModel(planning_table)
    estimates = Estimates(planning_model, TimeCalibration(prior=HOST_TIME_PRIOR), coverage, manager, order, batch_order)
    scheduler = Scheduler(config, manager, placement, estimates)
    timing = Estimates(perf_model, TimeCalibration(), coverage, manager, order, batch_order)
    return SchedulingParts(scheduler, manager, layout, timing, perf_model, host_decodes)
