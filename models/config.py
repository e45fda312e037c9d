"""``ModelConfig``: the shape of a model, and the parts of a Hugging Face ``config.json`` every
family reads alike (dtype names, rotary settings). The registry (``registry.py``) builds a
``ModelConfig`` from a ``config.json`` with the family's own facts.
"""

from dataclasses import dataclass, field

import torch

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'bf16' / torch.bfloat16 -> torch.bfloat16 (likewise float16, float32)."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ValueError(f"unsupported dtype {name}; use one of {', '.join(_DTYPES)}")
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
               "bf16": "bfloat16"}
    key = aliases.get(str(name).lower(), str(name).lower())
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


def rope_scaling_type(rope_scaling: dict) -> str | None:
    """The scaling kind of a ``rope_scaling`` dict (``rope_type``, or the older ``type`` key)."""
    return rope_scaling.get("rope_type", rope_scaling.get("type"))


def read_rope_settings(config: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from a Hugging Face config dict.

    Handles both formats: transformers 4.x (``rope_theta`` and ``rope_scaling`` at the top
    level) and 5.x (one ``rope_parameters`` dict holding ``rope_theta`` and the scaling keys).
    ``rope_scaling`` is None for plain RoPE (absent, null, or ``rope_type`` "default").
    """
    parameters = config.get("rope_parameters")
    if parameters is not None:
        if any(isinstance(value, dict) for value in parameters.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported: {parameters}")
        rope_theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = parameters
    else:
        rope_theta = config.get("rope_theta", 10000.0)
        scaling = config.get("rope_scaling") or {}
    scaling = {key: value for key, value in scaling.items() if key != "rope_theta"}
    if rope_scaling_type(scaling) in (None, "default"):
        return float(rope_theta), None
    return float(rope_theta), scaling


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and shapes of one model, validated on creation. Read from a Hugging Face
    ``config.json`` by ``neo.models.registry.config_from_hf``; the architecture is checked
    against the registry when a model is built."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # attention reaches this many tokens back; None: all
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    name: str = field(default="", compare=False)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.head_dim % 16 or self.head_dim > 256:
            raise ValueError(f"head_dim {self.head_dim} is not supported: neo's attention kernels "
                             f"need a multiple of 16 up to 256")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or null, got {self.sliding_window}")
        if self.rope_scaling is not None:
            kind = rope_scaling_type(self.rope_scaling)
            if kind not in ("llama3", "default"):
                raise ValueError(f"rope scaling type {kind!r} is not supported (supported: "
                                 f"llama3)")
            missing = [key for key in LLAMA3_ROPE_KEYS if key not in self.rope_scaling]
            if kind == "llama3" and missing:
                raise ValueError(f"llama3 rope scaling needs {', '.join(missing)}; got "
                                 f"{self.rope_scaling}")

    @property
    def shape_key(self) -> list:
        """The shapes a stage-time table depends on, as its key names them: architecture, hidden
        and intermediate size, layers, query and KV heads, head_dim, vocabulary."""
        return [self.architecture, self.hidden_size, self.intermediate_size, self.num_layers,
                self.num_heads, self.num_kv_heads, self.head_dim, self.vocab_size]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V one token occupies over all layers."""
        element = (dtype or self.dtype).itemsize
        return 2 * self.num_layers * self.kv_size * element

    def context_length(self, max_positions: int | None = None) -> int:
        """The positions a model built for ``max_positions`` serves: ``max_positions`` capped
        at ``max_position_embeddings`` (None: ``max_position_embeddings``).

        neo's attention is full causal attention. A model with a ``sliding_window`` attends
        only to the last ``sliding_window`` positions; the two agree while every sequence fits
        in the window, so a window below the context length is a ``ValueError``.
        """
        if max_positions is not None and max_positions <= 0:
            raise ValueError(f"max_positions must be positive, got {max_positions}")
        length = self.max_position_embeddings
        if max_positions is not None:
            length = min(length, max_positions)
        if self.sliding_window is not None and self.sliding_window < length:
            source = ("max_positions (the engine's max_model_len)" if max_positions is not None
                      and max_positions < self.max_position_embeddings
                      else "max_position_embeddings")
            raise ValueError(
                f"{self.name or self.architecture} attends within a sliding window of "
                f"{self.sliding_window} tokens, but the context length in use is {length} tokens "
                f"(its {source}); neo has no sliding-window attention and matches the model only "
                f"while every sequence fits in the window: pass max_model_len <= "
                f"{self.sliding_window}")
        return length
