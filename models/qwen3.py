"""The Qwen3 decoder layer: the Llama layer with an RMSNorm over each query and key head.

Qwen3 normalizes every head of q and of k over its ``head_dim`` features (one weight
``[head_dim]`` for all query heads, one for all key heads, epsilon ``rms_norm_eps``) after the
QKV projection and before rotary; v is left as projected. The rest of the block, the
attention and its softmax scale ``head_dim ** -0.5`` are Llama's. ``head_dim`` is explicit in
Qwen3 configs and need not equal ``hidden / num_heads``.
"""

import torch

from .checkpoint import CheckpointTarget, whole
from .config import ModelConfig
from .llama import DecoderLayer
from .parallel import TensorParallel
from .parameters import empty_parameter
from .rotary import RotaryEmbedding


class Qwen3DecoderLayer(DecoderLayer):
    """``DecoderLayer`` plus ``q_norm_weight`` and ``k_norm_weight`` ``[head_dim]`` (``dtype``).

    The norms run as ``torch.ops.neo.rms_norm`` over ``[T * heads, head_dim]`` rows, one row
    per head of each token.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device | str, parallel: TensorParallel | None = None):
        super().__init__(config, rotary, dtype, device, parallel)
        self.q_norm_weight = empty_parameter((config.head_dim,), dtype, device)
        self.k_norm_weight = empty_parameter((config.head_dim,), dtype, device)

    def checkpoint_targets(self) -> dict[str, CheckpointTarget]:
        """The Llama layer's tensors plus ``self_attn.q_norm.weight`` and
        ``self_attn.k_norm.weight``."""
        return super().checkpoint_targets() | {
            "self_attn.q_norm.weight": whole(self.q_norm_weight),
            "self_attn.k_norm.weight": whole(self.k_norm_weight)}

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The QKV projection ``[T, q_size + 2 * kv_size]`` -> contiguous ``q [T, H, D]`` and
        ``k [T, KVH, D]``, each head RMS-normalized, and ``v [T, KVH, D]``, a view of ``qkv``
        (see ``DecoderLayer.split_heads``)."""
        q, k, v = super().split_heads(qkv)
        return (self._normalize_heads(q, self.q_norm_weight),
                self._normalize_heads(k.contiguous(), self.k_norm_weight), v)

    def _normalize_heads(self, heads: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's features: contiguous ``heads [T, N, D]`` -> a new contiguous
        ``[T, N, D]`` (same dtype), ``weight [D]``."""
        normalized = torch.empty(heads.shape, dtype=heads.dtype, device=heads.device)
        rows = heads.shape[0] * heads.shape[1]
        head_dim = self.config.head_dim
        torch.ops.neo.rms_norm(normalized.view(rows, head_dim), heads.view(rows, head_dim), weight,
                               self.config.rms_norm_eps)
        return normalized
