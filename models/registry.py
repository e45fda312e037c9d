"""The model registry: from a Hugging Face architecture name to how neo runs that family.

A ``config.json`` names its architecture in ``architectures[0]`` (``"Qwen3ForCausalLM"``). The
family's row gives the decoder-layer class ``CausalLM`` stacks (which declares the layer's
weights, its stages and the checkpoint tensor names it reads) and a function that reads the
config facts that differ by family (biases, the ``head_dim`` default, the sliding window) into
``ModelConfig`` fields, refusing settings neo cannot run. Everything else in a config
(sizes, norms' epsilon, rotary settings, token ids) is read the same way for every family by
``config_from_hf``.

Adding a family: a reader below, a row in ``FAMILIES``, and, when its block differs from
Llama's beyond the config flags, a ``DecoderLayer`` subclass in its own module.
"""

import json
import os
from dataclasses import dataclass
from typing import Callable

from .config import ModelConfig, parse_dtype, read_rope_settings
from .llama import DecoderLayer
from .qwen3 import Qwen3DecoderLayer


@dataclass(frozen=True)
class ModelFamily:
    """How neo runs one Hugging Face architecture.

    architecture: the name in ``config.json``'s ``architectures[0]``.
    layer_class: the decoder layer (``DecoderLayer`` or a subclass), built as
        ``layer_class(config, rotary, dtype, device, parallel)`` for every layer (``config``:
        the shapes of one tensor-parallel rank, ``parallel``: its ``TensorParallel``).
    read_config: the family-specific ``ModelConfig`` fields (``qkv_bias``, ``o_proj_bias``,
        ``mlp_bias``, ``sliding_window``, optionally ``head_dim``) from the ``config.json`` dict;
        raises ``ValueError`` for a setting neo does not support.
    """

    architecture: str
    layer_class: type[DecoderLayer]
    read_config: Callable[[dict], dict]


def _llama_config(config: dict) -> dict:
    """Llama: ``attention_bias`` puts biases on q/k/v and o, ``mlp_bias`` on the MLP."""
    attention_bias = bool(config.get("attention_bias", False))
    return dict(qkv_bias=attention_bias, o_proj_bias=attention_bias,
                mlp_bias=bool(config.get("mlp_bias", False)))


def _refuse_qwen_sliding_windows(config: dict) -> None:
    """Qwen2 and Qwen3 configs carry ``use_sliding_window`` / ``sliding_window`` /
    ``max_window_layers`` / ``layer_types``; neo runs them only with every layer on full
    attention."""
    if config.get("use_sliding_window"):
        raise ValueError(f"sliding-window attention (use_sliding_window=true, window "
                         f"{config.get('sliding_window')} on layers from max_window_layers "
                         f"{config.get('max_window_layers')}) is not supported: neo's attention "
                         f"is full causal attention on every layer")
    layer_types = config.get("layer_types") or []
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        raise ValueError(f"layer_types {', '.join(other)} are not supported: neo runs every "
                         f"layer with full_attention")


def _qwen2_config(config: dict) -> dict:
    """Qwen2: biases on q/k/v only (none on o or the MLP, whatever the config says)."""
    _refuse_qwen_sliding_windows(config)
    return dict(qkv_bias=True, o_proj_bias=False, mlp_bias=False)


def _qwen3_config(config: dict) -> dict:
    """Qwen3: ``attention_bias`` puts biases on q/k/v and o; no MLP bias. ``head_dim`` is
    explicit, and 128 when absent (transformers' Qwen3 default), not ``hidden / num_heads``.
    The per-head q/k norms are ``Qwen3DecoderLayer``'s."""
    _refuse_qwen_sliding_windows(config)
    attention_bias = bool(config.get("attention_bias", False))
    return dict(qkv_bias=attention_bias, o_proj_bias=attention_bias, mlp_bias=False,
                head_dim=config.get("head_dim") or 128)


def _mistral_config(config: dict) -> dict:
    """Mistral: no biases; ``sliding_window`` (null: none) is checked against the context
    length when the model is built (``ModelConfig.context_length``)."""
    return dict(qkv_bias=False, o_proj_bias=False, mlp_bias=False,
                sliding_window=config.get("sliding_window"))


FAMILIES: dict[str, ModelFamily] = {family.architecture: family for family in (
    ModelFamily("LlamaForCausalLM", DecoderLayer, _llama_config),
    ModelFamily("Qwen2ForCausalLM", DecoderLayer, _qwen2_config),
    ModelFamily("Qwen3ForCausalLM", Qwen3DecoderLayer, _qwen3_config),
    ModelFamily("MistralForCausalLM", DecoderLayer, _mistral_config),
)}


def supported_architectures() -> tuple[str, ...]:
    """Every architecture name neo runs, in registry order."""
    return tuple(FAMILIES)


def model_family(architecture: str, source: str = "") -> ModelFamily:
    """The registry row of ``architecture``; a ``ValueError`` listing the supported names
    (``source``, e.g. the model's name, is named in it) when there is none."""
    family = FAMILIES.get(architecture)
    if family is None:
        where = f" in {source}" if source else ""
        raise ValueError(f"unsupported architecture {architecture!r}{where}; neo supports "
                         f"{', '.join(FAMILIES)}")
    return family


def config_from_hf(config: dict, name: str = "") -> ModelConfig:
    """A ``ModelConfig`` from the dict of a Hugging Face ``config.json`` (``name``: the model's
    name, for messages)."""
    architectures = config.get("architectures") or [config.get("model_type", "?")]
    architecture = architectures[0]
    family = model_family(architecture, source=name or "config")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; neo's MLP is "
                         f"SiLU-gated")
    num_heads = config["num_attention_heads"]
    hidden_size = config["hidden_size"]
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    dtype_name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    rope_theta, rope_scaling = read_rope_settings(config)
    family_fields = {"head_dim": config.get("head_dim") or hidden_size // num_heads,
                     **family.read_config(config)}
    return ModelConfig(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        **family_fields,
        rope_scaling=rope_scaling,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=parse_dtype(dtype_name),
        name=name,
    )


def read_model_config(directory: str) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face model directory (its ``config.json``)."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {directory!r}")
    with open(config_path) as file:
        return config_from_hf(json.load(file), name=os.path.basename(os.path.normpath(directory)))
