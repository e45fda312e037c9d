"""What the engine calls on a model and on its decoder layers, written down as Protocols.

``CausalLM`` (``causal_lm.py``) and every registered layer class (``DecoderLayer`` and its
subclasses) satisfy these; a new family's layer must too. Tensors are token-major: a
sub-batch of ``T`` rows is ``[T, hidden]`` in the model's dtype, its rows laid out as
``[prefill tokens | GPU decodes | host decodes | padding]`` (``AttentionMetadata``). ``H`` is
``num_heads``, ``KVH`` ``num_kv_heads``, ``D`` ``head_dim``. KV caches are
``[num_blocks, KVH, block_size, D]`` per layer, in the cache dtype.

The stages of one layer run in this order for a sub-batch; between ``pre_attention`` and
``post_attention`` the pipeline may copy K/V to the host cache and fill the host-decode rows
of the attention output with host attention over ``q`` (softmax scale ``layer.scale``)::

    q, k, v, residual = layer.pre_attention(hidden, residual, meta, k_cache, v_cache)
    attn_out = layer.attention(q, k, v, meta, k_cache, v_cache, out=...)
    hidden, residual = layer.post_attention(attn_out, residual, meta)
"""

from typing import Protocol, Sequence

import torch

from .attention_metadata import AttentionMetadata
from .checkpoint import CheckpointTarget
from .config import ModelConfig
from .parallel import TensorParallel


class DecoderLayerInterface(Protocol):
    """One decoder layer, split into the stages a pipeline interleaves."""

    config: ModelConfig
    scale: float  # softmax scale of attention; host attention of this layer uses it too

    def pre_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                      meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before attention, and storing the sub-batch's K/V.

        hidden ``[T, hidden]``: the embeddings (first layer, ``residual`` None) or the previous
        layer's output (may be overwritten). residual ``[T, hidden]`` or None; updated in place
        and returned. K/V of rows whose ``meta.slot_mapping`` is not -1 are written to
        ``k_cache`` / ``v_cache``. Returns ``q [T, H, D]`` (contiguous), ``k [T, KVH, D]``,
        ``v [T, KVH, D]`` (each head's features contiguous; the token stride may be wider, e.g.
        views of a fused projection) in the model dtype, position encoding applied, ready for
        attention and for the host cache, and the residual.
        """
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the compute-device rows: ``out [T, H, D]`` (q's dtype; into ``out`` when
        given). Prefill rows attend causally within their prompt, GPU-decode rows over the paged
        cache; host-decode and padding rows are left unwritten."""
        ...

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after attention: ``attn_out [T, H, D]`` and ``residual [T, hidden]``
        (updated in place) -> the layer's output ``[T, hidden]`` (not yet added to the
        residual: the next ``pre_attention`` or ``final_norm`` adds it) and the residual."""
        ...

    def gemm_weights(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter | None]]:
        """``(weight [out, in], bias [out] or None)`` of every GEMM the layer runs, so the
        engine can warm up each shape; every layer of a model returns the same shapes."""
        ...

    def checkpoint_targets(self) -> dict[str, CheckpointTarget]:
        """Hugging Face tensor name relative to the layer (``self_attn.q_proj.weight``) -> its
        place in the layer's parameters, for every tensor a checkpoint must hold."""
        ...


class CausalLMInterface(Protocol):
    """A causal language model: embeddings, ``layers``, final norm, logits.

    Under tensor parallelism (``parallel.py``) it is one rank's part: ``config`` is the whole
    model's shapes, ``rank_config`` the part this rank holds (the KV heads its caches hold; the
    same object on one rank), ``parallel`` the rank's place in its group."""

    config: ModelConfig
    rank_config: ModelConfig
    parallel: TensorParallel
    layers: Sequence[DecoderLayerInterface]

    @property
    def max_positions(self) -> int:
        """Positions below this have position encodings; no sequence grows beyond it."""
        ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` token ids -> ``[T, hidden]`` (model dtype)."""
        ...

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output and the residual ``[T, hidden]`` (both may be overwritten)
        -> final-normed hidden states ``[T, hidden]``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed ``[N, hidden]`` -> float32 logits ``[N, vocab]``."""
        ...

    def logits_weight(self) -> torch.nn.Parameter:
        """The ``[vocab, hidden]`` weight (model dtype and device; this rank's vocabulary rows)
        of the GEMM ``compute_logits`` runs, so the engine can warm up its shapes."""
        ...

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every layer's stages in sequence for a sub-batch without host decodes: int64
        ``input_ids [T]`` (``meta.num_rows``), one ``(k_cache, v_cache)`` per layer ->
        final-normed hidden states ``[T, hidden]``."""
        ...

    def parameters(self, recurse: bool = True):
        """Every weight (``torch.nn.Module.parameters``); all share the model's dtype and
        device."""
        ...

    def checkpoint_targets(self) -> dict[str, CheckpointTarget]:
        """Hugging Face tensor name -> its place in the model's parameters, for every tensor a
        checkpoint must hold."""
        ...


def interface_members(protocol: type) -> list[str]:
    """The attributes and methods ``protocol`` declares."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {name for name, value in vars(protocol).items()
              if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return sorted(names)


def missing_members(component, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``component`` (a model or a layer) lacks. (Looked up the
    way the engine reaches them: a ``torch.nn.Module``'s submodules and parameters are
    attributes only through its ``__getattr__``, which ``isinstance`` on a Protocol does not
    consult.)"""
    return [name for name in interface_members(protocol) if not hasattr(component, name)]
