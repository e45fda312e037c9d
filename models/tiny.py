"""``neo-tiny``: a small Llama-architecture model that works offline on any machine.

Its weights are random but fixed: drawn in float32 on the CPU from ``torch.Generator``s with
fixed seeds, so every machine and torch version builds the same model. The scales are chosen
so greedy decoding wanders instead of repeating one token. Its tokenizer is byte-level: ids
0-255 are the bytes of the UTF-8 text, then ``<|begin_of_text|>`` and ``<|end_of_text|>``,
then reserved special tokens up to the vocabulary size.

``save_tiny(directory)`` writes it as a Hugging Face model directory, so other tools
(transformers, the loader's safetensors path) can read the same model.
"""

import json
import math
import os

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .config import ModelConfig
from .registry import config_from_hf

TINY_NAME = "neo-tiny"
NUM_BYTE_TOKENS = 256
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
_SEED = 20240917

_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def tiny_hf_config() -> dict:
    """The ``config.json`` contents of neo-tiny."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 256,
        "intermediate_size": 640,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": NUM_BYTE_TOKENS,
        "eos_token_id": NUM_BYTE_TOKENS + 1,
        "torch_dtype": "float32",
    }


def tiny_config() -> ModelConfig:
    return config_from_hf(tiny_hf_config(), name=TINY_NAME)


def _uniform(shape: tuple[int, ...], bound: float, seed: int) -> torch.Tensor:
    """float32 uniform(-bound, bound) from its own CPU generator."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound


def tiny_checkpoint() -> dict[str, torch.Tensor]:
    """neo-tiny's weights: ``{Hugging Face tensor name: float32 CPU tensor}``.

    Linear weights are uniform with a per-kind gain over ``sqrt(3 / fan_in)`` (unit gain keeps
    the activation scale); query/key get a larger gain so attention is not uniform, and the
    LM head a larger one so the next-token distribution is peaked. Norm weights are
    1 +- 0.25, so a misplaced norm weight changes the output.
    """
    config = tiny_config()
    hidden, intermediate = config.hidden_size, config.intermediate_size
    shapes_and_gains: list[tuple[str, tuple[int, ...], float]] = [
        ("model.embed_tokens.weight", (config.vocab_size, hidden), 0.0)]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        shapes_and_gains += [
            (prefix + "input_layernorm.weight", (hidden,), 0.0),
            (prefix + "self_attn.q_proj.weight", (config.q_size, hidden), 2.0),
            (prefix + "self_attn.k_proj.weight", (config.kv_size, hidden), 2.0),
            (prefix + "self_attn.v_proj.weight", (config.kv_size, hidden), 1.0),
            (prefix + "self_attn.o_proj.weight", (hidden, config.q_size), 1.0),
            (prefix + "post_attention_layernorm.weight", (hidden,), 0.0),
            (prefix + "mlp.gate_proj.weight", (intermediate, hidden), 1.0),
            (prefix + "mlp.up_proj.weight", (intermediate, hidden), 1.0),
            (prefix + "mlp.down_proj.weight", (hidden, intermediate), 1.0),
        ]
    shapes_and_gains += [("model.norm.weight", (hidden,), 0.0),
                         ("lm_head.weight", (config.vocab_size, hidden), 4.0)]
    checkpoint = {}
    for index, (name, shape, gain) in enumerate(shapes_and_gains):
        seed = _SEED + index
        if name.endswith("norm.weight"):
            checkpoint[name] = 1.0 + _uniform(shape, 0.25, seed)
        elif name == "model.embed_tokens.weight":
            checkpoint[name] = _uniform(shape, 1.0, seed)
        else:
            checkpoint[name] = _uniform(shape, gain * math.sqrt(3.0 / shape[1]), seed)
    return checkpoint


def _byte_symbols() -> list[str]:
    """The printable character that stands for each byte in a byte-level BPE vocabulary.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, a few Latin-1
    gaps) are moved to code points 256 and up, in byte order.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(
        range(0xAE, 0xFF + 1))
    symbols, moved = [], 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(NUM_BYTE_TOKENS + moved))
            moved += 1
    return symbols


def _special_tokens() -> list[str]:
    """Special tokens in id order, from id 256 to the vocabulary size."""
    reserved = tiny_config().vocab_size - NUM_BYTE_TOKENS - 2
    return [BOS_TOKEN, EOS_TOKEN] + [f"<|reserved_special_token_{i}|>" for i in range(reserved)]


def tiny_tokenizer() -> Tokenizer:
    """neo-tiny's byte-level ``tokenizers.Tokenizer``; encoding prepends ``<|begin_of_text|>``."""
    vocabulary = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    specials = _special_tokens()
    for offset, token in enumerate(specials):
        vocabulary[token] = NUM_BYTE_TOKENS + offset
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in specials])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, NUM_BYTE_TOKENS)])
    return tokenizer


def tiny_tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` contents of neo-tiny."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "model_max_length": tiny_config().max_position_embeddings,
        "chat_template": _CHAT_TEMPLATE,
    }


def save_tiny(directory: str) -> None:
    """Write neo-tiny as a Hugging Face model directory (config, safetensors, tokenizer)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(tiny_hf_config(), file, indent=2)
    save_file(tiny_checkpoint(), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    tiny_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as file:
        json.dump(tiny_tokenizer_config(), file, indent=2)
