"""The model registry: from a Hugging Face architecture name to how neo runs that family.

A ``config.json`` names its architecture in ``architectures[0]`` (``"Qwen3ForCausalLM"``). The
family's row gives the decoder-layer class ``CausalLM`` stacks (which declares the layer's
weights, its stages and the checkpoint tensor names it reads) and a function that reads the
config facts that differ by family (biases, the ``head_dim`` default, the sliding window) into
``ModelConfig`` fields, refusing settings neo cannot run. Everything else in a config
(sizes, norms' epsilon, rotary settings, token ids) is read the same way for every family by
``ModelConfig.from_hf_config``.

Adding a family: a reader below, a row in ``FAMILIES``, and, when its block differs from
Llama's beyond the config flags, a ``DecoderLayer`` subclass in its own module.
"""

from dataclasses import dataclass
from typing import Callable

from .llama import DecoderLayer
from .qwen3 import Qwen3DecoderLayer


@dataclass(frozen=True)
class ModelFamily:
    """How neo runs one Hugging Face architecture.

    architecture: the name in ``config.json``'s ``architectures[0]``.
    layer_class: the decoder layer (``DecoderLayer`` or a subclass), built as
        ``layer_class(config, rotary, dtype, device)`` for every layer.
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
