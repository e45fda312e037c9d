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
