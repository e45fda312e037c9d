"""``Hardware``: a GPU and its host described by a few numbers, and the named presets.

Every figure is a rate or a size the stage times are synthesized from
(``neo.sim.stage_times``): device memory and its bandwidth, dense matrix throughput, the
host-device link, the host's cores and memory read bandwidth, and the overheads of the
launching thread. Bandwidths and throughputs are what kernels achieve, not the spec sheet's
peaks: the H100 preset's are measured on this project's H100 machine, and the other GPUs' are
their spec-sheet peaks scaled by the same achieved fractions (copy bandwidth 3.03 of 3.35 TB/s,
bf16 GEMM 791 of 989 TFLOP/s on the H100). Kernel-efficiency and overhead figures (the fields
after ``host_memory_gib``) were fitted to the measured H100 profile shipped with this package
and are taken to hold on the other machines too (an assumption: a measured profile,
``--profile``, replaces them all).

dtype follows the hardware: bfloat16 where the GPU has bf16 matrix units, float16 otherwise
(the T4).
"""

import dataclasses
from dataclasses import dataclass

COPY_FRACTION = 3030 / 3350  # measured H100 device copy bandwidth over its spec (RESULTS.md, Kernels)
GEMM_FRACTION = 791 / 989  # measured H100 bf16 GEMM rate over its dense spec (RESULTS.md, gpu-only engine)


@dataclass(frozen=True)
class Hardware:
    """A GPU and its host. Rates in GB/s (1e9 bytes) and TFLOP/s, sizes in GiB, overheads in
    microseconds."""

    name: str
    gpu_memory_gib: float  # what the framework sees as the device's total memory
    hbm_gbps: float  # achieved device memory bandwidth
    bf16_tflops: float  # achieved dense bf16 matrix throughput; 0: no bf16 (float16 is used)
    fp16_tflops: float  # achieved dense fp16 matrix throughput
    pcie_h2d_gbps: float  # host to device copies
    pcie_d2h_gbps: float  # device to host copies
    host_cores: int  # logical cores the engine sees; host attention uses all but one
    host_read_gbps: float  # host memory read bandwidth once saturated
    host_read_gbps_per_thread: float  # per reading thread, until the saturation above
    host_memory_gib: float
    weight_stream_efficiency: float = 0.80  # decode GEMMs' weight reads over hbm_gbps
    matmul_efficiency: float = 0.82  # large GEMMs (a whole layer's, with its element-wise work) over the peak
    prefill_attention_efficiency: float = 0.30  # prefill attention FLOPs over the peak
    host_attention_efficiency: float = 0.80  # host decode attention's KV reads over host_read_gbps
    stage_launch_us: float = 40.0  # least time of an eagerly launched stage, per layer
    host_layer_overhead_us: float = 160.0  # host attention hand-off and store, per layer
    host_request_overhead_us: float = 0.9  # host attention, per request and layer
    pipeline_overhead_us: float = 285.0  # a two-sub-batch iteration's launches and hand-offs, per layer
    host_batch_overhead_us: float = 80.0  # a host batch's launches and hand-offs, per layer
    iteration_overhead_us: float = 0.0  # input preparation and sampling, per iteration
    # Host work of an engine step that the GPU waits for when the step runs in the synchronous
    # order (not planned ahead under async scheduling: ``SchedulerOutput.runs_ahead``): reading
    # the previous tokens, scheduling, building inputs, launching. Per step, and per request.
    sync_step_us: float = 0.0
    sync_step_request_us: float = 0.0
    # GPU iterations beside a host batch run at least this many times slower (its own GPU stages
    # share the GPU with them, its host threads the host with the launching thread; measured on
    # the H100 with 32B shapes, before the engine asked for 32 hardware work queues).
    host_batch_slowdown: float = 1.10
    # Host functions the CUDA driver queues on a stream before a launch waits for earlier ones
    # to run: launching a host batch's graph of one host function per layer returns once no
    # more than this many are left (measured on the H100 with driver 580: a 64-layer graph's
    # launch returned after its first 8 host functions, whatever their length).
    queued_host_functions: int = 56

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.bf16_tflops > 0 else "float16"

    @property
    def matmul_tflops(self) -> float:
        """Dense matrix throughput in the hardware's dtype."""
        return self.bf16_tflops if self.bf16_tflops > 0 else self.fp16_tflops

    @property
    def host_attention_threads(self) -> int:
        """Threads of host attention: every core but the launching thread's."""
        return max(0, self.host_cores - 1)

    def host_read_bandwidth(self, threads: int) -> float:
        """GB/s that ``threads`` reading threads get: linear up to the saturation bandwidth."""
        return min(self.host_read_gbps, threads * self.host_read_gbps_per_thread)


def _vm(name: str, gpu: dict, vcpus: int, host_read_gbps: float, per_thread: float, memory_gib: float) -> Hardware:
    return Hardware(name=name, host_cores=vcpus, host_read_gbps=host_read_gbps,
                    host_read_gbps_per_thread=per_thread, host_memory_gib=memory_gib, **gpu)


# NVIDIA A10G (AWS G5): 24 GB GDDR6 at 600 GB/s (AWS / NVIDIA A10 spec; 22.2 GiB visible to
# CUDA); tensor throughput about 70 TFLOP/s dense fp16/bf16 (the AWS variant has less tensor
# compute than the A10's 125); PCIe Gen4 x16, 32 GB/s per direction (spec), 25 achieved.
A10G = dict(gpu_memory_gib=22.2, hbm_gbps=600 * COPY_FRACTION, bf16_tflops=70 * GEMM_FRACTION,
            fp16_tflops=70 * GEMM_FRACTION, pcie_h2d_gbps=25.0, pcie_d2h_gbps=25.0)
# G5 hosts: AMD EPYC 7R32 (AWS), two vCPUs per core. The instance's share of the socket's
# memory bandwidth (8 channels DDR4-3200, 204.8 GB/s per socket, spec) is assumed to scale with
# its vCPUs up to 64 (half the 128-vCPU host: 100 GB/s), at about 6 GB/s per reading vCPU
# (an estimate for a Zen 2 core, two threads sharing it).
G5_READ_GBPS = {8: 24.0, 16: 40.0, 32: 65.0, 64: 100.0}

# Host work a step not planned ahead makes the GPU wait for on the H100 machine: the 8B gpu-only
# decode iteration with async scheduling off, less with it on (engine_roofline on the H100): 1.70
# ms at 64 requests, 2.66 ms at 256.
H100_HOST_STEP = {"sync_step_us": 1380.0, "sync_step_request_us": 5.1}

PRESETS: dict[str, Hardware] = {
    # This project's machine: H100 80GB HBM3 (SXM5) with a 16-core Xeon host (RESULTS.md):
    # device copy bandwidth 3.03 TB/s and bf16 GEMM 791 TFLOP/s measured; 79.2 GiB visible to
    # CUDA; PCIe Gen5 x16, 64 GB/s per direction (spec), 55 assumed achieved; host read probe
    # 104 GB/s at 15 threads (measured), per thread 13 GB/s: saturating between 8 and 15 threads,
    # as neo's measured gain does (1.33x / 1.89x / 1.93x at 4 / 8 / 15 threads).
    "h100": Hardware(name="h100", gpu_memory_gib=79.2, hbm_gbps=3030.0, bf16_tflops=791.0, fp16_tflops=791.0,
                     pcie_h2d_gbps=55.0, pcie_d2h_gbps=55.0, host_cores=16, host_read_gbps=104.0,
                     host_read_gbps_per_thread=13.0, host_memory_gib=256.0,
                     **H100_HOST_STEP),
    # This project's other machine: H200 (SXM, 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense bf16:
    # NVIDIA H200 datasheet) at the H100's measured fractions of its spec, 139 GiB visible to
    # CUDA; PCIe as the H100's; host: 16 cores of a Xeon (family 6 model 207), 128 GiB, read probe
    # 86-103 GB/s at 15-16 threads and 10-13 GB/s on one thread (twenty-fifth session, RESULTS.md),
    # the H100 host's step overheads.
    "h200": Hardware(name="h200", gpu_memory_gib=139.0, hbm_gbps=4800 * COPY_FRACTION,
                     bf16_tflops=989 * GEMM_FRACTION, fp16_tflops=989 * GEMM_FRACTION, pcie_h2d_gbps=55.0,
                     pcie_d2h_gbps=55.0, host_cores=16, host_read_gbps=97.0, host_read_gbps_per_thread=12.0,
                     host_memory_gib=128.0, **H100_HOST_STEP),
    # A100 80GB SXM4 server: 2039 GB/s, 312 TFLOP/s dense bf16/fp16 (NVIDIA A100 datasheet),
    # PCIe Gen4 x16 (32 GB/s per direction, 25 achieved); host: 32 cores of a two-socket EPYC
    # 7003 server (a typical 8-GPU server gives each GPU 16-32 cores), 8 channels DDR4-3200
    # (204.8 GB/s per socket, spec), 150 GB/s achieved assumed.
    "a100": Hardware(name="a100", gpu_memory_gib=79.2, hbm_gbps=2039 * COPY_FRACTION,
                     bf16_tflops=312 * GEMM_FRACTION, fp16_tflops=312 * GEMM_FRACTION, pcie_h2d_gbps=25.0,
                     pcie_d2h_gbps=25.0, host_cores=32, host_read_gbps=150.0, host_read_gbps_per_thread=13.0,
                     host_memory_gib=512.0),
    # AWS g4dn.4xlarge: NVIDIA T4, 16 GB GDDR6 at 320 GB/s, 65 TFLOP/s fp16 tensor, no bf16
    # (NVIDIA T4 datasheet; 14.6 GiB visible to CUDA); PCIe Gen3 x16, 16 GB/s per direction
    # (spec), 12 achieved; 16 vCPUs of a Xeon Platinum 8259CL (Cascade Lake, 6 channels DDR4-2933,
    # 140.8 GB/s per socket, spec), 64 GiB; its share of the socket's bandwidth assumed 35 GB/s,
    # 7 GB/s per reading vCPU (an estimate, two threads per core).
    "g4dn.4xlarge": Hardware(name="g4dn.4xlarge", gpu_memory_gib=14.6, hbm_gbps=320 * COPY_FRACTION, bf16_tflops=0.0,
                             fp16_tflops=65 * GEMM_FRACTION, pcie_h2d_gbps=12.0, pcie_d2h_gbps=12.0, host_cores=16,
                             host_read_gbps=35.0, host_read_gbps_per_thread=7.0, host_memory_gib=64.0),
    # AWS G5 (A10G, see above) with 8 / 16 / 32 / 64 vCPUs and 32 / 64 / 128 / 256 GiB.
    "g5.2xlarge": _vm("g5.2xlarge", A10G, 8, G5_READ_GBPS[8], 6.0, 32.0),
    "g5.4xlarge": _vm("g5.4xlarge", A10G, 16, G5_READ_GBPS[16], 6.0, 64.0),
    "g5.8xlarge": _vm("g5.8xlarge", A10G, 32, G5_READ_GBPS[32], 6.0, 128.0),
    "g5.16xlarge": _vm("g5.16xlarge", A10G, 64, G5_READ_GBPS[64], 6.0, 256.0),
}

OVERRIDABLE = tuple(field.name for field in dataclasses.fields(Hardware) if field.name != "name")
# One line per overridable field, for the command line's help.
FIELD_HELP = {
    "gpu_memory_gib": "GPU memory the framework sees, GiB",
    "hbm_gbps": "achieved GPU memory bandwidth, GB/s",
    "bf16_tflops": "achieved dense bf16 matrix throughput, TFLOP/s (0: no bf16, float16 is used)",
    "fp16_tflops": "achieved dense fp16 matrix throughput, TFLOP/s",
    "pcie_h2d_gbps": "host-to-device copy bandwidth, GB/s",
    "pcie_d2h_gbps": "device-to-host copy bandwidth, GB/s",
    "host_cores": "logical host cores (host attention uses all but one)",
    "host_read_gbps": "host memory read bandwidth once saturated, GB/s",
    "host_read_gbps_per_thread": "host read bandwidth per reading thread until saturation, GB/s",
    "host_memory_gib": "host memory, GiB",
    "weight_stream_efficiency": "decode GEMMs' weight reads over the GPU memory bandwidth",
    "matmul_efficiency": "large GEMMs' throughput over the peak",
    "prefill_attention_efficiency": "prefill attention FLOPs over the peak",
    "host_attention_efficiency": "host decode attention's KV reads over the host read bandwidth",
    "stage_launch_us": "least time of an eagerly launched stage, per layer, microseconds",
    "host_layer_overhead_us": "host attention hand-off and store, per layer, microseconds",
    "host_request_overhead_us": "host attention per request and layer, microseconds",
    "pipeline_overhead_us": "a two-sub-batch iteration's launches and hand-offs, per layer, microseconds",
    "host_batch_overhead_us": "a host batch's launches and hand-offs, per layer, microseconds",
    "iteration_overhead_us": "input preparation and sampling, per iteration, microseconds",
    "sync_step_us": "host work a step not planned ahead makes the GPU wait for, microseconds",
    "sync_step_request_us": "the same, per request of the step, microseconds",
    "host_batch_slowdown": "GPU iterations' slowdown while a host batch runs beside them",
    "queued_host_functions": "host functions the driver queues on a stream before a launch waits",
}


WHOLE_NUMBERS = ("host_cores", "queued_host_functions")


def preset(name: str) -> Hardware:
    """The preset called ``name``; a ``ValueError`` lists them otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def with_overrides(hardware: Hardware, overrides: dict[str, float | None]) -> Hardware:
    """``hardware`` with the given fields replaced (None: kept). Raises ``ValueError`` naming
    an unknown field or a negative value (host cores must be a whole number; GPU memory and
    device bandwidth and throughput positive)."""
    changes = {}
    for name, value in overrides.items():
        if value is None:
            continue
        if name not in OVERRIDABLE:
            raise ValueError(f"unknown hardware field {name!r}; fields: {', '.join(OVERRIDABLE)}")
        if value < 0:
            raise ValueError(f"hardware field {name} must be >= 0, got {value}")
        if name in WHOLE_NUMBERS and value != int(value):
            raise ValueError(f"hardware field {name} must be a whole number, got {value}")
        changes[name] = int(value) if name in WHOLE_NUMBERS else float(value)
    result = dataclasses.replace(hardware, **changes)
    for name in ("gpu_memory_gib", "hbm_gbps"):
        if getattr(result, name) <= 0:
            raise ValueError(f"hardware field {name} must be > 0, got {getattr(result, name)}")
    if result.matmul_tflops <= 0:
        raise ValueError(f"hardware {result.name!r} has no matrix throughput: set bf16_tflops or fp16_tflops > 0")
    return result
