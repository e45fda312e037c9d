"""Models and weight loading against Hugging Face transformers (CPU, float32).

Each architecture variant (``model_reference.VARIANTS``: Llama 2/3.1/3.2, Qwen2, Qwen3,
Mistral) is built as a tiny random transformers model, saved with ``save_pretrained``, loaded
with ``load_model``, and run through packed prefills, mixed prefill + decode steps and decode
steps over a paged cache with shuffled block tables; every token's logits must equal
transformers' within float32 rounding.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from model_harness import PagedKVHarness
from model_reference import BLOCK_SIZE, LLAMA3_SCALING, VARIANTS, run_schedule, save_variant
from neo.models.causal_lm import count_parameters
from neo.models.registry import config_from_hf
from neo.models import loader, tiny
from neo.models.loader import load_model, resolve_model_config
from neo.models.rotary import cos_sin_table
from neo.tokenizer import Tokenizer, load_tokenizer


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    hf_model = save_variant(variant, tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert model.config.architecture == type(hf_model).__name__
    run_schedule(model, hf_model)


def test_tied_embeddings_share_one_tensor(tmp_path):
    save_variant("llama3.2", tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert model.lm_head_weight is model.embed_tokens_weight


@pytest.mark.parametrize("variant", ["llama3.1", "qwen3", "mistral"])
def test_host_decode_rows_are_left_to_the_caller(variant, tmp_path):
    """Offloaded prefills and host decodes, run stage by stage, still match transformers."""
    hf_model = save_variant(variant, tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    run_schedule(model, hf_model, host_sequences={1, 3}, seed=1)


def test_forward_refuses_host_decodes(tmp_path):
    save_variant("llama2", tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    harness = PagedKVHarness(model.config, num_blocks=8, block_size=BLOCK_SIZE,
                             dtype=torch.float32)
    harness.run(model, [(0, "host", [3, 4, 5])], [])
    input_ids, meta = harness.build_step([], [], [(0, 6)])
    with pytest.raises(ValueError, match="1 host decodes"):
        model(input_ids, meta, harness.kv_caches())


def test_neo_tiny_matches_transformers(tmp_path):
    tiny.save_tiny(str(tmp_path))
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    for source in (tiny.TINY_NAME, str(tmp_path)):
        model = load_model(source, dtype=torch.float32, device="cpu")
        run_schedule(model, hf_model, seed=2)


# Sums of neo-tiny's generated weights, recorded once: they must not depend on the machine or
# the torch version.
TINY_CHECKSUMS = {"model.embed_tokens.weight": -34.146224,
                  "model.layers.0.self_attn.q_proj.weight": -15.294827,
                  "model.layers.3.mlp.down_proj.weight": 3.931707,
                  "model.norm.weight": 257.258902,
                  "lm_head.weight": -86.256433}


def test_neo_tiny_weights_are_fixed():
    checkpoint = tiny.tiny_checkpoint()
    for name, expected in TINY_CHECKSUMS.items():
        assert checkpoint[name].dtype == torch.float32
        assert checkpoint[name].double().sum().item() == pytest.approx(expected, abs=2e-6), name


def test_neo_tiny_greedy_output_varies():
    """Greedy decoding from the random weights neither stops nor repeats one token."""
    model = load_model(tiny.TINY_NAME, dtype=torch.float32, device="cpu")
    harness = PagedKVHarness(model.config, num_blocks=16, block_size=16, dtype=torch.float32)
    prompt = load_tokenizer(tiny.TINY_NAME).encode("neo serves tokens")
    token = harness.run(model, [(0, "device", prompt)], [])[-1].argmax().item()
    generated = [token]
    for _ in range(31):
        token = harness.run(model, [], [(0, token)])[-1].argmax().item()
        generated.append(token)
    assert len(set(generated)) >= 8, generated


def test_rotary_table_matches_transformers():
    for name in ("llama2", "llama3.1", "llama3.2"):
        hf_config = VARIANTS[name][1]
        config = config_from_hf(hf_config.to_dict() | {
            "architectures": ["LlamaForCausalLM"]})
        rotary = LlamaRotaryEmbedding(hf_config)
        positions = torch.arange(hf_config.max_position_embeddings)[None]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
        table = cos_sin_table(config, hf_config.max_position_embeddings)
        half = config.head_dim // 2
        torch.testing.assert_close(table[:, :half], cos[0, :, :half], rtol=0, atol=0)
        torch.testing.assert_close(table[:, half:], sin[0, :, :half], rtol=0, atol=0)


def test_max_positions_caps_the_rotary_table():
    model = load_model(tiny.TINY_NAME, dtype=torch.float32, device="cpu", max_positions=100)
    assert model.max_positions == 100
    assert model.rotary.cos_sin_cache.shape == (100, model.config.head_dim)
    assert model.rotary.cos_sin_cache.dtype == torch.float32
    full = load_model(tiny.TINY_NAME, dtype=torch.float32, device="cpu", max_positions=10**6)
    assert full.max_positions == tiny.tiny_config().max_position_embeddings


# Configs ---------------------------------------------------------------------------------------

def test_rope_parameters_format_equals_rope_scaling_format():
    legacy = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_theta": 500000.0,
              "rope_scaling": dict(LLAMA3_SCALING)}
    current = {key: value for key, value in legacy.items() if not key.startswith("rope_")}
    current["rope_parameters"] = {**LLAMA3_SCALING, "rope_theta": 500000.0}
    assert config_from_hf(legacy) == config_from_hf(current)
    plain = dict(current, rope_parameters={"rope_type": "default", "rope_theta": 7.0})
    config = config_from_hf(plain)
    assert config.rope_theta == 7.0 and config.rope_scaling is None


@pytest.mark.parametrize("bad, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture 'GemmaForCausalLM'"),
])
def test_config_errors(bad, message):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=message):
        config_from_hf(config | bad)


PUBLISHED_PARAMETERS = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9, "llama-2-7b": 6.74e9,
                        "qwen2.5-32b": 32.76e9, "qwen3-8b": 8.19e9, "mistral-7b-v0.3": 7.25e9}


def test_shipped_configs():
    assert loader.builtin_config_names() == sorted(PUBLISHED_PARAMETERS)
    llama8b = resolve_model_config("Llama-3.1-8B")
    assert (llama8b.hidden_size, llama8b.num_layers, llama8b.num_heads, llama8b.num_kv_heads,
            llama8b.intermediate_size, llama8b.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert llama8b.rope_theta == 500000.0 and llama8b.rope_scaling["factor"] == 8.0
    assert llama8b.dtype == torch.bfloat16 and llama8b.eos_token_ids == (128001,)
    qwen = resolve_model_config("qwen2.5-32b", dtype="float16")
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.dtype == torch.float16
    assert (qwen.hidden_size, qwen.num_layers, qwen.num_heads, qwen.num_kv_heads,
            qwen.head_dim, qwen.vocab_size) == (5120, 64, 40, 8, 128, 152064)
    qwen3 = resolve_model_config("qwen3-8b")
    assert (qwen3.architecture, qwen3.head_dim, qwen3.num_kv_heads, qwen3.rms_norm_eps,
            qwen3.max_position_embeddings) == ("Qwen3ForCausalLM", 128, 8, 1e-6, 40960)
    assert not (qwen3.qkv_bias or qwen3.o_proj_bias or qwen3.tie_word_embeddings)
    mistral = resolve_model_config("mistral-7b-v0.3")
    assert (mistral.architecture, mistral.vocab_size, mistral.rope_theta,
            mistral.sliding_window) == ("MistralForCausalLM", 32768, 1e6, None)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_dummy_load_of_shipped_config_on_meta(name):
    model = load_model(name, dtype=torch.bfloat16, device="meta", load_format="dummy")
    config = model.config
    count = sum(parameter.numel() for parameter in model.parameters())
    assert count == pytest.approx(PUBLISHED_PARAMETERS[name], rel=2e-3)
    assert count_parameters(config) == count
    layer = model.layers[0]
    assert layer.qkv_proj_weight.shape == (config.q_size + 2 * config.kv_size, config.hidden_size)
    assert layer.gate_up_proj_weight.shape == (2 * config.intermediate_size, config.hidden_size)
    assert (layer.qkv_proj_bias is not None) == config.qkv_bias
    assert all(parameter.dtype == torch.bfloat16 and parameter.is_meta
               for parameter in model.parameters())


def test_dummy_load_is_seeded_and_runs(tmp_path):
    """A scaled-down Llama-3.1-8B config: real code path, small shapes."""
    text = loader.resources.files("neo.models.configs").joinpath("llama-3.1-8b.json").read_text()
    config = json.loads(text) | {"num_hidden_layers": 2, "hidden_size": 256,
                                 "intermediate_size": 512, "num_attention_heads": 8,
                                 "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(config))
    load = lambda seed: load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu",  # noqa: E731
                                   load_format="dummy", seed=seed, max_positions=512)
    first, again, other = load(3), load(3), load(4)
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if name.endswith("norm_weight"):
            assert bool((a == 1).all()), name
        else:
            assert a.abs().max() <= 1e-3 and a.std() > 1e-4 and not torch.equal(a, c), name
    harness = PagedKVHarness(first.config, num_blocks=8, block_size=BLOCK_SIZE,
                             dtype=torch.bfloat16)
    logits = harness.run(first, [(0, "device", [1, 2, 3, 4, 5])], [])
    assert logits.shape == (5, 1000) and bool(logits.isfinite().all())
    logits = harness.run(first, [], [(0, 6)])
    assert logits.shape == (1, 1000) and bool(logits.isfinite().all())


# Loader errors ---------------------------------------------------------------------------------

def test_unknown_model_lists_builtin_names():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*neo-tiny.*llama-3.1-8b"):
        resolve_model_config("no-such-model")
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model", dtype=torch.float32, device="cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    supported = "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM"
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel' in "
                                         f"{tmp_path.name}; neo supports {supported}$"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")


def test_builtin_config_needs_dummy_format():
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model("llama-3.1-8b", dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="built-in weights"):
        load_model(tiny.TINY_NAME, dtype=torch.float32, device="cpu", load_format="safetensors")
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        load_model(tiny.TINY_NAME, dtype=torch.float32, device="cpu", load_format="pt")


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny.tiny_hf_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*pytorch_model.bin"):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")


def test_index_naming_a_missing_shard(tmp_path):
    save_variant("qwen2", tmp_path)
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(str(tmp_path), dtype=torch.float32, device="cpu")


def _rewrite_checkpoint(directory, edit) -> None:
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    tiny.save_tiny(str(tmp_path))
    load = lambda: load_model(str(tmp_path), dtype=torch.float32, device="cpu")  # noqa: E731
    name = "model.layers.2.self_attn.k_proj.weight"
    _rewrite_checkpoint(tmp_path, lambda tensors: tensors.pop(name))
    with pytest.raises(ValueError, match=f"missing tensors: {name}"):
        load()
    _rewrite_checkpoint(tmp_path, lambda tensors: tensors.update(
        {name: torch.zeros(64, 256), "model.layers.9.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensors: model.layers.9.mlp.extra.weight"):
        load()
    _rewrite_checkpoint(tmp_path, lambda tensors: tensors.pop("model.layers.9.mlp.extra.weight"))
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    tensors[name] = torch.zeros(32, 256)
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name} has shape \\(32, 256\\).*\\(64, 256\\)"):
        load()


def test_checkpoint_dtype_is_converted(tmp_path):
    """A bfloat16 checkpoint loads into a float32 model exactly (and rotary stays float32)."""
    tiny.save_tiny(str(tmp_path))
    _rewrite_checkpoint(tmp_path, lambda tensors: tensors.update(
        {name: tensor.to(torch.bfloat16) for name, tensor in tensors.items()}))
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    expected = tiny.tiny_checkpoint()["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16)
    intermediate = model.config.intermediate_size
    assert torch.equal(model.layers[1].gate_up_proj_weight[intermediate:], expected.float())
    assert model.rotary.cos_sin_cache.dtype == torch.float32


# Tokenizer -------------------------------------------------------------------------------------

def test_tiny_tokenizer_is_byte_level():
    tokenizer = load_tokenizer(tiny.TINY_NAME)
    text = "héllo wörld ✓\n\ttabs"
    ids = tokenizer.encode(text)
    assert ids == [tokenizer.bos_token_id] + list(text.encode())
    assert tokenizer.decode(ids) == text
    assert tokenizer.bos_token_id == 256 and tokenizer.eos_token_ids == (257,)
    assert tokenizer.vocab_size == tiny.tiny_config().vocab_size
    assert tokenizer.decode([72, 105, 257, 300]) == "Hi"


def test_saved_tokenizer_matches_builtin_and_transformers(tmp_path):
    tiny.save_tiny(str(tmp_path))
    builtin, saved = load_tokenizer(tiny.TINY_NAME), load_tokenizer(str(tmp_path))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ("plain ascii", "ünïcödé 日本", " leading space", ""):
        assert saved.encode(text) == builtin.encode(text) == hf_tokenizer(text)["input_ids"]
    assert saved.eos_token_ids == builtin.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert saved.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert builtin.apply_chat_template(messages) == "<|begin_of_text|>user: hi\nassistant: "


def test_tokenizer_special_tokens_from_directory(tmp_path):
    tiny.save_tiny(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 258]}))
    tokenizer_config = tiny.tiny_tokenizer_config()
    del tokenizer_config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.eos_token_ids == (257, 258)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == "system: be brief\nuser: hi\nassistant: "


def test_models_without_tokenizer(tmp_path):
    assert load_tokenizer("llama-3.1-8b") is None
    (tmp_path / "config.json").write_text(json.dumps(tiny.tiny_hf_config()))
    assert load_tokenizer(str(tmp_path)) is None
    with pytest.raises(ValueError, match="unknown model"):
        load_tokenizer(str(tmp_path / "absent"))
    assert isinstance(load_tokenizer(tiny.TINY_NAME), Tokenizer)
