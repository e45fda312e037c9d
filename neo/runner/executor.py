"""``PipelineExecutor``: runs one iteration's sub-batches through the layers by walking its
``StageOrder`` (``neo.sched.stage_order``: the declared steps, their order and resources).

Each step of the expanded order is one call (``models/llama.py`` holds the stages)::

    pre(b, i)        layer.pre_attention: QKV projection, rotary, new K/V stored in the device
                     cache, and the K/V of prefill tokens bound for the host pool written by the
                     compute device straight into the host cache (``KVCache.host_layers_for_device``;
                     on a GPU the store kernel writes the page-locked pool over PCIe), in stream
                     order with the layer's other work
    attn_gpu(b, i)   layer.attention over the prefill and GPU-decode rows
    attn_host(b, i)  the hand-off of the host-decode rows to the host (``neo.runner.host_attention``):
                     queued behind the GPU work issued so far, it runs while the GPU goes on
    post(b, i)       waits for the host attention's rows, then layer.post_attention

For the ``asymmetric`` order of the lockstep pipeline that interleaves the two sub-batches so
that each device works on one while the other device works on the other::

    layer i:  GPU  | post(1,i-1) pre(1,i)  | post(0,i-1) pre(0,i) attn_gpu(0,i) |
              host |    attn_host(0,i-1)   |           attn_host(1,i)           |

Whole-request swaps between the pools are queued on the copy stream at the start, one event per
layer, which the compute stream waits for before the layer's first ``pre``. No step
synchronizes the device.

The layers may also be walked in parts (``forward_layers`` over a ``range`` of layers, one of
``layer_parts``): a part runs the expanded order's steps of its layers, in the same order, and
hands its sub-batches' ``HiddenStates`` (the last layer's output and the residual stream) to the
next. Each step of a layer belongs to that layer's part, so no host attention is pending at a
part's end. For the sequential orders the parts' steps joined are exactly the whole walk; for the
two-sub-batch orders a part boundary drops the overlap across it (a layer's last ``post`` is
issued before the next part's first ``pre``), which keeps every step after the steps it needs.
"""

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from neo.models.attention_metadata import AttentionMetadata
from neo.sched.stage_order import Stage, StageOrder

from .batch_inputs import BatchInputs
from .gemm_rows import padded_logits
from .host_attention import (HostKernels, HostRowBuffers, HostRows, StreamOrderedHandOff, WorkerHandOff,
                             host_stage_available)
from .host_worker import HostAttentionWorker
from neo.kv.kv_cache import KVCache

logger = logging.getLogger(__name__)

MAX_SUB_BATCHES = 2  # sub-batches in flight at once


def layer_parts(num_layers: int, layers_per_part: int) -> list[range]:
    """``range(num_layers)`` split into the fewest consecutive parts of at most
    ``layers_per_part`` layers each, as even as they can be (the first parts one layer longer
    where the layers do not divide evenly)."""
    if isinstance(layers_per_part, bool) or not isinstance(layers_per_part, int) or layers_per_part < 1:
        raise ValueError(f"layers_per_part must be an integer of at least 1, got {layers_per_part!r}")
    if num_layers < 1:
        raise ValueError(f"a model to split in parts needs at least one layer, got num_layers={num_layers}")
    num_parts = -(-num_layers // layers_per_part)
    base, longer = divmod(num_layers, num_parts)
    parts, start = [], 0
    for index in range(num_parts):
        stop = start + base + (index < longer)
        parts.append(range(start, stop))
        start = stop
    return parts


class LayerPartWalk(ABC):
    """An iteration's layers queued one part at a time (``layer_parts``), then its logits: the
    interface the host batches queue through, whatever queues a part (a subclass's
    ``_queue_part`` and ``_logits``: a graph replay, or the executor's eager walk)."""

    def __init__(self, num_parts: int):
        self.num_parts = num_parts
        self.queued = 0  # parts queued so far

    @property
    def all_queued(self) -> bool:
        return self.queued == self.num_parts

    def queue_next(self) -> None:
        """Queue the next part (behind the parts queued before it) on the current stream."""
        if self.all_queued:
            raise RuntimeError(f"all {self.num_parts} parts of the walk are queued already")
        self._queue_part(self.queued)
        self.queued += 1

    def logits(self) -> torch.Tensor:
        """Once every part is queued: the float32 logits ``[requests, vocab]`` of the plan's real
        rows, in batch order (queued behind the last part)."""
        if not self.all_queued:
            raise RuntimeError(f"the logits follow the last part; {self.queued} of {self.num_parts} parts are queued")
        return self._logits()

    @abstractmethod
    def _queue_part(self, index: int) -> None:
        """Queue part ``index``'s layers on the current stream."""

    @abstractmethod
    def _logits(self) -> torch.Tensor:
        """The logits, queued behind the last part."""


@dataclass
class HiddenStates:
    """One sub-batch's activations between two layers: the last layer's output and the residual
    stream, ``[T, hidden]`` each (the embeddings and None before the first layer)."""

    hidden: torch.Tensor
    residual: torch.Tensor | None


@dataclass
class IterationTiming:
    """An iteration's timing events on the compute stream: its span (start, end) and the
    compute stream's waits for the host (before, after each); empty when not measuring."""

    span_events: list
    wait_events: list


class _SubBatchState:
    """One sub-batch's activations while it moves through the layers."""

    def __init__(self, metadata: AttentionMetadata, hidden: torch.Tensor, residual: torch.Tensor | None = None):
        self.metadata = metadata
        self.hidden = hidden  # [T, hidden]
        self.residual = residual  # [T, hidden]; None before the first layer
        self.query = self.key = self.value = None  # the current layer's, from pre
        self.attention_output: torch.Tensor | None = None  # [T, H, D]
        self.pending = None  # the current layer's host attention in flight


class PipelineExecutor:
    """Executes sub-batches layer by layer on the compute device and the host CPU."""

    def __init__(self, model, kv_cache: KVCache, device: torch.device, host_kernels: HostKernels | None,
                 worker: HostAttentionWorker | None, max_host_decodes: int, max_blocks_per_sequence: int,
                 measure_gpu_busy: bool = False, pad_rows: bool = False):
        """``host_kernels``/``worker``: the host side (None: no host decodes, policy gpu-only).
        ``pad_rows``: run the logits GEMM over ``neo.runner.gemm_rows`` buckets of rows."""
        self.model = model
        self.pad_rows = pad_rows
        self.kv_cache = kv_cache
        self.device = device
        self.num_layers = len(model.layers)
        config = model.rank_config  # this rank's heads
        self.scale = model.layers[0].scale  # the host attends with the layers' softmax scale
        on_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if on_cuda else None
        self.host_kernels = host_kernels
        self.hand_off = None
        if worker is not None:
            buffers = [HostRowBuffers.allocate(max_host_decodes, max_blocks_per_sequence, config.num_heads,
                                               config.num_kv_heads, config.head_dim, kv_cache.layout.dtype)
                       for _ in range(MAX_SUB_BATCHES)] if on_cuda else []
            if on_cuda and host_kernels.native and host_stage_available():
                self.hand_off = StreamOrderedHandOff(host_kernels, buffers, self.copy_stream, self.scale,
                                                     worker.num_threads, self.num_layers)
            else:
                self.hand_off = WorkerHandOff(host_kernels, worker, buffers, self.copy_stream, self.scale)
        # GPU busy time per iteration (for the trace): the iteration's span minus the time the
        # compute stream spent waiting for the host, from timing events on the compute stream
        # (inside a captured graph they are recorded as graph nodes).
        self.measure_gpu_busy = measure_gpu_busy and on_cuda
        self._span_events: list[torch.cuda.Event] = []
        self._wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @property
    def stream_ordered_host_work(self) -> bool:
        """Whether host attention is queued on CUDA streams (``StreamOrderedHandOff``)."""
        return self.hand_off is not None and self.hand_off.stream_ordered

    # -- public --------------------------------------------------------------------------------

    def run(self, batches: list[BatchInputs], order: StageOrder, swap_out: torch.Tensor,
            swap_in: torch.Tensor) -> torch.Tensor:
        """Queue all layers in ``order``; returns float32 logits ``[sum of requests, vocab]`` in
        batch order. Call ``raise_host_failure`` once the logits have been read.

        swap_out / swap_in: int64 host ``[n, 2]`` block pairs (gpu->host / host->gpu) to copy first.
        """
        self.prepare([inputs.metadata for inputs in batches])
        states = [_SubBatchState(inputs.metadata, self.model.embed(inputs.input_ids)) for inputs in batches]
        swap_events = self._start_swaps(swap_out, swap_in)
        try:
            self._walk(order, states, swap_events, range(self.num_layers))
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

    def embed(self, input_ids: list[torch.Tensor]) -> list[HiddenStates]:
        """Each sub-batch's int64 ``input_ids [T_b]`` embedded: the input of layer 0."""
        return [HiddenStates(self.model.embed(ids), None) for ids in input_ids]

    def forward_layers(self, states: list[HiddenStates], metadata: list[AttentionMetadata], order: StageOrder,
                       layers: range) -> list[HiddenStates]:
        """The steps of ``layers`` (consecutive, within the model) in ``order``, for sub-batches
        without swaps (``run`` queues those); ``states``: each sub-batch's input to ``layers.start``
        (``embed``'s for layer 0). Returns each sub-batch's output of ``layers.stop - 1``, with
        no host attention left pending. What ``PipelineGraphs`` captures, part by part, between
        ``embed`` and ``final_norm``; ``prepare`` and ``end`` stay outside the capture."""
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= self.num_layers:
            raise ValueError(f"layers must be a non-empty range of consecutive layers within "
                             f"[0, {self.num_layers}), got {layers}")
        if (layers.start == 0) != all(state.residual is None for state in states):
            raise ValueError(f"the states given for layers {layers} must have a residual exactly when "
                             f"they are not the embeddings (layers.start > 0)")
        walking = [_SubBatchState(meta, state.hidden, state.residual) for state, meta in zip(states, metadata)]
        self._walk(order, walking, None, layers)
        return [HiddenStates(state.hidden, state.residual) for state in walking]

    def final_norm(self, states: list[HiddenStates]) -> list[torch.Tensor]:
        """The final norm of every row of each sub-batch's output of the last layer:
        ``[T_b, hidden]`` per sub-batch."""
        return [self.model.final_norm(state.hidden, state.residual) for state in states]

    def prepare(self, metadata: list[AttentionMetadata]) -> None:
        """Before an iteration's work is queued (or replayed): load each sub-batch's host
        metadata for the hand-off, clear the host failure and time, start the span."""
        if self.hand_off is not None:
            self.hand_off.prepare(metadata)
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

    def host_failure_flag(self) -> torch.Tensor:
        """uint8 ``[1]`` on the compute device, queued on the current stream behind the host
        work queued before it: nonzero when the last iteration's host work failed. Under tensor
        parallelism the ranks max-reduce it, so that the driver learns of another rank's failure
        with its own tokens (``ModelRunner``, ``HostBatchRunner``)."""
        if self.hand_off is None:
            return torch.zeros(1, dtype=torch.uint8, device=self.device)
        return self.hand_off.failure_flag(self.device)

    def raise_host_failure(self) -> None:
        """Raise what failed in the last iteration's host work (after the device synced)."""
        if self.hand_off is not None:
            self.hand_off.raise_failure()

    def timing(self) -> IterationTiming:
        """The last iteration's timing events, which stay valid after later iterations are queued."""
        return IterationTiming(self._span_events, self._wait_events)

    def gpu_busy_seconds(self, timing: IterationTiming | None = None) -> float | None:
        """GPU time outside waits for the host of the iteration ``timing`` is of (default: the
        last one), once it has completed."""
        timing = timing or self.timing()
        if not self.measure_gpu_busy or None in timing.span_events or len(timing.span_events) != 2:
            return None
        start, end = timing.span_events
        try:
            waiting = sum(before.elapsed_time(after) for before, after in timing.wait_events)
        except RuntimeError as error:  # events a graph recorded that the driver cannot time
            logger.warning("GPU busy time not measured from now on: timing the waits for the host "
                           "failed (%s)", error)
            self.measure_gpu_busy = False
            return None
        return (start.elapsed_time(end) - waiting) / 1e3

    def host_busy_seconds(self) -> float:
        """The host attention time of the iterations run since the last call (once they have
        completed)."""
        return 0.0 if self.hand_off is None else self.hand_off.host_seconds()

    # -- the walk ------------------------------------------------------------------------------

    def _walk(self, order: StageOrder, states: list[_SubBatchState], swap_events, layers: range) -> None:
        """The expanded order's steps of ``layers``, in order."""
        if len(states) != order.num_sub_batches:
            raise ValueError(f"stage order {order.name!r} runs {order.num_sub_batches} sub-batches, "
                             f"the plan has {len(states)}")
        swaps_waited = -1  # the last layer whose swaps the compute stream waits for
        for step in order.steps(self.num_layers):
            if step.layer not in layers:
                continue
            state, layer = states[step.sub_batch], step.layer
            stage = step.stage
            if stage is Stage.PRE:
                if swap_events is not None and layer > swaps_waited:
                    torch.cuda.current_stream(self.device).wait_event(swap_events[layer])
                    swaps_waited = layer
                self._pre(state, layer)
            elif stage is Stage.ATTN_GPU:
                self._attention_gpu(state, layer)
            elif stage is Stage.ATTN_HOST:
                self._start_host_attention(state, layer, step.sub_batch)
            else:
                self._post(state, layer)

    def _pre(self, state: _SubBatchState, layer_index: int) -> None:
        layer = self.model.layers[layer_index]
        k_cache, v_cache = self.kv_cache.gpu_layers[layer_index]
        meta = state.metadata
        state.query, state.key, state.value, state.residual = layer.pre_attention(
            state.hidden, state.residual, meta, k_cache, v_cache)
        state.attention_output = torch.empty_like(state.query)
        if meta.num_offloaded_prefill_tokens:  # the prefill rows; slot -1 skips GPU-bound prompts
            host_k_cache, host_v_cache = self.kv_cache.host_layers_for_device[layer_index]
            prefill = slice(0, meta.num_prefill_tokens)
            torch.ops.neo.store_kv_cache(state.key[prefill], state.value[prefill], host_k_cache, host_v_cache,
                                         meta.prefill_host_slot_mapping)

    def _attention_gpu(self, state: _SubBatchState, layer_index: int) -> None:
        k_cache, v_cache = self.kv_cache.gpu_layers[layer_index]
        self.model.layers[layer_index].attention(state.query, state.key, state.value, state.metadata, k_cache,
                                                 v_cache, out=state.attention_output)

    def _start_host_attention(self, state: _SubBatchState, layer_index: int, sub_batch: int) -> None:
        meta = state.metadata
        if meta.num_host_decodes == 0:
            return
        if self.hand_off is None:
            raise RuntimeError("this engine has no host side (policy gpu-only), but the plan has host decodes")
        rows = slice(meta.num_gpu_tokens, meta.num_tokens)
        host_rows = HostRows(state.query[rows], state.key[rows], state.value[rows], state.attention_output[rows])
        k_cache, v_cache = self.kv_cache.host_layers[layer_index]
        state.pending = self.hand_off.start(sub_batch, layer_index, host_rows, meta, k_cache, v_cache)

    def _post(self, state: _SubBatchState, layer_index: int) -> None:
        pending, state.pending = state.pending, None
        if pending is not None:
            before = self._timing_event()
            self.hand_off.finish(pending)
            if before is not None:
                self._wait_events.append((before, self._timing_event()))
        layer = self.model.layers[layer_index]
        state.hidden, state.residual = layer.post_attention(state.attention_output, state.residual,
                                                            state.metadata)
        state.query = state.key = state.value = state.attention_output = None

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
            if pending is not None:
                self.hand_off.drain(pending)
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    # -- whole-request swaps -------------------------------------------------------------------

    def _start_swaps(self, swap_out: torch.Tensor, swap_in: torch.Tensor):
        """Queue every layer's block copies on the copy stream; one event per layer."""
        if swap_out.numel() == 0 and swap_in.numel() == 0:
            return None
        if self.copy_stream is None:
            for layer_index in range(self.num_layers):
                self.kv_cache.swap_layer(layer_index, swap_out, swap_in)
            return None
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        events = []
        with torch.cuda.stream(self.copy_stream):
            for layer_index in range(self.num_layers):
                self.kv_cache.swap_layer(layer_index, swap_out, swap_in)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
                events.append(event)
        return events
