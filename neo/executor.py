"""``PipelineExecutor``: runs one iteration's sub-batches through the layer stages.

Stages of layer ``i`` for sub-batch ``b`` (see ``models/llama.py``)::

    pre(b, i)       add + RMSNorm, QKV projection, rotary, store new K/V in the GPU cache
    attn_gpu(b, i)  prefill attention and decode attention over the GPU cache
    attn_cpu(b, i)  decode attention over the host cache, on the host CPU (worker thread)
    post(b, i)      O projection, add + RMSNorm, gate/up projection, SiLU-and-mul, down projection

One sub-batch runs the stages in order, waiting for its host attention when it has any::

    GPU | pre(0,i) attn_gpu(0,i) ............ post(0,i) | pre(0,i+1) ...
    CPU |                        attn_cpu(0,i)           |

Two sub-batches (asymmetric pipelining: batch 0 holds the prefills, the GPU decodes and a few
host decodes; batch 1 holds host decodes) interleave so that each device works on one
sub-batch while the other device works on the other::

    layer i:  GPU | post(1,i-1) pre(1,i) | post(0,i-1) pre(0,i) attn_gpu(0,i) |
              CPU |    attn_cpu(0,i-1)   |            attn_cpu(1,i)           |

Host attention of a sub-batch: its queries and new K/V go to pinned host buffers on the copy
stream, the worker waits for that copy's event, stores the K/V into the host cache and runs
``paged_decode_attention`` there; the main thread waits for the worker only right before the
stage that needs the result, and queues the copy back on the compute stream in front of it. The K/V a prefill makes for a request that will decode on the host
is copied out the same way, layer by layer, as soon as that layer made it. Whole-request swaps
between the pools run on the copy stream one layer ahead of the compute that needs them. No
step synchronizes the whole device.
"""

from dataclasses import dataclass, field

import torch

from .attention_metadata import AttentionMetadata
from .batch_inputs import BatchInputs
from .cpu_worker import CpuAttentionWorker
from .kv_cache import KVCache


@dataclass
class _HostBuffers:
    """Pinned host buffers of one sub-batch slot (CUDA only); reused layer after layer."""

    query: torch.Tensor  # [max_decodes, H, D]
    key: torch.Tensor  # [max_decodes, KVH, D]
    value: torch.Tensor  # [max_decodes, KVH, D]
    output: torch.Tensor  # [max_decodes, H, D]
    offload_key: torch.Tensor  # [max_offload_tokens, KVH, D]
    offload_value: torch.Tensor  # [max_offload_tokens, KVH, D]

    @classmethod
    def allocate(cls, max_decodes, max_offload_tokens, num_heads, num_kv_heads, head_dim, dtype):
        def pinned(*shape):
            return torch.empty(shape, dtype=dtype, pin_memory=True)

        return cls(pinned(max_decodes, num_heads, head_dim), pinned(max_decodes, num_kv_heads, head_dim),
                   pinned(max_decodes, num_kv_heads, head_dim), pinned(max_decodes, num_heads, head_dim),
                   pinned(max_offload_tokens, num_kv_heads, head_dim),
                   pinned(max_offload_tokens, num_kv_heads, head_dim))


@dataclass
class _SubBatchState:
    """One sub-batch's activations while it moves through the layers."""

    inputs: BatchInputs
    hidden: torch.Tensor
    residual: torch.Tensor | None = None
    attention_output: torch.Tensor | None = None
    pending: object = None  # Future of the host work of the current layer, or None
    host_rows: slice = field(default_factory=lambda: slice(0, 0))

    @property
    def metadata(self) -> AttentionMetadata:
        return self.inputs.metadata


class PipelineExecutor:
    """Executes sub-batches layer by layer on the compute device and the host CPU."""

    def __init__(self, model, kv_cache: KVCache, device: torch.device,
                 worker: CpuAttentionWorker | None, max_cpu_decodes: int, max_offload_tokens: int,
                 measure_gpu_busy: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.worker = worker
        config = model.config
        self.scale = config.head_dim ** -0.5
        self.on_cuda = device.type == "cuda"
        # GPU busy time per iteration (for the trace): events around each run of launches
        # between two waits for the host, summed once the iteration is done.
        self.measure_gpu_busy = measure_gpu_busy and self.on_cuda
        self._busy_events: list[torch.cuda.Event] = []
        self.copy_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.host_buffers = []
        if self.on_cuda and worker is not None:
            self.host_buffers = [
                _HostBuffers.allocate(max_cpu_decodes, max_offload_tokens, config.num_heads,
                                      config.num_kv_heads, config.head_dim, kv_cache.layout.dtype)
                for _ in range(2)
            ]

    # -- public --------------------------------------------------------------------------------

    def run(self, batches: list[BatchInputs], swap_out: torch.Tensor, swap_in: torch.Tensor) -> torch.Tensor:
        """Run all layers; returns float32 logits ``[sum of requests, vocab]`` in batch order.

        swap_out / swap_in: int64 host ``[n, 2]`` block pairs (gpu->cpu / cpu->gpu) to copy first.
        """
        self._busy_events = []
        self._mark_busy()
        states = [_SubBatchState(inputs, self.model.embed(inputs.input_ids)) for inputs in batches]
        swap_events = self._start_swaps(swap_out, swap_in)
        num_layers = len(self.model.layers)
        try:
            if len(states) == 1:
                self._run_sequential(states[0], swap_events, num_layers)
            else:
                self._run_asymmetric(states, swap_events, num_layers)
        except BaseException:
            self._drain(states)
            raise
        hidden_rows = [self.model.final_norm(state.hidden[state.inputs.logits_indices],
                                             state.residual[state.inputs.logits_indices])
                       for state in states]
        logits = self.model.compute_logits(torch.cat(hidden_rows) if len(hidden_rows) > 1 else hidden_rows[0])
        self._mark_busy()
        return logits

    def _mark_busy(self) -> None:
        if self.measure_gpu_busy:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._busy_events.append(event)

    def gpu_busy_seconds(self) -> float | None:
        """GPU time of the last ``run`` outside its waits for the host (after it completed)."""
        if not self.measure_gpu_busy or len(self._busy_events) < 2:
            return None
        events = self._busy_events
        return sum(start.elapsed_time(end) for start, end in zip(events[0::2], events[1::2])) / 1e3

    # -- stage orders --------------------------------------------------------------------------

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
        state.pending = self._start_host_work(meta, layer_index, slot, query, key, value)
        state.attention_output = layer.attention(query, key, value, meta, k_cache, v_cache)

    def _finish_layer(self, state: _SubBatchState, layer_index: int) -> None:
        self._collect_host_work(state)
        layer = self.model.layers[layer_index]
        state.hidden, state.residual = layer.post_attention(state.attention_output, state.residual,
                                                            state.metadata)
        state.attention_output = None

    # -- host attention ------------------------------------------------------------------------

    def _start_host_work(self, meta: AttentionMetadata, layer_index: int, slot: int,
                         query, key, value):
        """Hand the host decodes and the host-bound prefill K/V of this layer to the worker."""
        num_decodes = meta.num_cpu_decodes
        num_offload = meta.num_offloaded_prefill_tokens
        if num_decodes == 0 and num_offload == 0:
            return None
        if self.worker is None:
            raise RuntimeError("this engine has no host KV cache worker (policy gpu-only), but "
                               "the plan has host decodes or host-bound prefills")
        rows = slice(meta.num_gpu_tokens, meta.num_tokens)
        decode = (query[rows], key[rows], value[rows])
        offload = (key[meta.offload_token_indices], value[meta.offload_token_indices]) if num_offload else None
        ready = None
        if self.on_cuda:
            decode, offload, ready = self._copy_to_host(slot, decode, offload)
        host_k_cache, host_v_cache = self.kv_cache.cpu_layers[layer_index]
        scale = self.scale

        def task() -> torch.Tensor | None:
            if ready is not None:
                ready.synchronize()
            if offload is not None:
                torch.ops.neo.store_kv_cache(offload[0], offload[1], host_k_cache, host_v_cache,
                                             meta.offload_slot_mapping_host)
            if num_decodes == 0:
                return None
            decode_query, decode_key, decode_value = decode
            torch.ops.neo.store_kv_cache(decode_key, decode_value, host_k_cache, host_v_cache,
                                         meta.cpu_slot_mapping_host)
            output = (self.host_buffers[slot].output[:num_decodes] if self.on_cuda
                      else torch.empty_like(decode_query))
            torch.ops.neo.paged_decode_attention(output, decode_query, host_k_cache, host_v_cache,
                                                 meta.cpu_block_table_host, meta.cpu_seq_lens_host, scale)
            return output

        return self.worker.submit(task), rows

    def _copy_to_host(self, slot: int, decode, offload):
        """Copy this layer's host-bound rows into pinned buffers on the copy stream."""
        buffers = self.host_buffers[slot]
        compute_stream = torch.cuda.current_stream(self.device)
        sources = [tensor.contiguous() for tensor in decode]
        if offload is not None:
            sources += list(offload)
        self.copy_stream.wait_stream(compute_stream)
        num_decodes = sources[0].shape[0]
        destinations = [buffers.query[:num_decodes], buffers.key[:num_decodes], buffers.value[:num_decodes]]
        if offload is not None:
            num_offload = offload[0].shape[0]
            destinations += [buffers.offload_key[:num_offload], buffers.offload_value[:num_offload]]
        with torch.cuda.stream(self.copy_stream):
            for source, destination in zip(sources, destinations):
                destination.copy_(source, non_blocking=True)
                source.record_stream(self.copy_stream)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        decode_host = tuple(destinations[:3])
        offload_host = tuple(destinations[3:]) if offload is not None else None
        return decode_host, offload_host, ready

    def _collect_host_work(self, state: _SubBatchState) -> None:
        """Wait for the sub-batch's host work and put its attention rows in place."""
        if state.pending is None:
            return
        future, rows = state.pending
        state.pending = None
        if not future.done():
            self._mark_busy()
            output = future.result()
            self._mark_busy()
        else:
            output = future.result()
        if output is None:
            return
        # On the compute stream: the next stage needs these rows, and the worker reuses the
        # pinned buffer only after an event recorded behind this copy.
        state.attention_output[rows].copy_(output, non_blocking=self.on_cuda)

    def _drain(self, states: list[_SubBatchState]) -> None:
        """After an error: wait for outstanding host tasks so none touches freed buffers."""
        for state in states:
            if state.pending is not None:
                future, _ = state.pending
                state.pending = None
                try:
                    future.result()
                except BaseException:
                    pass

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
