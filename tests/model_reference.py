"""What the model tests compare against: tiny random-weight transformers models of every
family, and a schedule that checks neo's logits against theirs token by token.

Each variant is built as a tiny transformers model with random, non-trivial weights and saved
with ``save_pretrained``; ``run_schedule`` runs packed prefills, mixed prefill + decode steps
and decode steps over a paged cache with shuffled block tables (optionally with some sequences
in the host cache, stage by stage like the pipeline) and compares every token's logits with
transformers' within float32 rounding.
"""

import math
import os

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from model_harness import PagedKVHarness
from neo.models import loader

BLOCK_SIZE = 8
# Relative to the largest reference logit: float32 rounding differences between a fused and
# an unfused computation stay below 1e-6 of it; a wrong weight, position or mask is > 1e-1.
LOGIT_TOLERANCE = 1e-5

_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1,
               eos_token_id=2)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)
VARIANTS = {
    # Llama 2: multi-head attention, plain RoPE.
    "llama2": (LlamaForCausalLM, LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, **_COMMON)),
    # Llama 3.1: GQA, rope_theta 500000, llama3 rope scaling (all three frequency bands).
    "llama3.1": (LlamaForCausalLM, LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_SCALING), **_COMMON)),
    # Llama 3.2: tied embeddings, GQA 4:1, llama3 scaling with factor 32.
    "llama3.2": (LlamaForCausalLM, LlamaConfig(
        vocab_size=112, hidden_size=128, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, rope_theta=500000.0,
        rope_scaling={**LLAMA3_SCALING, "factor": 32.0}, tie_word_embeddings=True, **_COMMON)),
    # Qwen2: bias on q/k/v, GQA, rope_theta 1e6.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(
        vocab_size=120, hidden_size=96, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, rope_theta=1000000.0, **_COMMON)),
    # Llama with attention_bias (q/k/v/o biases) and mlp_bias.
    "llama-biases": (LlamaForCausalLM, LlamaConfig(
        vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_theta=10000.0, **_COMMON)),
    # Qwen3: per-head q/k RMSNorm, GQA 2:1, head_dim 32 where hidden / heads is 16.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(
        vocab_size=104, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
        **_COMMON)),
    # Qwen3 with tied embeddings, attention_bias (q/k/v/o biases), GQA 4:1, head_dim 48 where
    # hidden / heads is 24.
    "qwen3-tied-biases": (Qwen3ForCausalLM, Qwen3Config(
        vocab_size=88, hidden_size=96, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=48, attention_bias=True,
        tie_word_embeddings=True, rope_theta=1000000.0, **_COMMON)),
    # Mistral: GQA 4:1, a sliding window exactly as long as the context (so it never slides).
    "mistral": (MistralForCausalLM, MistralConfig(
        vocab_size=96, hidden_size=128, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, sliding_window=256, rope_theta=1000000.0,
        **_COMMON)),
    # Mistral without a sliding window, head_dim 32 where hidden / heads is 16.
    "mistral-no-window": (MistralForCausalLM, MistralConfig(
        vocab_size=72, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=None,
        rope_theta=10000.0, **_COMMON)),
}
SHARDED = {"llama3.1", "qwen2", "qwen3"}

# Prompts of different lengths (one exactly a block, one a single token) and the tokens fed
# as decodes afterwards. Steps: (sequences prefilled, sequences decoded), in token order.
PROMPT_LENGTHS = [5, 17, 1, 8]
CONTINUATION_LENGTH = 4
STEPS = [([0, 1, 2], []), ([3], [0, 1, 2]), ([], [0, 1, 2, 3]), ([], [0, 1, 2, 3]),
         ([], [0, 1, 2, 3])]


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter of a transformers model random, non-trivial values.

    Norm weights 1 +- 0.2 and biases ~ N(0, 0.2) (transformers initializes them to 1 and 0,
    which would hide a misplaced norm or bias); linear weights ~ N(0, 1 / fan_in), larger for
    query/key/LM head so attention and logits are not flat.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                uniform = torch.rand(parameter.shape, generator=generator) * 2 - 1
                parameter.copy_(1 + 0.2 * uniform)
            elif name.endswith("bias"):
                parameter.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                parameter.copy_(noise)
            else:
                gain = 2.0 if any(key in name for key in ("q_proj", "k_proj", "lm_head")) else 1.0
                parameter.copy_(noise * gain / math.sqrt(parameter.shape[1]))


def save_variant(name: str, directory) -> torch.nn.Module:
    """Build, randomize and save one variant; returns the transformers model (eval, float32)."""
    model_class, config = VARIANTS[name]
    torch.manual_seed(0)
    hf_model = model_class(config).to(torch.float32).eval()
    randomize(hf_model, seed=len(name))
    shard_size = "40KB" if name in SHARDED else "50GB"
    hf_model.save_pretrained(directory, max_shard_size=shard_size)
    has_index = os.path.isfile(os.path.join(directory, loader.INDEX_FILE))
    assert has_index == (name in SHARDED), "the save did not produce the intended layout"
    return hf_model


def reference_logits(hf_model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits ``[len, vocab]`` of every position of each sequence."""
    with torch.no_grad():
        return [hf_model(torch.tensor([tokens])).logits[0].float() for tokens in sequences]


def make_sequences(vocab_size: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(vocab_size, (length,), generator=generator).tolist()
               for length in PROMPT_LENGTHS]
    continuations = [torch.randint(vocab_size, (CONTINUATION_LENGTH,), generator=generator).tolist()
                     for _ in PROMPT_LENGTHS]
    return prompts, continuations


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape, what
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= LOGIT_TOLERANCE * scale, (
        f"{what}: max |logit difference| {error:.3g} exceeds {LOGIT_TOLERANCE} x {scale:.3g}")


def run_schedule(model, hf_model, *, steps=STEPS, host_sequences=(), seed=0) -> None:
    """Run ``steps`` through neo and compare every token's logits with transformers'.

    Sequences in ``host_sequences`` live in the host cache: prefilled with their K/V
    offloaded, decoded as CPU decodes (stage by stage, like the pipeline).
    """
    prompts, continuations = make_sequences(model.config.vocab_size, seed)
    full = [prompt + continuation for prompt, continuation in zip(prompts, continuations)]
    expected_by_sequence = reference_logits(hf_model, full)
    harness = PagedKVHarness(model.config, num_blocks=40, block_size=BLOCK_SIZE,
                             dtype=torch.float32, seed=seed)
    fed = {}
    for step, (prefilled, decoded) in enumerate(steps):
        prefills = [(i, "host" if i in host_sequences else "device", prompts[i]) for i in prefilled]
        gpu_decodes = [(i, full[i][fed[i]]) for i in decoded if i not in host_sequences]
        host_decodes = [(i, full[i][fed[i]]) for i in decoded if i in host_sequences]
        expected = [expected_by_sequence[i][:len(prompts[i])] for i in prefilled]
        expected += [expected_by_sequence[i][fed[i]:fed[i] + 1]
                     for i, _ in gpu_decodes + host_decodes]
        for i in prefilled:
            fed[i] = len(prompts[i])
        for i in decoded:
            fed[i] += 1
        logits = harness.run(model, prefills, gpu_decodes, host_decodes)
        assert_logits_close(logits, torch.cat(expected), f"step {step}")
