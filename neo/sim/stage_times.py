"""Stage times synthesized from a model's shapes and a ``Hardware``: the same ``PerfTable``
that ``neo profile`` measures, filled from rooflines instead of timings.

Per layer, in the hardware's dtype (``b`` bytes per element):

- linear stages (pre + post) of ``T`` tokens: the layer's GEMM weights ``W`` bytes are read
  once, ``2 * W / b * T`` FLOPs are computed; the time is the rooflines' smooth maximum
  ``(m^p + c^p)^(1/p)`` of the memory time ``m = W / (hbm * weight_stream_efficiency)`` and
  the compute time ``c = FLOPs / (peak * matmul_efficiency)`` (``ROOFLINE_CORNER`` = p: near
  the ridge neither side runs at its own peak), at least two eager stage launches;
- GPU decode attention over ``C`` context tokens: their K and V bytes over the decode-attention
  kernel's share of the device bandwidth, at least one stage launch;
- prefill attention of a prompt of ``L`` tokens: ``2 * L^2 * heads * head_dim`` FLOPs (causal
  QK^T and PV) over the prefill-attention efficiency's share of the peak, at least one launch;
- host attention of ``n`` requests over ``C`` tokens: a hand-off overhead per layer and per
  request, plus the K and V bytes over the host read bandwidth the attention threads get
  (``Hardware.host_read_bandwidth``) times the kernel's efficiency;
- a decode iteration replayed from a CUDA graph (``graph_decode``): the linear and attention
  rooflines without launches, plus the LM head, plus the iteration overhead;
- the pipeline, host-batch and iteration overheads: the hardware's per-layer figures times the
  layers.

Interpolation between the table's points is exact where the formula is linear, and the points
reach the engine's limits (the longest prompt, the largest batch, the whole pool's context).
"""

from neo.models.config import ModelConfig
from neo.runner.profiler import pre_fraction
from neo.sched.perf_model import PerfTable

from .hardware import Hardware

ROOFLINE_CORNER = 3.0
DECODE_ATTENTION_EFFICIENCY = 0.90  # the CUDA decode-attention kernel over the copy bandwidth (RESULTS.md)
GRAPH_DECODE_CONTEXT = 16  # tokens per request of the graph_decode points, as the profiler's
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def geometric(low: int, high: int, factor: int = 2) -> list[int]:
    """``low``, ``low * factor``, ... up to ``high``, which is always the last point."""
    points, value = [], low
    while value < high:
        points.append(value)
        value *= factor
    return points + [high]


class StageModel:
    """The per-stage formulas of the module docstring for one model on one hardware."""

    def __init__(self, model: ModelConfig, hardware: Hardware):
        self.model = model
        self.hardware = hardware
        self.element_bytes = DTYPE_BYTES[hardware.dtype]
        hidden = model.hidden_size
        q_size, kv_size = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        self.layer_parameters = (hidden * (q_size + 2 * kv_size) + q_size * hidden
                                 + 3 * hidden * model.intermediate_size)
        self.kv_bytes_per_token_layer = 2 * kv_size * self.element_bytes
        self.layers = model.num_layers
        self.launch = hardware.stage_launch_us * 1e-6
        self.peak_flops = hardware.matmul_tflops * 1e12

    def gemm(self, parameters: int, tokens: int) -> float:
        """Seconds of GEMMs over ``parameters`` weights for ``tokens`` tokens (no launch floor)."""
        hardware = self.hardware
        memory = parameters * self.element_bytes / (hardware.hbm_gbps * 1e9 * hardware.weight_stream_efficiency)
        compute = 2 * parameters * tokens / (self.peak_flops * hardware.matmul_efficiency)
        return (memory ** ROOFLINE_CORNER + compute ** ROOFLINE_CORNER) ** (1 / ROOFLINE_CORNER)

    def linear(self, tokens: int) -> float:
        return self.layers * max(self.gemm(self.layer_parameters, tokens), 2 * self.launch)

    def decode_attention_roofline(self, context_tokens: int) -> float:
        """Seconds per layer of GPU decode attention over that many tokens (no launch floor)."""
        return (context_tokens * self.kv_bytes_per_token_layer
                / (self.hardware.hbm_gbps * 1e9 * DECODE_ATTENTION_EFFICIENCY))

    def gpu_attention(self, context_tokens: int) -> float:
        return self.layers * max(self.decode_attention_roofline(context_tokens), self.launch)

    def prefill_attention(self, length: int) -> float:
        model = self.model
        flops = 2 * length * length * model.num_heads * model.head_dim
        seconds = flops / (self.peak_flops * self.hardware.prefill_attention_efficiency)
        return self.layers * max(seconds, self.launch)

    def host_attention(self, requests: int, context_tokens: int) -> float:
        """Seconds of host attention; infinite where the host has no attention thread or no
        read bandwidth."""
        hardware = self.hardware
        bandwidth = hardware.host_read_bandwidth(hardware.host_attention_threads) * hardware.host_attention_efficiency
        if bandwidth <= 0:
            return float("inf")
        overhead = hardware.host_layer_overhead_us + requests * hardware.host_request_overhead_us
        return (self.layers * overhead * 1e-6
                + self.layers * context_tokens * self.kv_bytes_per_token_layer / (bandwidth * 1e9))

    def graph_decode(self, requests: int) -> float:
        model = self.model
        layers = self.layers * (self.gemm(self.layer_parameters, requests)
                                + self.decode_attention_roofline(requests * GRAPH_DECODE_CONTEXT))
        lm_head = self.gemm(model.vocab_size * model.hidden_size, requests)
        return layers + lm_head + self.hardware.iteration_overhead_us * 1e-6

    @property
    def host_capable(self) -> bool:
        """Whether host attention can run at all (a thread and some read bandwidth)."""
        hardware = self.hardware
        return hardware.host_read_bandwidth(hardware.host_attention_threads) * hardware.host_attention_efficiency > 0


def synthesize_table(model: ModelConfig, hardware: Hardware, *, max_num_batched_tokens: int, max_num_seqs: int,
                     max_model_len: int, pool_tokens: int, block_size: int = 16) -> PerfTable:
    """The ``PerfTable`` of ``model`` on ``hardware`` (see the module docstring); its points
    reach ``max_num_batched_tokens`` tokens, ``max_num_seqs`` requests, prompts of up to
    ``max_model_len`` tokens and contexts of ``pool_tokens`` (the larger pool's tokens).
    Host attention is left empty where the host cannot run it (``StageModel.host_capable``)."""
    stages = StageModel(model, hardware)
    linear_tokens = geometric(1, max(max_num_batched_tokens, max_num_seqs))
    attention_tokens = geometric(256, max(256, pool_tokens), 4)
    prefill_lengths = geometric(16, max(16, min(max_model_len, max_num_batched_tokens)))
    host_requests = geometric(1, max(1, max_num_seqs), 8)
    host_tokens = geometric(256, max(256, pool_tokens), 4)
    graph_requests = geometric(1, max_num_seqs, 4)
    if not stages.host_capable:
        host_requests = []
    table = PerfTable(
        key={"model_shape": model.shape_key,
             "dtype": hardware.dtype, "device": f"synthesized: {hardware.name}", "block_size": block_size,
             "cpu_threads": hardware.host_attention_threads},
        linear_tokens=linear_tokens, linear_seconds=[stages.linear(t) for t in linear_tokens],
        gpu_attention_tokens=attention_tokens,
        gpu_attention_seconds=[stages.gpu_attention(t) for t in attention_tokens],
        prefill_lengths=prefill_lengths, prefill_seconds=[stages.prefill_attention(n) for n in prefill_lengths],
        host_attention_requests=host_requests,
        host_attention_tokens=[list(host_tokens) for _ in host_requests],
        host_attention_seconds=[[stages.host_attention(n, t) for t in host_tokens] for n in host_requests],
        pipeline_overhead=model.num_layers * hardware.pipeline_overhead_us * 1e-6,
        pipeline_graph_overhead=model.num_layers * hardware.pipeline_overhead_us * 1e-6,
        iteration_overhead=hardware.iteration_overhead_us * 1e-6,
        host_batch_overhead=model.num_layers * hardware.host_batch_overhead_us * 1e-6,
        graph_decode_requests=graph_requests, graph_decode_seconds=[stages.graph_decode(n) for n in graph_requests],
        graph_decode_context=GRAPH_DECODE_CONTEXT,
        pre_fraction=pre_fraction(model),
    )
    return table
