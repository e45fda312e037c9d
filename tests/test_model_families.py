"""The model registry, the model interface, and the Qwen3 and Mistral families.

Logits parity of every family with transformers is ``test_models.py``'s
(``model_reference.VARIANTS``); here the new families run end to end: greedy tokens of the
engine (gpu-only, and neo with the async and the lockstep host pipeline and a GPU pool so
small that some requests decode on the host; on the CPU, and on CUDA when there is one) must
equal a greedy loop over transformers' logits. Also: the config facts each family reads, and
the settings neo refuses.
"""

import pytest
import torch

from engine_reference import NEW_TOKENS, PROMPTS, gib_for_blocks, greedy_continuations
from model_reference import randomize, run_schedule, save_variant
from neo import LLM, SamplingParams
from neo.models.causal_lm import CausalLM, count_parameters
from neo.models.config import ModelConfig
from neo.models.interface import CausalLMInterface, DecoderLayerInterface, interface_members, missing_members
from neo.models.llama import DecoderLayer
from neo.models.loader import load_model
from neo.models.qwen3 import Qwen3DecoderLayer
from neo.models.registry import FAMILIES as FAMILIES_TABLE
from neo.models.registry import config_from_hf, model_family, read_model_config, supported_architectures
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
_SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def hf_config(architecture: str, **fields) -> dict:
    """A small ``config.json`` dict of ``architecture``."""
    return {"architectures": [architecture], **_SHAPE, **fields}


# Registry and interface ------------------------------------------------------------------------

def test_registry_rows():
    assert supported_architectures() == FAMILIES
    layer_classes = [model_family(name).layer_class for name in FAMILIES]
    assert layer_classes == [DecoderLayer, DecoderLayer, Qwen3DecoderLayer, DecoderLayer]


@pytest.mark.parametrize("make", [
    lambda: config_from_hf(hf_config("GemmaForCausalLM"), name="gemma-tiny"),
    lambda: CausalLM(ModelConfig(architecture="GemmaForCausalLM", vocab_size=64, hidden_size=64,
                                 intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                                 head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                                 max_position_embeddings=256, name="gemma-tiny"),
                     dtype=torch.float32, device="meta"),
    lambda: model_family("GemmaForCausalLM", source="gemma-tiny"),
], ids=["config_from_hf", "CausalLM", "model_family"])
def test_unknown_architecture_lists_the_supported_ones(make):
    with pytest.raises(ValueError, match=f"unsupported architecture 'GemmaForCausalLM' in "
                                         f"gemma-tiny; neo supports {', '.join(FAMILIES)}$"):
        make()


@pytest.mark.parametrize("variant, layer_class", [
    ("llama3.2", DecoderLayer), ("qwen2", DecoderLayer), ("qwen3-tied-biases", Qwen3DecoderLayer),
    ("mistral", DecoderLayer)])
def test_models_satisfy_the_interface(variant, layer_class, tmp_path):
    save_variant(variant, tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert not missing_members(model, CausalLMInterface)
    assert all(type(layer) is layer_class and not missing_members(layer, DecoderLayerInterface)
               for layer in model.layers)
    config = model.config
    weight = model.logits_weight()
    assert weight is model.lm_head_weight
    assert weight.shape == (config.vocab_size, config.hidden_size)
    assert (weight is model.embed_tokens_weight) == config.tie_word_embeddings
    assert model.layers[0].scale == config.head_dim ** -0.5
    assert count_parameters(config) == sum(parameter.numel() for parameter in model.parameters())


def test_the_interface_lists_what_the_engine_calls():
    assert {"config", "rank_config", "parallel", "layers", "embed", "final_norm", "compute_logits", "logits_weight",
            "forward", "max_positions", "parameters", "checkpoint_targets"} == set(interface_members(CausalLMInterface))
    assert {"config", "scale", "pre_attention", "attention", "post_attention", "gemm_weights",
            "checkpoint_targets"} == set(interface_members(DecoderLayerInterface))


def test_a_layer_class_without_the_stages_is_refused(monkeypatch):
    class StagelessLayer(torch.nn.Module):
        def __init__(self, config, rotary, dtype, device, parallel=None):
            super().__init__()
            self.config, self.scale = config, config.head_dim ** -0.5

    family = model_family("LlamaForCausalLM")
    monkeypatch.setitem(FAMILIES_TABLE, "LlamaForCausalLM",
                        type(family)(family.architecture, StagelessLayer, family.read_config))
    config = config_from_hf(hf_config("LlamaForCausalLM"), name="stageless")
    with pytest.raises(TypeError, match="StagelessLayer, the layer of LlamaForCausalLM, lacks attention, "
                                        "checkpoint_targets, gemm_weights, post_attention, pre_attention of "
                                        "the layer interface"):
        CausalLM(config, dtype=torch.float32, device="meta")


# Config facts by family ------------------------------------------------------------------------

def test_qwen3_config_facts():
    config = config_from_hf(hf_config("Qwen3ForCausalLM", head_dim=32))
    assert config.head_dim == 32 and config.q_size == 128
    assert not (config.qkv_bias or config.o_proj_bias or config.mlp_bias)
    biased = config_from_hf(hf_config("Qwen3ForCausalLM", attention_bias=True,
                                                  mlp_bias=True))
    assert biased.qkv_bias and biased.o_proj_bias and not biased.mlp_bias
    # transformers' Qwen3 default when config.json has no head_dim, not hidden / heads (16).
    assert config_from_hf(hf_config("Qwen3ForCausalLM")).head_dim == 128
    assert config_from_hf(hf_config("LlamaForCausalLM")).head_dim == 16


def test_qwen_configs_with_sliding_windows_off_are_accepted():
    off = dict(use_sliding_window=False, sliding_window=64, max_window_layers=1,
               layer_types=["full_attention"])
    for architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        config = config_from_hf(hf_config(architecture, **off))
        assert config.sliding_window is None and config.context_length() == 256


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("fields, message", [
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=0),
     "use_sliding_window=true, window 64 on layers from max_window_layers 0.*not supported"),
    (dict(use_sliding_window=False, layer_types=["sliding_attention"]),
     "layer_types sliding_attention are not supported"),
], ids=["use_sliding_window", "layer_types"])
def test_qwen_sliding_windows_are_refused(architecture, fields, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf_config(architecture, **fields))


def test_mistral_config_facts():
    config = config_from_hf(hf_config("MistralForCausalLM", sliding_window=4096,
                                                  attention_bias=True, mlp_bias=True))
    assert config.sliding_window == 4096 and config.context_length() == 256
    assert not (config.qkv_bias or config.o_proj_bias or config.mlp_bias)
    unlimited = config_from_hf(hf_config("MistralForCausalLM", sliding_window=None))
    assert unlimited.sliding_window is None and unlimited.context_length(10**6) == 256
    with pytest.raises(ValueError, match="sliding_window must be positive or null, got 0"):
        config_from_hf(hf_config("MistralForCausalLM", sliding_window=0))


def save_mistral_with_window(directory, sliding_window: int) -> MistralForCausalLM:
    """A tiny random Mistral (context 256) with a sliding window, saved to ``directory``."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=80, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, sliding_window=sliding_window,
                           rms_norm_eps=1e-5, rope_theta=10000.0)
    hf_model = MistralForCausalLM(config).to(torch.float32).eval()
    randomize(hf_model, seed=sliding_window)
    hf_model.save_pretrained(directory)
    return hf_model


def test_mistral_window_below_the_context_is_refused(tmp_path):
    hf_model = save_mistral_with_window(tmp_path, sliding_window=64)
    with pytest.raises(ValueError, match="sliding window of 64 tokens, but the context length in "
                                         "use is 256 tokens \\(its max_position_embeddings\\).*"
                                         "pass max_model_len <= 64$"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="context length in use is 100 tokens \\(its max_positions"
                                         ".*max_model_len <= 64$"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu", max_positions=100)
    with pytest.raises(ValueError, match="pass max_model_len <= 64"):
        LLM(str(tmp_path), device="cpu", dtype="float32", gpu_kv_cache_gib=0.01)
    # With the context capped at the window, neo and transformers agree (no sequence reaches it).
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu", max_positions=64)
    assert model.max_positions == 64
    run_schedule(model, hf_model)


# End to end ------------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
BLOCK_SIZE = 16
# Each family's transformers model, and the engine's max_model_len for it.
END_TO_END = {
    # Qwen3: q/k norms, head_dim 32 (hidden / heads is 16), GQA 2:1.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(
        vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1000000.0), None),
    # Mistral: a sliding window of 128 tokens, served with max_model_len 128, GQA 4:1.
    "mistral": (MistralForCausalLM, MistralConfig(
        vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
        sliding_window=128, rms_norm_eps=1e-5, rope_theta=10000.0), 128),
}
# name: (policy, GPU pool blocks, host pipeline)
SETTINGS = {"gpu-only": ("gpu-only", 1024, "lockstep"), "neo-lockstep": ("neo", 10, "lockstep"),
            "neo-async": ("neo", 10, "async")}


@pytest.fixture(scope="module")
def saved_family(request, tmp_path_factory):
    """``(directory, max_model_len, expected greedy tokens of PROMPTS)`` of an END_TO_END
    family."""
    name = request.param
    model_class, config, max_model_len = END_TO_END[name]
    torch.manual_seed(0)
    hf_model = model_class(config).to(torch.float32).eval()
    randomize(hf_model, seed=7)
    directory = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(directory)
    longest = max(len(prompt) for prompt in PROMPTS) + NEW_TOKENS
    assert longest <= (max_model_len or config.max_position_embeddings)
    expected = greedy_continuations(hf_model, PROMPTS)
    # Varied continuations, so that a wrong weight or mask changes them.
    assert all(len(set(tokens)) >= 8 for tokens in expected), expected
    return str(directory), max_model_len, expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available"))])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("saved_family", list(END_TO_END), indirect=True)
def test_greedy_equals_transformers(saved_family, setting, device):
    directory, max_model_len, expected = saved_family
    policy, gpu_blocks, host_pipeline = SETTINGS[setting]
    config = read_model_config(directory)
    block_bytes = BLOCK_SIZE * config.kv_bytes_per_token(torch.float32)
    llm = LLM(directory, device=device, dtype="float32", policy=policy, block_size=BLOCK_SIZE,
              gpu_kv_cache_gib=gib_for_blocks(gpu_blocks, block_bytes),
              cpu_kv_cache_gib=gib_for_blocks(256, block_bytes), perf_model="zero",
              max_num_seqs=8, host_pipeline=host_pipeline, max_model_len=max_model_len)
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        metrics = llm.get_metrics()
    finally:
        llm.close()
    assert [output.outputs[0].token_ids for output in outputs] == expected
    if policy == "neo":
        assert metrics["host_decode_tokens"] > 0
        if host_pipeline == "async":
            assert metrics["host_batches"] > 0
        else:
            assert metrics["two_batch_iterations"] > 0

