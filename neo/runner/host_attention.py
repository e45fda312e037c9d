"""The host attention hand-off: how a sub-batch's host-decode rows reach the host CPU's kernels
and their attention output comes back, one layer at a time.

Per layer, ``start`` hands over the rows ``pre`` made (queries and new K/V of the host decodes,
on the compute device) and the attention output rows to fill; the host stores the new K/V in the
host cache and runs ``paged_decode_attention`` over it with the selected CPU kernels; ``finish``
makes the result available to the sub-batch's next stage (``post``). Two mechanisms:

- ``StreamOrderedHandOff`` (CUDA, and CPU kernels that run without the Python interpreter): one
  C++ call per layer and sub-batch (``torch.classes.neo_pipeline.HostDecodeStage``, one stage
  per sub-batch) queues on the copy stream, behind the compute stream's work issued so far, the
  copies to pinned buffers, a CUDA host function that runs the kernels, the copy back, and an
  event that ``finish`` makes the compute stream wait for. No Python runs on the host side and
  the launching thread never waits, so it can queue layers ahead of the GPU; the host functions
  read each iteration's host metadata (row counts, host slots, block tables, lengths) from the
  stage's buffers, which ``prepare`` fills, so the same calls can be captured in a CUDA graph
  and replayed (``PipelineGraphs``).
- ``WorkerHandOff`` (no CUDA, or a CPU kernel written in Python, which a host function must not
  call): a worker thread (``HostAttentionWorker``) runs the kernels, waiting for the copies to
  pinned memory on CUDA; the launching thread waits for it in ``finish``.
"""

from dataclasses import dataclass

import torch

from neo.models.attention_metadata import AttentionMetadata
from neo.ops import Implementation

from .host_worker import HostAttentionWorker

FAILURE_MESSAGE_BYTES = 1024


def host_stage_available() -> bool:
    """Whether the CUDA extension with ``neo_pipeline.HostDecodeStage`` is loaded."""
    try:
        torch.classes.neo_pipeline.HostDecodeStage
    except (AttributeError, RuntimeError):
        return False
    return True


@dataclass(frozen=True)
class HostKernels:
    """The CPU implementations the host side runs: the KV store and the decode attention."""

    store: Implementation  # of store_kv_cache
    attention: Implementation  # of paged_decode_attention

    @property
    def native(self) -> bool:
        """Both run without the Python interpreter (compiled): a CUDA host function may call them."""
        return self.store.native and self.attention.native


@dataclass
class HostRowBuffers:
    """One sub-batch's host-side buffers (CUDA only), reused layer after layer: pinned rows for
    the copies, and the host metadata of the sub-batch's current iteration."""

    query: torch.Tensor  # [max_decodes, H, D] pinned
    key: torch.Tensor  # [max_decodes, KVH, D] pinned
    value: torch.Tensor  # [max_decodes, KVH, D] pinned
    output: torch.Tensor  # [max_decodes, H, D] pinned
    slot_mapping: torch.Tensor  # int64 [max_decodes]: host-cache slot of each decode's new token
    block_table: torch.Tensor  # int32 [max_decodes, max_blocks_per_sequence]
    seq_lens: torch.Tensor  # int32 [max_decodes]
    num_decodes: torch.Tensor  # int64 [1]: host decodes of the iteration

    @classmethod
    def allocate(cls, max_decodes, max_blocks, num_heads, num_kv_heads, head_dim, dtype):
        def pinned(*shape):  # zeroed: rows a captured graph copies back unattended stay finite
            return torch.zeros(shape, dtype=dtype, pin_memory=True)

        return cls(pinned(max_decodes, num_heads, head_dim), pinned(max_decodes, num_kv_heads, head_dim),
                   pinned(max_decodes, num_kv_heads, head_dim), pinned(max_decodes, num_heads, head_dim),
                   torch.zeros(max_decodes, dtype=torch.int64),
                   torch.zeros(max_decodes, max_blocks, dtype=torch.int32),
                   torch.ones(max_decodes, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.int64))

    def load(self, meta: AttentionMetadata) -> None:
        """Copy the sub-batch's host metadata in (the host functions read it from here)."""
        decodes = meta.num_host_decodes
        if decodes > self.query.shape[0]:
            raise ValueError(f"a sub-batch of {decodes} host decodes exceeds the pipeline's buffers "
                             f"({self.query.shape[0]} rows)")
        if decodes:
            width = meta.host_block_table.shape[1]
            if width > self.block_table.shape[1]:
                raise ValueError(f"a host block table of {width} blocks exceeds the pipeline's "
                                 f"{self.block_table.shape[1]} blocks per sequence")
            self.slot_mapping[:decodes] = meta.host_slot_mapping
            self.block_table[:decodes, :width] = meta.host_block_table
            self.seq_lens[:decodes] = meta.host_seq_lens
        self.num_decodes[0] = decodes


@dataclass
class HostRows:
    """One layer's rows of a sub-batch's host decodes on the compute device. query and output are
    contiguous; key and value may be views of the layer's fused QKV projection (each head's
    features contiguous, a wider token stride)."""

    query: torch.Tensor  # [num_host_decodes, H, D]
    key: torch.Tensor  # [num_host_decodes, KVH, D]
    value: torch.Tensor  # [num_host_decodes, KVH, D]
    output: torch.Tensor  # [num_host_decodes, H, D]: where the attention output goes


class StreamOrderedHandOff:
    """Host attention queued on the copy stream as CUDA host functions (see the module docstring)."""

    stream_ordered = True

    def __init__(self, kernels: HostKernels, buffers: list[HostRowBuffers], copy_stream: torch.cuda.Stream,
                 scale: float, num_threads: int, num_layers: int):
        self.buffers = buffers
        # Page-locked: ``failure_flag`` copies its first byte to the device in stream order.
        self.failure = torch.zeros(FAILURE_MESSAGE_BYTES, dtype=torch.uint8, pin_memory=True)
        self.seconds = torch.zeros(1, dtype=torch.float64)  # host functions' time this iteration
        stream = copy_stream
        self.stages = [torch.classes.neo_pipeline.HostDecodeStage(
            rows.query, rows.key, rows.value, rows.output, rows.slot_mapping, rows.block_table, rows.seq_lens,
            rows.num_decodes, self.failure, self.seconds, scale, num_threads, num_layers, stream.stream_id,
            stream.device_index, stream.device_type, kernels.attention.qualified_name, kernels.store.qualified_name)
            for rows in buffers]

    def prepare(self, metadata: list[AttentionMetadata]) -> None:
        self.failure[0] = 0
        self.seconds.zero_()
        for rows, meta in zip(self.buffers, metadata):
            rows.load(meta)

    def start(self, sub_batch: int, layer: int, rows: HostRows, meta: AttentionMetadata, k_cache, v_cache):
        stage = self.stages[sub_batch]
        # The stage copies whole rows to its pinned buffers with one copy each.
        stage.start(layer, rows.query, rows.key.contiguous(), rows.value.contiguous(), rows.output, k_cache,
                    v_cache)
        return stage

    @staticmethod
    def finish(pending) -> None:
        pending.finish()

    def drain(self, pending) -> None:
        """After an error: nothing to wait for (the caller synchronizes the copy stream)."""

    def host_seconds(self) -> float:
        return float(self.seconds[0])

    def failure_flag(self, device: torch.device) -> torch.Tensor:
        """uint8 ``[1]`` on ``device``, copied on the current stream behind the host functions
        queued before it: nonzero when one of them failed."""
        return self.failure[:1].to(device, non_blocking=True)

    def raise_failure(self) -> None:
        if self.failure[0]:
            text = bytes(self.failure[1:].tolist()).split(b"\0", 1)[0].decode(errors="replace")
            raise RuntimeError(f"host decode attention failed: {text}")


class WorkerHandOff:
    """Host attention on a worker thread (see the module docstring)."""

    stream_ordered = False

    def __init__(self, kernels: HostKernels, worker: HostAttentionWorker, buffers: list[HostRowBuffers],
                 copy_stream: torch.cuda.Stream | None, scale: float):
        self.kernels = kernels
        self.worker = worker
        self.buffers = buffers  # pinned rows on CUDA, none on a CPU device
        self.copy_stream = copy_stream
        self.scale = scale

    def prepare(self, metadata: list[AttentionMetadata]) -> None:
        """Nothing to load: each task carries its sub-batch's metadata."""

    def start(self, sub_batch: int, layer: int, rows: HostRows, meta: AttentionMetadata, k_cache, v_cache):
        if self.copy_stream is None:  # the rows are host tensors already
            output = torch.empty_like(rows.query)
            future = self.worker.submit(lambda: self._attend(rows.query, rows.key, rows.value, output, meta,
                                                             k_cache, v_cache))
            return future, rows.output
        ready = torch.cuda.Event()
        ready.record()
        self.copy_stream.wait_event(ready)
        buffers = self.buffers[sub_batch]
        decodes = rows.query.shape[0]
        pinned = (buffers.query[:decodes], buffers.key[:decodes], buffers.value[:decodes])
        with torch.cuda.stream(self.copy_stream):
            for source, destination in zip((rows.query, rows.key, rows.value), pinned):
                destination.copy_(source, non_blocking=True)
                source.record_stream(self.copy_stream)
            copied = torch.cuda.Event()
            copied.record()
        output = buffers.output[:decodes]

        def task():
            copied.synchronize()
            return self._attend(*pinned, output, meta, k_cache, v_cache)

        return self.worker.submit(task), rows.output

    def _attend(self, query, key, value, output, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        """Store the new K/V in the host cache and attend there (the worker's job)."""
        self.kernels.store.function(key, value, k_cache, v_cache, meta.host_slot_mapping)
        self.kernels.attention.function(output, query, k_cache, v_cache, meta.host_block_table,
                                        meta.host_seq_lens, self.scale)
        return output

    def finish(self, pending) -> None:
        future, destination = pending
        # On the compute stream: the next stage needs these rows, and the pinned buffer is
        # rewritten only after an event recorded behind this copy.
        destination.copy_(future.result(), non_blocking=self.copy_stream is not None)

    @staticmethod
    def drain(pending) -> None:
        """After an error: wait for the task so that it touches no freed buffer."""
        try:
            pending[0].result()
        except BaseException:
            pass

    def host_seconds(self) -> float:
        return self.worker.take_busy_seconds()

    @staticmethod
    def failure_flag(device: torch.device) -> torch.Tensor:
        """Zero: a failure in a task is raised by ``finish`` already."""
        return torch.zeros(1, dtype=torch.uint8, device=device)

    def raise_failure(self) -> None:
        """A failure in a task is raised by ``finish`` already."""
