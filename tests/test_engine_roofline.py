"""``benchmarks/engine_roofline.py``'s roofline of a decode iteration, on the CPU: the bytes and
FLOPs it charges, counted here from the model's own parameters."""

import pytest

from benchmark_modules import benchmark_module
from engine_reference import gib_for_blocks
from neo import EngineConfig, LLMEngine

engine_roofline = benchmark_module("engine_roofline")


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(EngineConfig(model="neo-tiny", device="cpu", dtype="float32", policy="gpu-only",
                                    gpu_kv_cache_gib=gib_for_blocks(64), perf_model="zero"))
    yield engine
    engine.close()


def test_roofline_charges_every_weight_but_the_embedding_rows_and_the_kv_read(engine):
    config = engine.model_config
    parameters = sum(parameter.numel() for parameter in engine.runner.model.parameters())
    embedding = config.vocab_size * config.hidden_size
    read = parameters - (0 if config.tie_word_embeddings else embedding)
    contexts = [100, 300]
    bandwidth, flops = 1e12, 1e15
    row = engine_roofline.roofline(engine, len(contexts), contexts, bandwidth, flops)
    kv_bytes = sum(contexts) * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert row["weight_bytes"] == read * 4
    assert row["kv_bytes"] == kv_bytes
    assert row["memory_seconds"] == pytest.approx((read * 4 + kv_bytes) / bandwidth)
    # Every linear layer's weight is multiplied once per row (two FLOPs per weight); the norms are not.
    norms = config.num_layers * 2 * config.hidden_size + config.hidden_size
    attention = 4 * sum(contexts) * config.num_layers * config.num_heads * config.head_dim
    assert row["flops"] == 2 * len(contexts) * (read - norms) + attention
    assert row["roofline_seconds"] == pytest.approx(row["memory_seconds"] + row["flops"] / flops)


@pytest.mark.parametrize("name, kind", [
    ("nvjet_hsh_128x64_64x4_1x2_h_bz_splitK_TNN", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(x)", "GEMM"),
    ("void neo_cuda::(anonymous namespace)::paged_decode_attention_mma_kernel<__nv_bfloat16, 128, 4, 1>"
     "(neo_cuda::PagedDecodeAttentionParams)", "decode attention"),
    ("void neo_cuda::(anonymous namespace)::merge_kernel<__nv_bfloat16>(x)", "decode attention"),
    ("void neo_cuda::(anonymous namespace)::fused_add_rms_norm_kernel<__nv_bfloat16>(x)", "fused_add_rms_norm_kernel"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
     "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>(x)", "direct_copy_kernel_cuda"),
    ("Memset (Device)", "Memset (Device)"),
])
def test_kernel_kind_names_the_gemms_the_decode_attention_and_each_other_kernel(name, kind):
    assert engine_roofline.kernel_kind(name) == kind


def test_busy_and_span_count_overlapping_kernels_once():
    assert engine_roofline.busy_and_span([(5, 6), (0, 2), (1, 3)]) == (4, 6)
    assert engine_roofline.busy_and_span([(0, 10), (2, 3)]) == (10, 10)


def test_summarize_kernels_splits_forwards_at_the_pauses_between_them():
    def forward(start):  # a GEMM, a 2 us gap, a norm overlapping the decode kernel
        return [{"name": "nvjet_gemm", "ts": start, "dur": 10}, {"name": "rms_norm_kernel", "ts": start + 12, "dur": 4},
                {"name": "paged_decode_attention_mma_kernel", "ts": start + 14, "dur": 6}]
    events = forward(0) + forward(5000) + forward(12000)
    summary = engine_roofline.summarize_kernels(events, iterations=3)
    assert summary["kinds"]["GEMM"] == {"calls": 1, "seconds": pytest.approx(10e-6)}
    assert summary["kinds"]["decode attention"]["seconds"] == pytest.approx(6e-6)
    assert summary["span_seconds"] == pytest.approx(20e-6)  # not the pauses between forwards
    assert summary["busy_seconds"] == pytest.approx(18e-6)
    with pytest.raises(RuntimeError, match="no CUDA kernel"):
        engine_roofline.summarize_kernels([], iterations=1)


def test_gemm_weight_bytes_are_the_rooflines_linear_weights(engine):
    config = engine.model_config
    row = engine_roofline.roofline(engine, 1, [10], 1e12, 1e15)
    norms = config.num_layers * 2 * config.hidden_size + config.hidden_size
    assert engine_roofline.gemm_weight_bytes(engine) == row["weight_bytes"] - norms * 4
