"""The Llama decoder layer (Llama 2, Llama 3.x, Qwen2, Mistral), split into stages.

One class covers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``MistralForCausalLM``; the
differences are config flags (``qkv_bias``, ``o_proj_bias``, ``mlp_bias``) and the rotary
settings, which the registry (``registry.py``) reads per family. Families whose block differs
further subclass ``DecoderLayer`` (``qwen3.py``). ``CausalLM`` (``causal_lm.py``) stacks the
layers; the model reads top to bottom like the paper's figure::

    embed -> for each layer: pre_attention -> attention -> post_attention -> final_norm -> logits

Each stage is a separate method so a pipeline can interleave two sub-batches and run the
decode attention of some tokens on the host CPU (rows of host decodes are left to the caller).
Tensors are token-major: a sub-batch of ``T`` tokens is ``[T, hidden]``, laid out as
``[prefill tokens | GPU decodes | host decodes]`` (see ``AttentionMetadata``).

Parameters are created empty on the target device and dtype (no host copy, no init pass);
the loader fills them. Kernels are ``torch.ops.neo.*``; GEMMs are ``torch.nn.functional.linear``.

Under tensor parallelism (``parallel.py``) a layer holds one rank's heads and MLP columns: its
``config`` is the rank's shapes (``rank_config``), and the O and down projections sum their
partial products over the ranks (``TensorParallel.row_parallel_linear``).
"""

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata
from .checkpoint import CheckpointTarget, row_pieces, split, whole
from .config import ModelConfig
from .parallel import TensorParallel
from .parameters import empty_parameter, optional_parameter
from .rotary import RotaryEmbedding


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

    Sizes are this rank's (``config`` is ``rank_config`` of the model's): ``q_size``,
    ``kv_size`` and ``intermediate`` are the unsplit model's divided by ``parallel.size``.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device | str, parallel: TensorParallel | None = None):
        super().__init__()
        self.config = config
        self.parallel = parallel or TensorParallel()
        self.rotary = rotary
        self.scale = config.head_dim ** -0.5
        hidden, intermediate = config.hidden_size, config.intermediate_size
        qkv_rows = config.q_size + 2 * config.kv_size
        self.input_norm_weight = empty_parameter((hidden,), dtype, device)
        self.qkv_proj_weight = empty_parameter((qkv_rows, hidden), dtype, device)
        self.qkv_proj_bias = optional_parameter(config.qkv_bias, (qkv_rows,), dtype, device)
        self.o_proj_weight = empty_parameter((hidden, config.q_size), dtype, device)
        self.o_proj_bias = optional_parameter(config.o_proj_bias, (hidden,), dtype, device)
        self.post_attention_norm_weight = empty_parameter((hidden,), dtype, device)
        self.gate_up_proj_weight = empty_parameter((2 * intermediate, hidden), dtype, device)
        self.gate_up_proj_bias = optional_parameter(config.mlp_bias, (2 * intermediate,), dtype,
                                                    device)
        self.down_proj_weight = empty_parameter((hidden, intermediate), dtype, device)
        self.down_proj_bias = optional_parameter(config.mlp_bias, (hidden,), dtype, device)

    def checkpoint_targets(self) -> dict[str, CheckpointTarget]:
        """Hugging Face tensor name, relative to the layer (``self_attn.q_proj.weight``; the
        model adds ``model.layers.{i}.``) -> its place in this layer, for every tensor a
        checkpoint must hold: this rank's part of each (``checkpoint.py``)."""
        config = self.config
        shard = (self.parallel.rank, self.parallel.size)
        targets = {"input_layernorm.weight": whole(self.input_norm_weight),
                   "post_attention_layernorm.weight": whole(self.post_attention_norm_weight)}
        qkv_pieces = [("q_proj", config.q_size), ("k_proj", config.kv_size),
                      ("v_proj", config.kv_size)]
        gate_up_pieces = [("gate_proj", config.intermediate_size),
                          ("up_proj", config.intermediate_size)]
        for suffix in ("weight", "bias"):
            qkv = getattr(self, f"qkv_proj_{suffix}")
            gate_up = getattr(self, f"gate_up_proj_{suffix}")
            if qkv is not None:
                targets.update(row_pieces(qkv, "self_attn.", suffix, qkv_pieces, *shard))
            if gate_up is not None:
                targets.update(row_pieces(gate_up, "mlp.", suffix, gate_up_pieces, *shard))
        targets["self_attn.o_proj.weight"] = split(self.o_proj_weight, 1, *shard)
        targets["mlp.down_proj.weight"] = split(self.down_proj_weight, 1, *shard)
        for name, bias in (("self_attn.o_proj.bias", self.o_proj_bias), ("mlp.down_proj.bias", self.down_proj_bias)):
            if bias is not None:
                targets[name] = whole(bias)
        return targets

    def gemm_weights(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter | None]]:
        """``(weight, bias)`` of each GEMM the layer runs (QKV, O, gate/up, down); bias None
        where absent."""
        return [(self.qkv_proj_weight, self.qkv_proj_bias), (self.o_proj_weight, self.o_proj_bias),
                (self.gate_up_proj_weight, self.gate_up_proj_bias), (self.down_proj_weight, self.down_proj_bias)]

    def pre_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                      meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm, QKV projection, ``split_heads``, rotary embedding, and storing the new K/V in
        the cache.

        hidden ``[T, hidden]``: the embeddings (layer 0, ``residual`` None) or the previous
        layer's MLP output, which is normalized in place. residual ``[T, hidden]`` or None; it
        is updated in place (``residual += hidden``) and returned. k_cache, v_cache
        ``[num_blocks, KVH, block_size, D]``: every token whose ``meta.slot_mapping`` entry is
        not -1 has its K/V written there.

        Returns ``q [T, H, D]``, ``k [T, KVH, D]``, ``v [T, KVH, D]`` as ``split_heads`` lays
        them out (rotary applied to q and k) and the residual.
        """
        epsilon = self.config.rms_norm_eps
        if residual is None:
            residual = hidden
            hidden = torch.empty_like(residual)
            torch.ops.neo.rms_norm(hidden, residual, self.input_norm_weight, epsilon)
        else:
            torch.ops.neo.fused_add_rms_norm(hidden, residual, self.input_norm_weight, epsilon)
        qkv = F.linear(hidden, self.qkv_proj_weight, self.qkv_proj_bias)
        q, k, v = self.split_heads(qkv)
        self.rotary(meta.positions, q, k)
        torch.ops.neo.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return q, k, v, residual

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The QKV projection ``[T, q_size + 2 * kv_size]`` -> ``q [T, H, D]``, ``k [T, KVH, D]``,
        ``v [T, KVH, D]``, before rotary. q is a contiguous copy (the paged decode kernels read
        it whole); k and v are views of ``qkv`` (token stride ``q_size + 2 * kv_size``), which
        the rotary embedding, the cache store and prefill attention read in place, so a decode
        step copies only the query. A family that transforms the heads before rotary
        (``qwen3.py``) overrides this."""
        num_tokens = qkv.shape[0]
        config = self.config
        q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
        return (q.reshape(num_tokens, config.num_heads, config.head_dim).contiguous(),
                k.view(num_tokens, config.num_kv_heads, config.head_dim),
                v.view(num_tokens, config.num_kv_heads, config.head_dim))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the compute-device tokens; returns ``out [T, H, D]`` (q's dtype), into
        ``out`` when given.

        Rows ``[0, num_prefill_tokens)``: causal attention of each prompt over itself (from
        ``k``/``v``; no prefix cache). Rows ``[num_prefill_tokens, num_gpu_tokens)``: paged decode
        attention over ``k_cache``/``v_cache``. Rows ``[num_gpu_tokens, T)`` (host decodes) are
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
        ``meta`` is unused; it keeps the three stages' signatures alike. Under tensor
        parallelism ``attn_out`` holds this rank's heads and the O and down projections are
        all-reduced, so every rank returns the whole ``[T, hidden]``.
        """
        parallel = self.parallel
        hidden = parallel.row_parallel_linear(attn_out.reshape(attn_out.shape[0], self.config.q_size),
                                              self.o_proj_weight, self.o_proj_bias)
        torch.ops.neo.fused_add_rms_norm(hidden, residual, self.post_attention_norm_weight,
                                         self.config.rms_norm_eps)
        gate_up = F.linear(hidden, self.gate_up_proj_weight, self.gate_up_proj_bias)
        activated = gate_up.new_empty(gate_up.shape[0], self.config.intermediate_size)
        torch.ops.neo.silu_and_mul(activated, gate_up)
        return parallel.row_parallel_linear(activated, self.down_proj_weight, self.down_proj_bias), residual
