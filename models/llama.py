"""The Llama family (Llama 2, Llama 3.x, Qwen2) with each decoder layer split into stages.

One class covers ``LlamaForCausalLM`` and ``Qwen2ForCausalLM``; the differences are config
flags (``qkv_bias``, ``o_proj_bias``, ``mlp_bias``, ``tie_word_embeddings``) and the rotary
settings. The model reads top to bottom like the paper's figure::

    embed -> for each layer: pre_attention -> attention -> post_attention -> final_norm -> logits

Each stage is a separate method so a pipeline can interleave two sub-batches and run the
decode attention of some tokens on the host CPU (rows of CPU decodes are left to the caller).
Tensors are token-major: a sub-batch of ``T`` tokens is ``[T, hidden]``, laid out as
``[prefill tokens | GPU decodes | CPU decodes]`` (see ``AttentionMetadata``).

Parameters are created empty on the target device and dtype (no host copy, no init pass);
the loader fills them. Kernels are ``torch.ops.neo.*``; GEMMs are ``torch.nn.functional.linear``.
"""

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata
from .config import ModelConfig

from .rotary import RotaryEmbedding


def _parameter(shape, dtype, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _optional_parameter(present: bool, shape, dtype, device) -> torch.nn.Parameter | None:
    return _parameter(shape, dtype, device) if present else None


class DecoderLayer(torch.nn.Module):
    """One transformer block, split into ``pre_attention``, ``attention``, ``post_attention``.

    Weights (``dtype``, on the model's device):

    - ``input_norm_weight`` ``[hidden]``, ``post_attention_norm_weight`` ``[hidden]``
    - ``qkv_proj_weight`` ``[q_size + 2 * kv_size, hidden]`` (rows: q | k | v), optional
      ``qkv_proj_bias`` ``[q_size + 2 * kv_size]``
    - ``o_proj_weight`` ``[hidden, q_size]``, optional ``o_proj_bias`` ``[hidden]``
    - ``gate_up_proj_weight`` ``[2 * intermediate, hidden]`` (rows: gate | up), optional
      ``gate_up_proj_bias`` ``[2 * intermediate]``
    - ``down_proj_weight`` ``[hidden, intermediate]``, optional ``down_proj_bias`` ``[hidden]``
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.config = config
        self.rotary = rotary
        self.scale = config.head_dim ** -0.5
        hidden, intermediate = config.hidden_size, config.intermediate_size
        qkv_rows = config.q_size + 2 * config.kv_size
        self.input_norm_weight = _parameter((hidden,), dtype, device)
        self.qkv_proj_weight = _parameter((qkv_rows, hidden), dtype, device)
        self.qkv_proj_bias = _optional_parameter(config.qkv_bias, (qkv_rows,), dtype, device)
        self.o_proj_weight = _parameter((hidden, config.q_size), dtype, device)
        self.o_proj_bias = _optional_parameter(config.o_proj_bias, (hidden,), dtype, device)
        self.post_attention_norm_weight = _parameter((hidden,), dtype, device)
        self.gate_up_proj_weight = _parameter((2 * intermediate, hidden), dtype, device)
        self.gate_up_proj_bias = _optional_parameter(config.mlp_bias, (2 * intermediate,), dtype,
                                                     device)
        self.down_proj_weight = _parameter((hidden, intermediate), dtype, device)
        self.down_proj_bias = _optional_parameter(config.mlp_bias, (hidden,), dtype, device)

    def gemm_weights(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter | None]]:
        """``(weight, bias)`` of each GEMM the layer runs (QKV, O, gate/up, down); bias None
        where absent."""
        return [(self.qkv_proj_weight, self.qkv_proj_bias), (self.o_proj_weight, self.o_proj_bias),
                (self.gate_up_proj_weight, self.gate_up_proj_bias), (self.down_proj_weight, self.down_proj_bias)]

    def pre_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                      meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, QKV projection, rotary embedding, and storing the new K/V in the cache.

        hidden ``[T, hidden]``: the embeddings (layer 0, ``residual`` None) or the previous
        layer's MLP output, which is normalized in place. residual ``[T, hidden]`` or None; it
        is updated in place (``residual += hidden``) and returned. k_cache, v_cache
        ``[num_blocks, KVH, block_size, D]``: every token whose ``meta.slot_mapping`` entry is
        not -1 has its K/V written there.

        Returns contiguous ``q [T, H, D]``, ``k [T, KVH, D]``, ``v [T, KVH, D]`` (rotary
        applied to q and k) and the residual.
        """
        epsilon = self.config.rms_norm_eps
        if residual is None:
            residual = hidden
            hidden = torch.empty_like(residual)
            torch.ops.neo.rms_norm(hidden, residual, self.input_norm_weight, epsilon)
        else:
            torch.ops.neo.fused_add_rms_norm(hidden, residual, self.input_norm_weight, epsilon)
        qkv = F.linear(hidden, self.qkv_proj_weight, self.qkv_proj_bias)
        num_tokens = qkv.shape[0]
        config = self.config
        q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
        q = q.reshape(num_tokens, config.num_heads, config.head_dim).contiguous()
        k = k.reshape(num_tokens, config.num_kv_heads, config.head_dim).contiguous()
        v = v.reshape(num_tokens, config.num_kv_heads, config.head_dim).contiguous()
        self.rotary(meta.positions, q, k)
        torch.ops.neo.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return q, k, v, residual

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the compute-device tokens; returns ``out [T, H, D]`` (q's dtype), into
        ``out`` when given.

        Rows ``[0, num_prefill_tokens)``: causal attention of each prompt over itself (from
        ``k``/``v``; no prefix cache). Rows ``[num_prefill_tokens, num_gpu_tokens)``: paged decode
        attention over ``k_cache``/``v_cache``. Rows ``[num_gpu_tokens, T)`` (CPU decodes) are
        left unwritten for the caller to fill.
        """
        out = torch.empty_like(q) if out is None else out
        prefill_end, gpu_end = meta.num_prefill_tokens, meta.num_gpu_tokens
        if prefill_end:
            torch.ops.neo.prefill_attention(out[:prefill_end], q[:prefill_end], k[:prefill_end],
                                            v[:prefill_end], meta.prefill_cu_seqlens,
                                            meta.max_prefill_len, self.scale)
        if gpu_end > prefill_end:
            torch.ops.neo.paged_decode_attention(out[prefill_end:gpu_end], q[prefill_end:gpu_end],
                                                 k_cache, v_cache, meta.gpu_block_table,
                                                 meta.gpu_seq_lens, self.scale)
        return out

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """O projection, add + norm, gated MLP.

        attn_out ``[T, H, D]``; residual ``[T, hidden]`` (updated in place and returned).
        Returns the MLP output ``[T, hidden]`` (not yet added to the residual: the next
        layer's ``pre_attention`` or ``CausalLM.final_norm`` does that) and the residual.
        ``meta`` is unused; it keeps the three stages' signatures alike.
        """
        hidden = F.linear(attn_out.reshape(attn_out.shape[0], self.config.q_size),
                          self.o_proj_weight, self.o_proj_bias)
        torch.ops.neo.fused_add_rms_norm(hidden, residual, self.post_attention_norm_weight,
                                         self.config.rms_norm_eps)
        gate_up = F.linear(hidden, self.gate_up_proj_weight, self.gate_up_proj_bias)
        activated = gate_up.new_empty(gate_up.shape[0], self.config.intermediate_size)
        torch.ops.neo.silu_and_mul(activated, gate_up)
        return F.linear(activated, self.down_proj_weight, self.down_proj_bias), residual


class CausalLM(torch.nn.Module):
    """A Llama-family causal language model.

    Weights: ``embed_tokens_weight`` ``[vocab, hidden]``, ``layers``, ``final_norm_weight``
    ``[hidden]``, ``lm_head_weight`` ``[vocab, hidden]`` (the same Parameter as
    ``embed_tokens_weight`` when ``tie_word_embeddings``). ``rotary`` holds the float32
    cos/sin table shared by all layers.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int | None = None):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.rotary = RotaryEmbedding(config, device, max_positions)
        self.embed_tokens_weight = _parameter((config.vocab_size, hidden), dtype, device)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, self.rotary, dtype, device) for _ in range(config.num_layers))
        self.final_norm_weight = _parameter((hidden,), dtype, device)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens_weight
        else:
            self.lm_head_weight = _parameter((config.vocab_size, hidden), dtype, device)

    @property
    def max_positions(self) -> int:
        """Positions below this have rotary entries; a sequence may not grow beyond it."""
        return self.rotary.num_positions

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` token ids -> ``[T, hidden]`` embeddings (model dtype)."""
        return F.embedding(input_ids, self.embed_tokens_weight)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """All layers in sequential stage order for a sub-batch without CPU decodes.

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
        """``[N, hidden]`` final-normed states -> float32 logits ``[N, vocab]``."""
        return F.linear(hidden, self.lm_head_weight).float()
