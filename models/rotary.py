"""Rotary position embedding: the cos/sin table that ``torch.ops.neo.rotary_embedding`` reads.

The table is computed the way Hugging Face transformers computes it for Llama, Qwen2, Qwen3
and Mistral, so float32 results agree with it to the last bit or so: inverse frequencies
``1 / theta ** (arange(0, D, 2) / D)`` in float32 (optionally reshaped by the ``llama3`` rope
scaling of Llama 3.1+), angles ``position * inverse_frequency`` in float32, then cos and sin.
It is always computed on the CPU (the same numbers on every device) and then moved.
"""

import math

import torch

from .config import ModelConfig, rope_scaling_type


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 ``[head_dim / 2]``: the rotation speed of each feature pair."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    frequencies = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is not None and rope_scaling_type(config.rope_scaling) == "llama3":
        frequencies = _llama3_scaled(frequencies, config.rope_scaling)
    return frequencies


def _llama3_scaled(frequencies: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency reshaping.

    Wavelengths shorter than ``original / high_freq_factor`` are kept, those longer than
    ``original / low_freq_factor`` are divided by ``factor``; in between the two are blended
    linearly in ``original / wavelength``.
    """
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_length = scaling["original_max_position_embeddings"]
    low_freq_wavelength = original_length / low_freq_factor
    high_freq_wavelength = original_length / high_freq_factor

    wavelengths = 2 * math.pi / frequencies
    scaled = torch.where(wavelengths > low_freq_wavelength, frequencies / factor, frequencies)
    blend = (original_length / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = (wavelengths >= high_freq_wavelength) & (wavelengths <= low_freq_wavelength)
    return torch.where(in_between, blended, scaled)


def cos_sin_table(config: ModelConfig, num_positions: int) -> torch.Tensor:
    """float32 ``[num_positions, head_dim]`` on the CPU: cos in the first half, sin in the
    second."""
    positions = torch.arange(num_positions, dtype=torch.int64).to(torch.float32)
    angles = positions[:, None] * inverse_frequencies(config)[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Holds the cos/sin table (a non-persistent float32 buffer) on the model's device.

    The table has ``num_positions`` rows (the model's context length,
    ``ModelConfig.context_length``), so a model served with short contexts does not hold 128K
    rows. Positions must stay below ``num_positions``. Build the model on its final device:
    ``.to(dtype)`` on the model would also convert this table, which must stay float32.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str, num_positions: int):
        super().__init__()
        self.num_positions = num_positions
        device = torch.device(device)
        if device.type == "meta":
            table = torch.empty(num_positions, config.head_dim, dtype=torch.float32, device=device)
        else:
            table = cos_sin_table(config, num_positions).to(device)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """Rotate ``query [T, H, D]`` and ``key [T, KVH, D]`` in place; positions int64 ``[T]``."""
        torch.ops.neo.rotary_embedding(positions, query, key, self.cos_sin_cache)
