"""``AttentionMetadata``: what the layer stages of one sub-batch need to know about its tokens.

Token order inside a sub-batch (``T`` rows in all)::

    [ prefill tokens (prompts packed back to back) | GPU decodes | CPU decodes | padding ]
      num_prefill_tokens                             num_gpu_decodes num_cpu_decodes num_padding_tokens

Padding rows (see ``neo.gemm_rows``) only fill the GEMMs' rows up to a bucket: their slot is -1,
no stage attends for them, and their outputs are never read.

"GPU" means the compute device and its KV cache (the CPU itself on a machine without CUDA);
"CPU" means the host KV cache, whose decode attention the pipeline runs on the host CPU.
The model's stages use the compute-device fields; the pipeline executor uses the host fields.
Two sub-batches can be in flight at once, so this object is always passed explicitly.
"""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-sub-batch metadata; tensors on the compute device unless the name says ``host``."""

    num_prefill_tokens: int
    num_gpu_decodes: int
    num_host_decodes: int
    positions: torch.Tensor  # int64 [T]: position of each token in its sequence
    slot_mapping: torch.Tensor  # int64 [T]: slot in the compute-device cache, -1 = not stored there
    prefill_cu_seqlens: torch.Tensor  # int32 [num_prefills + 1]
    max_prefill_len: int
    gpu_block_table: torch.Tensor  # int32 [num_gpu_decodes, max_blocks]
    gpu_seq_lens: torch.Tensor  # int32 [num_gpu_decodes], current token included
    # Host side: CPU decodes (host tensors) and prefill tokens whose K/V goes to the host cache.
    host_block_table: torch.Tensor  # int32 [num_cpu_decodes, max_blocks]
    host_seq_lens: torch.Tensor  # int32 [num_cpu_decodes], current token included
    host_slot_mapping: torch.Tensor  # int64 [num_cpu_decodes]: host-cache slot of each new token
    num_offloaded_prefill_tokens: int  # prefill tokens of requests bound for the host pool
    # int64 [num_prefill_tokens] (compute device): host-cache slot of each prefill token bound
    # for the host pool, -1 for the others; empty when none is.
    prefill_host_slot_mapping: torch.Tensor
    num_padding_tokens: int = 0  # rows after the CPU decodes (see the module docstring)

    @classmethod
    def for_captured_decodes(cls, positions: torch.Tensor, slot_mapping: torch.Tensor,
                             gpu_block_table: torch.Tensor, gpu_seq_lens: torch.Tensor,
                             num_host_decodes: int) -> "AttentionMetadata":
        """Decodes only, for a CUDA graph capture: the compute-device fields are the graph's
        static buffers (``positions``/``slot_mapping`` one row per token, the GPU decodes
        first); the host fields are empty (host functions read theirs from the executor)."""
        device = positions.device
        empty_int32, empty_int64 = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
        return cls(
            num_prefill_tokens=0, num_gpu_decodes=gpu_block_table.shape[0], num_host_decodes=num_host_decodes,
            positions=positions, slot_mapping=slot_mapping,
            prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device), max_prefill_len=0,
            gpu_block_table=gpu_block_table, gpu_seq_lens=gpu_seq_lens,
            host_block_table=torch.empty((0, 0), dtype=torch.int32), host_seq_lens=empty_int32,
            host_slot_mapping=empty_int64,
            num_offloaded_prefill_tokens=0,
            prefill_host_slot_mapping=torch.empty(0, dtype=torch.int64, device=device))

    @property
    def num_tokens(self) -> int:
        """Real tokens (padding excluded)."""
        return self.num_prefill_tokens + self.num_gpu_decodes + self.num_host_decodes

    @property
    def num_rows(self) -> int:
        """``T``: the rows of the sub-batch's token-major tensors, padding included."""
        return self.num_tokens + self.num_padding_tokens

    @property
    def num_gpu_tokens(self) -> int:
        """Tokens whose attention runs on the compute device (prefills and GPU decodes)."""
        return self.num_prefill_tokens + self.num_gpu_decodes
