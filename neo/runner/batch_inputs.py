"""Turns a ``SubBatch`` into model inputs: token ids, ``AttentionMetadata``, logit rows."""

from dataclasses import dataclass

import torch

from neo.models.attention_metadata import AttentionMetadata
from .gemm_rows import padded_rows
from neo.request import KVLocation, Request
from neo.sched.runner_output import UNRESOLVED_TOKEN
from neo.sched.scheduler_output import SubBatch

from .sampled_tokens import PreviousTokens


@dataclass
class BatchInputs:
    """Everything one sub-batch's forward needs, on the compute device unless ``host``."""

    requests: list[Request]  # in logit-row order: prefills, GPU decodes, CPU decodes
    input_ids: torch.Tensor  # int64 [T] (``metadata.num_rows``: padding rows included)
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [len(requests)]: token row of each request's last token


def _block_table(requests: list[Request]) -> torch.Tensor:
    """int32 host tensor ``[len(requests), longest table]``, padded with block 0 (never read)."""
    width = max((len(request.block_table) for request in requests), default=0)
    rows = [request.block_table + [0] * (width - len(request.block_table)) for request in requests]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(requests), width)


def _to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A copy on ``device``, from pageable host memory. Not through ``pin_memory()``: pinning
    allocates page-locked memory whenever the caching host allocator has no free block of the
    size (its blocks stay reserved until the streams that used them pass the copies, a whole
    host batch on the async pipeline's stream), and that allocation waits for the whole device,
    the host batch in flight included. An asynchronous copy from pageable memory is staged
    at once and waits for no stream."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host.to(device, non_blocking=True)


def build_batch_inputs(batch: SubBatch, block_size: int, device: torch.device,
                       pad_rows: bool = False, previous: PreviousTokens | None = None) -> BatchInputs:
    """Lay out the sub-batch's tokens (prefills packed, then GPU decodes, then CPU decodes);
    ``pad_rows``: then padding rows up to ``padded_rows`` (token 0 at position 0, slot -1).

    A request whose newest token is unresolved (async scheduling) has that token's row filled on
    the device from ``previous``, the samples of the iteration launched before."""
    token_ids: list[int] = []
    unresolved_rows: list[int] = []  # rows whose token is in ``previous``
    previous_rows: list[int] = []  # and its row there
    positions: list[int] = []
    slots: list[int] = []
    host_slots: list[int] = []  # of the prefill tokens
    cu_seqlens = [0]
    logits_rows: list[int] = []

    def take_previous(row: int, request: Request) -> None:
        if previous is None:
            raise RuntimeError(f"{request} has an unresolved token, but no previous iteration's samples were given")
        unresolved_rows.append(row)
        previous_rows.append(previous.row_of(request))
        token_ids[row] = 0  # a valid id until the device fills the row

    for request in batch.prefills:
        length = request.num_tokens
        table = request.block_table
        request_slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        token_ids += request.all_token_ids
        if request.last_token_id == UNRESOLVED_TOKEN:
            take_previous(len(token_ids) - 1, request)
        positions += range(length)
        on_gpu = request.location is KVLocation.GPU
        slots += request_slots if on_gpu else [-1] * length
        host_slots += [-1] * length if on_gpu else request_slots
        cu_seqlens.append(cu_seqlens[-1] + length)
        logits_rows.append(len(token_ids) - 1)
    max_prefill_len = max((request.num_tokens for request in batch.prefills), default=0)

    def add_decodes(requests: list[Request], on_device: bool) -> list[int]:
        first_row = len(token_ids)
        decode_positions = [request.num_tokens - 1 for request in requests]
        decode_slots = [request.block_table[position // block_size] * block_size + position % block_size
                        for request, position in zip(requests, decode_positions)]
        token_ids.extend(request.last_token_id for request in requests)
        for row, request in enumerate(requests, start=first_row):
            if token_ids[row] == UNRESOLVED_TOKEN:
                take_previous(row, request)
        positions.extend(decode_positions)
        slots.extend(decode_slots if on_device else [-1] * len(requests))
        logits_rows.extend(range(first_row, first_row + len(requests)))
        return decode_slots

    add_decodes(batch.gpu_decodes, on_device=True)
    host_decode_slots = add_decodes(batch.host_decodes, on_device=False)
    num_padding = padded_rows(len(token_ids)) - len(token_ids) if pad_rows else 0
    token_ids += [0] * num_padding
    positions += [0] * num_padding
    slots += [-1] * num_padding

    int32, int64 = torch.int32, torch.int64
    num_offloaded = sum(request.num_tokens for request in batch.prefills if request.location is not KVLocation.GPU)
    metadata = AttentionMetadata(
        num_prefill_tokens=cu_seqlens[-1],
        num_gpu_decodes=len(batch.gpu_decodes),
        num_host_decodes=len(batch.host_decodes),
        positions=_to_device(positions, int64, device),
        slot_mapping=_to_device(slots, int64, device),
        prefill_cu_seqlens=_to_device(cu_seqlens, int32, device),
        max_prefill_len=max_prefill_len,
        gpu_block_table=_to_device(_block_table(batch.gpu_decodes), int32, device),
        gpu_seq_lens=_to_device([r.num_tokens for r in batch.gpu_decodes], int32, device),
        host_block_table=_block_table(batch.host_decodes),
        host_seq_lens=torch.tensor([r.num_tokens for r in batch.host_decodes], dtype=int32),
        host_slot_mapping=torch.tensor(host_decode_slots, dtype=int64),
        num_offloaded_prefill_tokens=num_offloaded,
        prefill_host_slot_mapping=_to_device(host_slots if num_offloaded else [], int64, device),
        num_padding_tokens=num_padding,
    )
    input_ids = _to_device(token_ids, int64, device)
    if unresolved_rows:
        samples = previous.tokens.index_select(0, _to_device(previous_rows, int64, device))
        input_ids.index_copy_(0, _to_device(unresolved_rows, int64, device), samples)
    return BatchInputs(
        requests=batch.prefills + batch.gpu_decodes + batch.host_decodes,
        input_ids=input_ids,
        metadata=metadata,
        logits_indices=_to_device(logits_rows, int64, device),
    )
