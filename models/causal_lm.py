"""``CausalLM``: embeddings, the family's decoder layers, final norm and LM head.

The model reads top to bottom like the paper's figure::

    embed -> for each layer: pre_attention -> attention -> post_attention -> final_norm -> logits

The decoder-layer class comes from the architecture's registry row (``registry.py``); the
rest is the same for every family. ``forward`` runs the stages in sequence; a pipeline calls
``embed``, the layers' stages, ``final_norm`` and ``compute_logits`` itself (the contract is
written down in ``interface.py``).

With a tensor-parallel group (``parallel.py``) the model holds one rank's part: its layers hold
the rank's heads and MLP columns (``rank_config``), the embedding table and LM head its
vocabulary rows; ``embed`` and ``compute_logits`` join the ranks' parts, so every rank sees the
whole hidden states and the whole logits.
"""

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata
from .checkpoint import CheckpointTarget, split, whole
from .config import ModelConfig
from .interface import DecoderLayerInterface, missing_members
from .parallel import TensorParallel, rank_config
from .parameters import empty_parameter
from .registry import model_family
from .rotary import RotaryEmbedding


class CausalLM(torch.nn.Module):
    """A decoder-only causal language model of any registered family.

    Weights: ``embed_tokens_weight`` ``[vocab, hidden]``, ``layers``, ``final_norm_weight``
    ``[hidden]``, ``lm_head_weight`` ``[vocab, hidden]`` (the same Parameter as
    ``embed_tokens_weight`` when ``tie_word_embeddings``). ``rotary`` holds the float32
    cos/sin table shared by all layers, one row per position below ``max_positions``.

    ``config`` is the whole model's; ``rank_config`` the shapes this rank holds (``config``
    itself on one rank): ``vocab`` above is ``rank_config.vocab_size``, and the KV cache of a
    rank holds ``rank_config.num_kv_heads`` heads.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int | None = None, parallel: TensorParallel | None = None):
        """``max_positions`` caps the context length below ``max_position_embeddings``; it must
        fit the model's sliding window, if it has one (``ModelConfig.context_length``).
        ``parallel``: the tensor-parallel group this model is one rank of (None: one rank); its
        size must divide the heads, KV heads, intermediate size and vocabulary (a
        ``ValueError`` lists the sizes that do)."""
        super().__init__()
        self.config = config
        self.parallel = parallel or TensorParallel()
        self.rank_config = rank_config(config, self.parallel.size)
        hidden, vocab = config.hidden_size, self.rank_config.vocab_size
        layer_class = model_family(config.architecture, source=config.name).layer_class
        self.rotary = RotaryEmbedding(config, device, config.context_length(max_positions))
        self.embed_tokens_weight = empty_parameter((vocab, hidden), dtype, device)
        self.layers = torch.nn.ModuleList(
            layer_class(self.rank_config, self.rotary, dtype, device, self.parallel)
            for _ in range(config.num_layers))
        missing = missing_members(self.layers[0], DecoderLayerInterface)
        if missing:
            raise TypeError(f"{layer_class.__name__}, the layer of {config.architecture}, lacks "
                            f"{', '.join(missing)} of the layer interface (models/interface.py)")
        self.final_norm_weight = empty_parameter((hidden,), dtype, device)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens_weight
        else:
            self.lm_head_weight = empty_parameter((vocab, hidden), dtype, device)

    @property
    def max_positions(self) -> int:
        """Positions below this have rotary entries; a sequence may not grow beyond it."""
        return self.rotary.num_positions

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` token ids -> ``[T, hidden]`` embeddings (model dtype).

        On several ranks each embeds the ids of its vocabulary rows (the other rows are zero)
        and an all-reduce sums the ranks' rows."""
        if self.parallel.size == 1:
            return F.embedding(input_ids, self.embed_tokens_weight)
        rows = self.rank_config.vocab_size
        local_ids = input_ids - self.parallel.rank * rows
        elsewhere = (local_ids < 0) | (local_ids >= rows)
        hidden = F.embedding(local_ids.masked_fill(elsewhere, 0), self.embed_tokens_weight)
        return self.parallel.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(1), 0))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """All layers in sequential stage order for a sub-batch without host decodes.

        input_ids int64 ``[T]`` (``meta.num_rows``: padding rows included); kv_caches one
        ``(k_cache, v_cache)`` per layer. Returns the final-normed hidden states ``[T, hidden]``.
        """
        if meta.num_host_decodes:
            raise ValueError(f"CausalLM.forward runs compute-device attention only, but the batch "
                             f"has {meta.num_host_decodes} host decodes; the pipeline executor "
                             f"runs those stage by stage")
        if input_ids.shape != (meta.num_rows,):
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}, the metadata "
                             f"describes {meta.num_rows} rows")
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden, residual = self.embed(input_ids), None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            q, k, v, residual = layer.pre_attention(hidden, residual, meta, k_cache, v_cache)
            attn_out = layer.attention(q, k, v, meta, k_cache, v_cache)
            hidden, residual = layer.post_attention(attn_out, residual, meta)
        return self.final_norm(hidden, residual)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``rms_norm(residual + hidden)`` ``[T, hidden]`` (both arguments are updated in place)."""
        torch.ops.neo.fused_add_rms_norm(hidden, residual, self.final_norm_weight,
                                         self.config.rms_norm_eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` final-normed states -> float32 logits ``[N, config.vocab_size]`` (on
        several ranks: each rank's vocabulary rows, all-gathered in rank order)."""
        return self.parallel.gather_columns(F.linear(hidden, self.logits_weight())).float()

    def logits_weight(self) -> torch.nn.Parameter:
        """The weight of the logits GEMM ``compute_logits`` runs: ``[vocab, hidden]`` (this
        rank's vocabulary rows) in the model's dtype and device (the embedding table when the
        embeddings are tied)."""
        return self.lm_head_weight

    def checkpoint_targets(self) -> dict[str, CheckpointTarget]:
        """Hugging Face tensor name -> its place in the model, for every tensor a checkpoint
        must hold (``lm_head.weight`` only when the embeddings are not tied): this rank's part
        of each."""
        shard = (self.parallel.rank, self.parallel.size)
        targets = {"model.embed_tokens.weight": split(self.embed_tokens_weight, 0, *shard),
                   "model.norm.weight": whole(self.final_norm_weight)}
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = split(self.lm_head_weight, 0, *shard)
        for index, layer in enumerate(self.layers):
            prefix = f"model.layers.{index}."
            targets.update({prefix + name: target
                            for name, target in layer.checkpoint_targets().items()})
        return targets


def count_parameters(config: ModelConfig) -> int:
    """Weights of a model of ``config`` (a tied LM head counted once), counted on a model built
    on the meta device, so every family's own weights count."""
    model = CausalLM(config, dtype=config.dtype, device="meta", max_positions=1)
    return sum(parameter.numel() for parameter in model.parameters())
