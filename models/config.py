"""``ModelConfig``: the shape of a Llama-family model, read from a Hugging Face ``config.json``."""

import json
import os
from dataclasses import dataclass, field

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")

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
    """Architecture and shapes of one model. Validated on creation."""

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
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    name: str = field(default="", compare=False)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; neo supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
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
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V one token occupies over all layers."""
        element = (dtype or self.dtype).itemsize
        return 2 * self.num_layers * self.kv_size * element

    def num_parameters(self) -> int:
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attention + mlp + 2 * self.hidden_size) + embeddings + self.hidden_size

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "") -> "ModelConfig":
        """Build from the dict of a Hugging Face ``config.json``."""
        architectures = config.get("architectures") or [config.get("model_type", "?")]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r} in {name or 'config'}; "
                             f"neo supports {', '.join(SUPPORTED_ARCHITECTURES)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; neo's MLP is "
                             f"SiLU-gated")
        if config.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        num_heads = config["num_attention_heads"]
        hidden_size = config["hidden_size"]
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(config.get("attention_bias", False))
        dtype_name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        rope_theta, rope_scaling = read_rope_settings(config)
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=parse_dtype(dtype_name),
            name=name,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "ModelConfig":
        """Read ``path/config.json``."""
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in model directory {path!r}")
        with open(config_path) as file:
            return cls.from_hf_config(json.load(file), name=os.path.basename(os.path.normpath(path)))
