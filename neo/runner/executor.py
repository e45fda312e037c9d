"""``PipelineExecutor``: runs one iteration's sub-batches through the layer stages.

Stages of layer ``i`` for sub-batch ``b`` (see ``models/llama.py``)::

    pre(b, i)       add + RMSNorm, QKV projection, rotary, store new K/V in the GPU cache, and
                    the K/V of prefill tokens bound for the host straight into the host cache
    attn_gpu(b, i)  prefill attention and decode attention over the GPU cache
    attn_cpu(b, i)  store new K/V in the host cache + decode attention over it, on the host CPU
    post(b, i)      O projection, add + RMSNorm, gate/up projection, SiLU-and-mul, down projection

One sub-batch runs the stages in order, waiting for its host attention when it has any::

    GPU | pre(0,i) attn_gpu(0,i) ............ post(0,i) | pre(0,i+1) ...
    CPU |                        attn_cpu(0,i)           |

Two sub-batches (asymmetric pipelining: batch 0 holds the prefills, the GPU decodes and a few
host decodes; batch 1 holds host decodes) interleave so that each device works on one
sub-batch while the other device works on the other::

    layer i:  GPU | post(1,i-1) pre(1,i) | post(0,i-1) pre(0,i) attn_gpu(0,i) |
              CPU |    attn_cpu(0,i-1)   |            attn_cpu(1,i)           |

The K/V a prefill makes for a request that will decode on the host is written by the compute
device itself into the host cache (``KVCache.cpu_layers_for_device``; on a GPU the store kernel
writes the page-locked pool over PCIe), in stream order with the layer's other work: no host
code runs for it, so it never queues behind host attention running at the time.

Host attention of a sub-batch, per layer: its queries and new K/V are copied to pinned buffers
on the copy stream once ``pre`` made them; the host stores the K/V into the host cache and runs
``paged_decode_attention``; the result is copied back into the attention output, and the
compute stream waits for that copy (an event) right before ``post``. Two hand-offs:

- on CUDA with the C++ (ISPC) CPU kernels, one C++ call per layer and sub-batch
  (``torch.classes.neo_pipeline.HostDecodeStage``, one stage per sub-batch slot) queues the
  copies, a CUDA host function doing the host work, the copy back and the events: the streams
  order everything, no Python runs on the host side and the launching thread never waits, so
  it can queue layers ahead of the GPU. The host functions read the iteration's host metadata
  (row counts, host slots, block tables, lengths) from the stage's buffers, which ``prepare``
  fills once per iteration, so the same calls can be captured in a CUDA graph and replayed
  (``PipelineGraphs``);
- otherwise (no CUDA, or Python CPU kernels) a worker thread runs it (``CpuAttentionWorker``),
  waiting for the copy's event; the launching thread waits for the worker right before the
  stage that needs the result.

Whole-request swaps between the pools are queued on the copy stream at the start, one event per
layer, which the compute stream waits for before that layer. No step synchronizes the device.
"""

import logging
from dataclasses import dataclass

import torch

from neo.ops import dispatched

from neo.models.attention_metadata import AttentionMetadata
from .batch_inputs import BatchInputs
from .host_worker import HostAttentionWorker
from .gemm_rows import padded_logits
from neo.kv.kv_cache import KVCache

logger = logging.getLogger(__name__)

FAILURE_MESSAGE_BYTES = 1024
MAX_SUB_BATCHES = 2  # sub-batches in flight at once


def host_stage_available() -> bool:
    """Whether the CUDA extension with ``neo_pipeline.HostDecodeStage`` is loaded."""
    try:
        torch.classes.neo_pipeline.HostDecodeStage
    except (AttributeError, RuntimeError):
        return False
    return True


@dataclass
class _HostRowBuffers:
    """One sub-batch slot's host-side buffers (CUDA only), reused layer after layer: pinned rows
    for the copies, and the host metadata of the slot's current sub-batch."""

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
class _HostInputs:
    """One layer's inputs of a sub-batch's host work (compute-device or host tensors)."""

    query: torch.Tensor  # [num_host_decodes, H, D]
    key: torch.Tensor  # [num_host_decodes, KVH, D]
    value: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.query, self.key, self.value]


@dataclass
class _SubBatchState:
    """One sub-batch's activations while it moves through the layers."""

    metadata: AttentionMetadata
    hidden: torch.Tensor
    residual: torch.Tensor | None = None
    attention_output: torch.Tensor | None = None
    pending: object = None  # the current layer's host work: a HostDecodeStage or a (Future, rows)


class PipelineExecutor:
    """Executes sub-batches layer by layer on the compute device and the host CPU."""

    def __init__(self, model, kv_cache: KVCache, device: torch.device,
                 worker: HostAttentionWorker | None, max_host_decodes: int, max_blocks_per_sequence: int,
                 measure_gpu_busy: bool = False, pad_rows: bool = False):
        """``pad_rows``: run the logits GEMM over ``neo.gemm_rows`` buckets of rows."""
        self.model = model
        self.pad_rows = pad_rows
        self.kv_cache = kv_cache
        self.device = device
        self.worker = worker
        config = model.config
        self.scale = config.head_dim ** -0.5
        self.on_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.slots: list[_HostRowBuffers] = []
        if self.on_cuda and worker is not None:
            self.slots = [_HostRowBuffers.allocate(max_host_decodes, max_blocks_per_sequence, config.num_heads,
                                                config.num_kv_heads, config.head_dim, kv_cache.layout.dtype)
                          for _ in range(MAX_SUB_BATCHES)]
        self.host_failure = torch.zeros(FAILURE_MESSAGE_BYTES, dtype=torch.uint8)
        self.host_seconds = torch.zeros(1, dtype=torch.float64)  # host functions' time this iteration
        self.stream_ordered_host_work = (bool(self.slots) and host_stage_available()
                                         and dispatched("paged_decode_attention", "cpu") == "ispc"
                                         and dispatched("store_kv_cache", "cpu") == "ispc")
        self.stages = []
        if self.stream_ordered_host_work:
            stream = self.copy_stream
            self.stages = [torch.classes.neo_pipeline.HostDecodeStage(
                slot.query, slot.key, slot.value, slot.output, slot.slot_mapping, slot.block_table,
                slot.seq_lens, slot.num_decodes, self.host_failure, self.host_seconds, self.scale,
                worker.num_threads, config.num_layers, stream.stream_id, stream.device_index,
                stream.device_type) for slot in self.slots]
        # GPU busy time per iteration (for the trace): the iteration's span minus the time the
        # compute stream spent waiting for the host, from timing events on the compute stream
        # (inside a captured graph they are recorded as graph nodes).
        self.measure_gpu_busy = measure_gpu_busy and self.on_cuda
        self._span_events: list[torch.cuda.Event] = []
        self._wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # -- public --------------------------------------------------------------------------------

    def run(self, batches: list[BatchInputs], swap_out: torch.Tensor, swap_in: torch.Tensor) -> torch.Tensor:
        """Queue all layers; returns float32 logits ``[sum of requests, vocab]`` in batch order.
        Call ``raise_host_failure`` once the logits have been read.

        swap_out / swap_in: int64 host ``[n, 2]`` block pairs (gpu->cpu / cpu->gpu) to copy first.
        """
        self.prepare([inputs.metadata for inputs in batches])
        states = [_SubBatchState(inputs.metadata, self.model.embed(inputs.input_ids)) for inputs in batches]
        swap_events = self._start_swaps(swap_out, swap_in)
        try:
            self._run_layers(states, swap_events)
        except BaseException:
            self._drain(states)
            raise
        hidden_rows = [self.model.final_norm(state.hidden[inputs.logits_indices],
                                             state.residual[inputs.logits_indices])
                       for state, inputs in zip(states, batches)]
        logits = self.compute_logits(torch.cat(hidden_rows) if len(hidden_rows) > 1 else hidden_rows[0])
        self.end()
        return logits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` of final-normed ``hidden [N, hidden]`` (row-padded
        when ``pad_rows``)."""
        return padded_logits(self.model, hidden) if self.pad_rows else self.model.compute_logits(hidden)

    def forward_all_rows(self, input_ids: list[torch.Tensor], metadata: list[AttentionMetadata]) -> list[torch.Tensor]:
        """Every layer for sub-batches without prefills and swaps, and the final norm of every
        row: ``[T_b, hidden]`` per sub-batch. What ``PipelineGraphs`` captures; ``prepare``
        and ``end`` stay outside the capture."""
        states = [_SubBatchState(meta, self.model.embed(ids)) for ids, meta in zip(input_ids, metadata)]
        self._run_layers(states, None)
        return [self.model.final_norm(state.hidden, state.residual) for state in states]

    def prepare(self, metadata: list[AttentionMetadata]) -> None:
        """Before an iteration's work is queued (or replayed): load each sub-batch's host
        metadata into its slot, clear the host failure and time, start the span."""
        self.host_failure[0] = 0
        self.host_seconds.zero_()
        if self.stages:
            for slot, meta in zip(self.slots, metadata):
                slot.load(meta)
        self._span_events, self._wait_events = [self._timing_event()], []

    def end(self, wait_events: list | None = None) -> None:
        """After an iteration's work is queued: end the span (``wait_events``: the compute
        stream's waits for the host recorded inside a replayed graph)."""
        if wait_events is not None:
            self._wait_events = wait_events
        self._span_events.append(self._timing_event())

    def take_wait_events(self) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """The waits recorded since ``prepare`` (a capture keeps those of its graph)."""
        events, self._wait_events = self._wait_events, []
        return events

    def raise_host_failure(self) -> None:
        """Raise what failed in the last iteration's host functions (after the device synced)."""
        if self.host_failure[0]:
            text = bytes(self.host_failure[1:].tolist()).split(b"\0", 1)[0].decode(errors="replace")
            raise RuntimeError(f"host decode attention failed: {text}")

    def gpu_busy_seconds(self) -> float | None:
        """The last iteration's GPU time outside waits for the host (once it has completed)."""
        if not self.measure_gpu_busy or None in self._span_events or len(self._span_events) != 2:
            return None
        start, end = self._span_events
        try:
            waiting = sum(before.elapsed_time(after) for before, after in self._wait_events)
        except RuntimeError as error:  # events a graph recorded that the driver cannot time
            logger.warning("GPU busy time not measured from now on: timing the waits for the host "
                           "failed (%s)", error)
            self.measure_gpu_busy = False
            return None
        return (start.elapsed_time(end) - waiting) / 1e3

    def host_busy_seconds(self) -> float | None:
        """The last iteration's time in host functions (once it has completed); None when the
        host work ran on the worker thread, which counts its own."""
        return float(self.host_seconds[0]) if self.stream_ordered_host_work else None

    # -- stage orders --------------------------------------------------------------------------

    def _run_layers(self, states: list[_SubBatchState], swap_events) -> None:
        num_layers = len(self.model.layers)
        if len(states) == 1:
            self._run_sequential(states[0], swap_events, num_layers)
        else:
            self._run_asymmetric(states, swap_events, num_layers)

    def _run_sequential(self, state: _SubBatchState, swap_events, num_layers: int) -> None:
        for layer_index in range(num_layers):
            self._wait_swaps(swap_events, layer_index)
            self._pre_and_attention(state, layer_index, slot=0)
            self._finish_layer(state, layer_index)

    def _run_asymmetric(self, states: list[_SubBatchState], swap_events, num_layers: int) -> None:
        first, second = states
        for layer_index in range(num_layers):
            self._wait_swaps(swap_events, layer_index)
            for state, slot in ((second, 1), (first, 0)):
                if layer_index > 0:
                    self._finish_layer(state, layer_index - 1)
                self._pre_and_attention(state, layer_index, slot)
        for state in (second, first):
            self._finish_layer(state, num_layers - 1)

    # -- one sub-batch, one layer --------------------------------------------------------------

    def _pre_and_attention(self, state: _SubBatchState, layer_index: int, slot: int) -> None:
        layer = self.model.layers[layer_index]
        k_cache, v_cache = self.kv_cache.gpu_layers[layer_index]
        meta = state.metadata
        query, key, value, state.residual = layer.pre_attention(state.hidden, state.residual, meta,
                                                                k_cache, v_cache)
        state.attention_output = torch.empty_like(query)
        if meta.num_offloaded_prefill_tokens:  # the prefill rows; slot -1 skips GPU-bound prompts
            host_k_cache, host_v_cache = self.kv_cache.host_layers_for_device[layer_index]
            prefill = slice(0, meta.num_prefill_tokens)
            torch.ops.neo.store_kv_cache(key[prefill], value[prefill], host_k_cache, host_v_cache,
                                         meta.prefill_host_slot_mapping)
        host_inputs = self._host_inputs(meta, query, key, value)
        if host_inputs is not None:  # queued before attn_gpu, so the copies may start meanwhile
            state.pending = self._start_host_work(meta, layer_index, slot, host_inputs, state.attention_output)
        layer.attention(query, key, value, meta, k_cache, v_cache, out=state.attention_output)

    def _finish_layer(self, state: _SubBatchState, layer_index: int) -> None:
        self._collect_host_work(state)
        layer = self.model.layers[layer_index]
        state.hidden, state.residual = layer.post_attention(state.attention_output, state.residual,
                                                            state.metadata)
        state.attention_output = None

    # -- host attention ------------------------------------------------------------------------

    def _host_inputs(self, meta: AttentionMetadata, query, key, value) -> _HostInputs | None:
        """The rows the host needs for this layer (contiguous: ``pre_attention``'s outputs are)."""
        if meta.num_host_decodes == 0:
            return None
        if self.worker is None:
            raise RuntimeError("this engine has no host KV cache worker (policy gpu-only), but "
                               "the plan has host decodes")
        rows = slice(meta.num_gpu_tokens, meta.num_tokens)
        return _HostInputs(query[rows], key[rows], value[rows])

    def _start_host_work(self, meta: AttentionMetadata, layer_index: int, slot: int,
                         inputs: _HostInputs, attention_output: torch.Tensor):
        host_k_cache, host_v_cache = self.kv_cache.host_layers[layer_index]
        rows = slice(meta.num_gpu_tokens, meta.num_tokens)
        if self.stages:
            stage = self.stages[slot]
            stage.start(layer_index, inputs.query, inputs.key, inputs.value, attention_output[rows],
                        host_k_cache, host_v_cache)
            return stage
        if not self.on_cuda:
            output = torch.empty_like(inputs.query)
            return self.worker.submit(lambda: self._host_task(inputs, output, meta, host_k_cache,
                                                              host_v_cache)), rows
        ready = torch.cuda.Event()
        ready.record()
        self.copy_stream.wait_event(ready)
        with torch.cuda.stream(self.copy_stream):
            pinned = self._to_pinned(slot, inputs)
            copied = torch.cuda.Event()
            copied.record()
        output = self.slots[slot].output[:meta.num_host_decodes]

        def task():
            copied.synchronize()
            return self._host_task(pinned, output, meta, host_k_cache, host_v_cache)

        return self.worker.submit(task), rows

    def _to_pinned(self, slot: int, inputs: _HostInputs) -> _HostInputs:
        """Queue copies of the inputs into this slot's pinned buffers on the copy stream."""
        buffers = self.slots[slot]
        decodes = inputs.query.shape[0]
        pinned = _HostInputs(buffers.query[:decodes], buffers.key[:decodes], buffers.value[:decodes])
        for source, destination in zip(inputs.tensors(), pinned.tensors()):
            destination.copy_(source, non_blocking=True)
            source.record_stream(self.copy_stream)
        return pinned

    def _host_task(self, inputs: _HostInputs, output, meta: AttentionMetadata, host_k_cache,
                   host_v_cache) -> torch.Tensor:
        """Store the new K/V in the host cache and attend there (the worker's job)."""
        torch.ops.neo.store_kv_cache(inputs.key, inputs.value, host_k_cache, host_v_cache,
                                     meta.host_slot_mapping)
        torch.ops.neo.paged_decode_attention(output, inputs.query, host_k_cache, host_v_cache,
                                             meta.host_block_table, meta.host_seq_lens, self.scale)
        return output

    def _collect_host_work(self, state: _SubBatchState) -> None:
        """Make the sub-batch's host attention rows available to the next stage."""
        pending, state.pending = state.pending, None
        if pending is None:
            return
        before = self._timing_event()
        if isinstance(pending, tuple):
            future, rows = pending
            output = future.result()
            # On the compute stream: the next stage needs these rows, and the pinned buffer is
            # rewritten only after an event recorded behind this copy.
            state.attention_output[rows].copy_(output, non_blocking=self.on_cuda)
        else:
            pending.finish()
        if before is not None:
            self._wait_events.append((before, self._timing_event()))

    def _timing_event(self) -> torch.cuda.Event | None:
        """A timing event recorded on the current stream (a graph node while capturing); None
        unless measuring GPU busy time."""
        if not self.measure_gpu_busy:
            return None
        event = torch.cuda.Event(enable_timing=True, external=torch.cuda.is_current_stream_capturing())
        event.record()
        return event

    def _drain(self, states: list[_SubBatchState]) -> None:
        """After an error: wait for outstanding host work so none touches freed buffers."""
        for state in states:
            pending, state.pending = state.pending, None
            if isinstance(pending, tuple):
                try:
                    pending[0].result()
                except BaseException:
                    pass
        if self.on_cuda:
            self.copy_stream.synchronize()

    # -- whole-request swaps -------------------------------------------------------------------

    def _start_swaps(self, swap_out: torch.Tensor, swap_in: torch.Tensor):
        """Queue every layer's block copies on the copy stream; one event per layer."""
        if swap_out.numel() == 0 and swap_in.numel() == 0:
            return None
        num_layers = len(self.model.layers)
        if not self.on_cuda:
            for layer_index in range(num_layers):
                self.kv_cache.swap_layer(layer_index, swap_out, swap_in)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        events = []
        with torch.cuda.stream(self.copy_stream):
            for layer_index in range(num_layers):
                self.kv_cache.swap_layer(layer_index, swap_out, swap_in)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
                events.append(event)
        return events

    def _wait_swaps(self, swap_events, layer_index: int) -> None:
        if swap_events is not None:
            torch.cuda.current_stream(self.device).wait_event(swap_events[layer_index])
