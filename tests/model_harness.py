"""Test-only driver for the model stages: paged KV caches and ``AttentionMetadata`` per step.

Two block pools stand in for the engine's: ``device`` (the compute-device cache the model's
stages use) and ``host`` (the CPU cache whose decode attention the pipeline runs). Each
sequence lives in one pool; its blocks come from a shuffled free list, so block tables are
non-trivial. Unwritten cache slots hold a large finite poison value: attention that reads
past a sequence's length shows up as a wrong result.
"""

from dataclasses import dataclass, field

import torch

from neo.models.attention_metadata import AttentionMetadata

CACHE_POISON = 1.0e3


@dataclass
class _Pool:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    free_blocks: list[int]


@dataclass
class _Sequence:
    pool: str
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are in the cache


class PagedKVHarness:
    """Paged caches for ``num_layers`` layers and the sequences that use them.

    Caches are ``[num_blocks, num_kv_heads, block_size, head_dim]`` in ``dtype`` on ``device``
    (the host pool on the CPU).
    """

    def __init__(self, config, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", seed: int = 0):
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        generator = torch.Generator().manual_seed(seed)
        shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)

        def make_pool(pool_device) -> _Pool:
            caches = [(torch.full(shape, CACHE_POISON, dtype=dtype, device=pool_device),
                       torch.full(shape, CACHE_POISON, dtype=dtype, device=pool_device))
                      for _ in range(config.num_layers)]
            return _Pool(caches, torch.randperm(num_blocks, generator=generator).tolist())

        self.pools = {"device": make_pool(self.device), "host": make_pool("cpu")}
        self.sequences: dict[int, _Sequence] = {}

    def kv_caches(self, pool: str = "device") -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.pools[pool].kv_caches

    def _new_slots(self, sequence_id: int, count: int) -> list[int]:
        """Cache slots for the next ``count`` tokens of a sequence, allocating blocks as needed."""
        sequence = self.sequences[sequence_id]
        pool = self.pools[sequence.pool]
        slots = []
        for position in range(sequence.length, sequence.length + count):
            if position // self.block_size == len(sequence.blocks):
                sequence.blocks.append(pool.free_blocks.pop())
            slots.append(sequence.blocks[position // self.block_size] * self.block_size
                         + position % self.block_size)
        sequence.length += count
        return slots

    def _block_table(self, sequence_ids: list[int]) -> torch.Tensor:
        """int32 ``[len(sequence_ids), max_blocks]``, unused entries -1."""
        width = max([len(self.sequences[i].blocks) for i in sequence_ids], default=0)
        table = torch.full((len(sequence_ids), width), -1, dtype=torch.int32)
        for row, sequence_id in enumerate(sequence_ids):
            blocks = self.sequences[sequence_id].blocks
            table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table

    def build_step(self, prefills: list[tuple[int, str, list[int]]],
                   gpu_decodes: list[tuple[int, int]], host_decodes: list[tuple[int, int]] = ()
                   ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Token ids int64 ``[T]`` and metadata for one step.

        prefills: ``(sequence_id, pool, prompt_ids)`` of new sequences (pool ``"device"`` or
        ``"host"``); gpu_decodes / host_decodes: ``(sequence_id, token_id)`` of sequences in the
        device / host pool.
        """
        token_ids, positions, device_slots = [], [], []
        cu_seqlens, host_slots = [0], []
        for sequence_id, pool, prompt in prefills:
            self.sequences[sequence_id] = _Sequence(pool)
            slots = self._new_slots(sequence_id, len(prompt))
            token_ids += prompt
            positions += range(len(prompt))
            device_slots += slots if pool == "device" else [-1] * len(prompt)
            host_slots += [-1] * len(prompt) if pool == "device" else slots
            cu_seqlens.append(len(token_ids))
        cpu_slots = []
        for decodes, pool in ((gpu_decodes, "device"), (host_decodes, "host")):
            for sequence_id, token_id in decodes:
                sequence = self.sequences[sequence_id]
                assert sequence.pool == pool, f"sequence {sequence_id} lives in {sequence.pool}"
                positions.append(sequence.length)
                token_ids.append(token_id)
                slot = self._new_slots(sequence_id, 1)[0]
                device_slots.append(slot if pool == "device" else -1)
                if pool == "host":
                    cpu_slots.append(slot)

        def on_device(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device)

        gpu_ids = [sequence_id for sequence_id, _ in gpu_decodes]
        cpu_ids = [sequence_id for sequence_id, _ in host_decodes]
        meta = AttentionMetadata(
            num_prefill_tokens=cu_seqlens[-1],
            num_gpu_decodes=len(gpu_decodes),
            num_host_decodes=len(host_decodes),
            positions=on_device(positions, torch.int64),
            slot_mapping=on_device(device_slots, torch.int64),
            prefill_cu_seqlens=on_device(cu_seqlens, torch.int32),
            max_prefill_len=max([len(prompt) for _, _, prompt in prefills], default=0),
            gpu_block_table=self._block_table(gpu_ids).to(self.device),
            gpu_seq_lens=on_device([self.sequences[i].length for i in gpu_ids], torch.int32),
            host_block_table=self._block_table(cpu_ids),
            host_seq_lens=torch.tensor([self.sequences[i].length for i in cpu_ids],
                                           dtype=torch.int32),
            host_slot_mapping=torch.tensor(cpu_slots, dtype=torch.int64),
            num_offloaded_prefill_tokens=sum(slot >= 0 for slot in host_slots),
            prefill_host_slot_mapping=on_device(host_slots, torch.int64),
        )
        return on_device(token_ids, torch.int64), meta

    def run(self, model, prefills, gpu_decodes, host_decodes=()) -> torch.Tensor:
        """One step; float32 logits ``[T, vocab]`` of every token in step order.

        Without CPU decodes or offloaded prefills it calls ``model.forward``; otherwise it runs
        the stages layer by layer the way the pipeline does: K/V of host-pool tokens are copied
        to the host cache after ``pre_attention``, and the CPU-decode rows of the attention
        output are computed from the host cache.
        """
        input_ids, meta = self.build_step(prefills, gpu_decodes, host_decodes)
        with torch.inference_mode():
            if meta.num_host_decodes == 0 and meta.num_offloaded_prefill_tokens == 0:
                hidden = model(input_ids, meta, self.kv_caches())
            else:
                hidden = self._run_stages(model, input_ids, meta)
            return model.compute_logits(hidden)

    def _run_stages(self, model, input_ids, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = model.embed(input_ids), None
        gpu_end = meta.num_gpu_tokens
        host_caches = self.kv_caches("host")
        for layer, (k_cache, v_cache), (k_host, v_host) in zip(model.layers, self.kv_caches(),
                                                              host_caches):
            q, k, v, residual = layer.pre_attention(hidden, residual, meta, k_cache, v_cache)
            prefill = slice(0, meta.num_prefill_tokens)
            torch.ops.neo.store_kv_cache(k[prefill].cpu(), v[prefill].cpu(), k_host, v_host,
                                         meta.prefill_host_slot_mapping.cpu())
            torch.ops.neo.store_kv_cache(k[gpu_end:].cpu(), v[gpu_end:].cpu(), k_host, v_host,
                                         meta.host_slot_mapping)
            attn_out = layer.attention(q, k, v, meta, k_cache, v_cache)
            if meta.num_host_decodes:
                host_rows = torch.empty_like(q[gpu_end:], device="cpu")
                torch.ops.neo.paged_decode_attention(host_rows, q[gpu_end:].cpu(), k_host, v_host,
                                                     meta.host_block_table,
                                                     meta.host_seq_lens, layer.scale)
                attn_out[gpu_end:] = host_rows.to(attn_out.device)
            hidden, residual = layer.post_attention(attn_out, residual, meta)
        return model.final_norm(hidden, residual)
