"""``EngineConfig``: every engine setting, validated on creation."""

import math
import os
import typing
from dataclasses import dataclass, fields

import torch

POLICIES = ("gpu-only", "neo", "full-offload")
HOST_PIPELINES = ("async", "lockstep", "auto")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
RETURN_ORDERS = ("oldest", "most-remaining")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Sizes derived from them (block counts) live in ``CacheLayout``.

    model: "neo-tiny", a shipped config name (with ``load_format="dummy"``) or a Hugging Face
        model directory.
    device: compute device; None picks CUDA when available, else the CPU.
    tensor_parallel_size: ranks that split the model Megatron-style (``neo.models.parallel``),
        one process each, on as many devices (``cuda:0`` .. ``cuda:N-1``, or N CPU processes);
        it must divide the model's heads, KV heads, intermediate size and vocabulary, which is
        checked when the engine is built.
    dtype: "auto" (the checkpoint's dtype on CUDA, float32 on the CPU) or a dtype name.
    policy: "gpu-only" (all KV on the compute device, preemption by swapping), "neo" (overflow
        requests decode on the host CPU, asymmetric pipeline, load-aware choice per iteration) or
        "full-offload" (every decode's KV and attention on the host CPU).
    gpu_kv_cache_gib: size of the compute-device KV pool; None fills ``gpu_memory_utilization``
        of the free device memory (on a CPU device: 1 GiB).
    cpu_kv_cache_gib: size of the host KV pool (pinned when CUDA is used).
    cpu_attention_threads: threads for host decode attention; None = all cores but one.
    perf_model: stage-time table for the load-aware scheduler: "auto" (this machine's profile
        from the cache, profiled on first use), "zero" (predicts zero: tests), or a JSON path.
    trace_path: write a per-iteration trace (predicted vs measured time, busy times) here.
    torch_profiler_dir: where ``LLM.start_profile()`` / ``stop_profile()`` write each rank's
        ``torch.profiler`` timeline (``neo.engine.torch_profiler``); None: profiling is off.
    use_cuda_graphs: replay captured CUDA graphs for decode-only iterations whose contexts are
        at most ``cuda_graph_max_context`` tokens. Above one rank every rank captures the same
        graphs, with the model's collectives inside them: the decode graphs at start-up, the
        pipeline and host-batch graphs on a shape's first plan. There a capture that fails
        stops the engine with an error naming this option (one rank replaying while another ran
        the plan eagerly would mix captured and eager collectives); on one rank those
        iterations run eagerly instead.
    host_pipeline: how host decodes (policies neo and full-offload) run beside the GPU's work:
        "async" (host decodes run as their own batch on a stream of their own, which spans as
        many GPU iterations as its host attention takes) or "lockstep" (each iteration's two
        sub-batches, the host decodes among them, go through the layers together) or "auto"
        (each iteration the scheduler estimates the gpu-only, lockstep and async plans with its
        cost function and runs the one with the most tokens per second; no lockstep iteration
        runs while a host batch is in flight: ``neo.sched.placement.pipeline_choice``).
    pad_gemm_rows: pad each iteration's GEMM rows to a fixed set of buckets, each run once at
        start-up (``neo.runner.gemm_rows``: cuBLAS makes a GEMM shape it meets for the first time
        wait for every pending CUDA host function); None: on CUDA.
    cpu_attention_kernel: the CPU implementation of ``paged_decode_attention`` the host side
        runs: "auto" (what ``torch.ops.neo`` runs on the CPU: ISPC when built, else numba) or
        any available one by name (``python -m neo.ops`` lists them; ``neo.ops.register_kernel``
        adds one). A compiled kernel runs in CUDA host functions on the copy stream; one written
        in Python runs on a worker thread.
    stage_order: the order of the lockstep pipeline's two sub-batches through the layers
        (``neo.sched.stage_order``: "asymmetric" or "asymmetric-early-host").
    host_batch_order: the order of the async host pipeline's batches through the layers:
        "host-batch" (one sub-batch; the host waits for the batch's GPU stages between layers)
        or "host-batch-pair" (two halves, asymmetric: the host attends for one half while the
        GPU runs the other's stages, at the price of reading the weights once per half).
    placement: where host decodes go (``neo.sched.placement``); None: the host pipeline's
        ("two-sub-batches" for lockstep, "host-batches" for async, "pipeline-choice" for auto).
    return_order: under the offloading policies, which requests of the host pool move back to the
        GPU pool first when it has room: "most-remaining" (the most tokens left before
        ``max_tokens`` first; the default) or "oldest" (first come, first served). A host
        request makes a token per host batch, a GPU request one per iteration, so the requests
        decoding on the host fall behind, and in a batch of requests that started together the
        last ones finish alone on a GPU that is all but idle; giving the GPU's room to those
        with the most left shortens that tail, while those near their end finish on the host.
    async_scheduling: plan and launch each iteration before the previous one's sampled tokens
        reach the host: its input ids are taken on the device from the previous iteration's
        samples, and the previous tokens are read, checked against the stop conditions and
        returned while the device runs the new iteration (``LLMEngine``). A request that stops
        has one more token computed, which is dropped. Under the offloading policies the
        GPU's iterations are planned ahead, and host batches launched and collected beside them;
        an iteration that itself decodes on the host (the lockstep pipeline) or prefills into
        the host pool runs after the previous tokens are read. Above one rank the driver's
        samples reach the other ranks on the device, one broadcast an iteration. None (the
        default): on for CUDA devices; off on the CPU (nothing runs beside the host's work
        there, so it gains nothing).

    Names that depend on registries or the machine (kernels, stage orders, placements) are
    checked when the engine is built, with errors that list the choices.
    """

    model: str = "neo-tiny"
    device: str | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    policy: str = "gpu-only"
    load_format: str = "auto"
    block_size: int = 16
    gpu_kv_cache_gib: float | None = None
    cpu_kv_cache_gib: float = 4.0
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    cpu_attention_threads: int | None = None
    use_cuda_graphs: bool = True
    cuda_graph_max_context: int = 8192
    host_pipeline: str = "async"
    pad_gemm_rows: bool | None = None
    cpu_attention_kernel: str = "auto"
    stage_order: str = "asymmetric"
    host_batch_order: str = "host-batch"
    placement: str | None = None
    return_order: str = "most-remaining"
    perf_model: str = "auto"
    trace_path: str | None = None
    torch_profiler_dir: str | None = None
    async_scheduling: bool | None = None
    seed: int = 0

    def __post_init__(self):
        self._check_types()
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.host_pipeline not in HOST_PIPELINES:
            raise ValueError(f"unknown host_pipeline {self.host_pipeline!r}; choose one of "
                             f"{', '.join(HOST_PIPELINES)}")
        if self.return_order not in RETURN_ORDERS:
            raise ValueError(f"unknown return_order {self.return_order!r}; choose one of "
                             f"{', '.join(RETURN_ORDERS)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose one of "
                             f"{', '.join(LOAD_FORMATS)}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two from 8 to 128, got "
                             f"{self.block_size}")
        if self.gpu_kv_cache_gib is not None and self.gpu_kv_cache_gib <= 0:
            raise ValueError(f"gpu_kv_cache_gib must be positive, got {self.gpu_kv_cache_gib}")
        if self.cpu_kv_cache_gib < 0:
            raise ValueError(f"cpu_kv_cache_gib must be >= 0, got {self.cpu_kv_cache_gib}")
        if self.policy != "gpu-only" and self.cpu_kv_cache_gib == 0:
            raise ValueError(f"policy {self.policy!r} keeps KV on the host: cpu_kv_cache_gib "
                             f"must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.cuda_graph_max_context < 1:
            raise ValueError(f"cuda_graph_max_context must be >= 1, got {self.cuda_graph_max_context}")
        if self.cpu_attention_threads is not None:
            cores = os.cpu_count() or 1
            if not 1 <= self.cpu_attention_threads <= cores:
                raise ValueError(f"cpu_attention_threads must be from 1 to this machine's {cores} "
                                 f"logical cores, got {self.cpu_attention_threads}")
        if self.device is not None:
            device = torch.device(self.device)
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError("device 'cuda' was requested but CUDA is not available")

    def _check_types(self) -> None:
        """Each setting has its declared type (a bool is not an integer; an integer is a
        float), and every float is finite."""
        for setting in fields(self):
            value = getattr(self, setting.name)
            allowed = typing.get_args(setting.type) or (setting.type,)
            if float in allowed:
                allowed += (int,)
            if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
                names = " or ".join("None" if kind is type(None) else kind.__name__ for kind in allowed)
                raise ValueError(f"{setting.name} must be {names}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{setting.name} must be a finite number, got {value!r}")

    @property
    def schedules_ahead(self) -> bool:
        """Whether async scheduling is on (``async_scheduling``, None resolved for this machine)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.compute_device.type == "cuda"

    @property
    def compute_device(self) -> torch.device:
        """The compute device, with its index when it is a GPU."""
        device = torch.device(self.device if self.device is not None
                              else "cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

