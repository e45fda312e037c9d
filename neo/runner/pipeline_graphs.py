"""``PipelineGraphs``: CUDA graphs of decode-only iterations with host decodes.

Queuing an iteration of the offloading pipeline costs the launching thread, per layer and
sub-batch, the GPU stages' launches plus the host hand-off; on large models that can take as
long as the GPU work itself, so small two-sub-batch iterations would run at the launching
thread's pace with the GPU idle between launches. A decode-only iteration (no prefills) is
instead captured once per padded shape, with everything the executor queues: both
sub-batches' GPU stages on the compute stream, and on the copy stream each layer's copies to
pinned memory, the host function (a graph host node) and the copy back, ordered by the same
events. It is then replayed with the iteration's inputs copied into static buffers, and the
host functions read the iteration's host metadata from the buffers the executor loads before
each replay (``PipelineExecutor.prepare``).

Shapes: sub-batch ``s`` of a replay holds ``g`` GPU decodes and ``c`` host decodes, captured as
``G >= g`` and ``C >= c`` rows (powers of two, and the largest count), laid out::

    [ GPU decodes (g) | padding (G - g) | host decodes (c) | padding (C - c) ]

Padding GPU rows decode a dummy token (slot -1: nothing stored; length 1 against block 0) as in
``DecodeGraphs``; padding host rows go through the GPU stages and the copies, but the host
functions attend only over the real rows, so they cost the host nothing. Logits of the real
rows are computed after the replay. Graphs are captured on the first iteration of a shape (or
ahead of it, ``capture``: the host batches' shapes at start-up) and at most ``capacity`` shapes
are kept (the least recently used is dropped). On one rank a capture
that fails turns the graphs off with a warning; iterations then run eagerly. Under tensor
parallelism the graphs hold the model's collectives, every rank captures the same shape at the
same plan, and a capture that fails is raised instead: one rank falling back to eager work while
the others replay would put captured and eager collectives of one plan on one communicator. The
rank's failure stops every rank (``neo.engine.rank_workers``); ``release`` frees the graphs
before a rank leaves its group.

Parts: the layers may be captured as consecutive parts (``parts``, from
``neo.runner.executor.layer_parts``), one graph per (order, shape, part), all captured in part
order on the shape's first iteration into the shared memory pool. The first part starts from the
embeddings, the last ends with the final norm; between two parts the hidden states and the
residual stream stay in the earlier part's output tensors (kept with the capture, so no later
capture reuses their memory), which the next part reads. ``start`` loads an iteration's inputs
and returns a ``PartReplay`` that queues one part at a time, so a caller can hold back the
later parts (``neo.runner.host_batches``); ``run`` queues them all at once. With one part
(the default) a replay is the single graph of the whole iteration.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from neo.models.attention_metadata import AttentionMetadata
from neo.sched.stage_order import StageOrder
from .batch_inputs import BatchInputs
from .decode_graphs import graph_block_width
from .executor import MAX_SUB_BATCHES, HiddenStates, LayerPartWalk, PipelineExecutor

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 32


def padded_counts(largest: int) -> list[int]:
    """0, then 1, 2, 4, ... below ``largest``, and ``largest``."""
    sizes, size = [0], 1
    while size < largest:
        sizes.append(size)
        size *= 2
    return sizes + [largest]


def padded(count: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= count)


def graph_shape(metadata: list[AttentionMetadata], sizes: list[int], max_blocks: int
                ) -> tuple[tuple[int, int], ...] | None:
    """The padded ``((G, C), ...)`` that sub-batches of ``metadata`` replay with (row counts
    from ``sizes``); None unless it is a decode-only iteration with host decodes whose GPU
    block tables are at most ``max_blocks`` wide and whose counts are within ``sizes``."""
    largest = sizes[-1]
    shape = []
    for meta in metadata:
        if (meta.num_prefill_tokens or meta.num_offloaded_prefill_tokens
                or meta.num_gpu_decodes > largest or meta.num_host_decodes > largest
                or meta.gpu_block_table.shape[1] > max_blocks):
            return None
        shape.append((padded(meta.num_gpu_decodes, sizes), padded(meta.num_host_decodes, sizes)))
    if not any(cpu for _, cpu in shape):
        return None  # GPU decodes alone: DecodeGraphs' job
    return tuple(shape)


@dataclass
class _Capture:
    graphs: list[torch.cuda.CUDAGraph]  # one per part, replayed in part order
    boundaries: list[list[HiddenStates]]  # per part, per sub-batch: its output, the next part's input
    hidden: list[torch.Tensor]  # per sub-batch: [G + C, hidden] final-normed states
    wait_events: list  # the compute stream's timed waits for the host inside the graphs


class StaticInputs:
    """One sub-batch's static input buffers on the device, ``rows = largest G + largest C``."""

    def __init__(self, rows: int, gpu_rows: int, max_blocks: int, device: torch.device):
        int32, int64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(rows, **int64)
        self.positions = torch.zeros(rows, **int64)
        self.slot_mapping = torch.full((rows,), -1, **int64)
        self.block_table = torch.zeros(gpu_rows, max_blocks, **int32)
        self.seq_lens = torch.ones(gpu_rows, **int32)

    def metadata(self, gpu_rows: int, host_rows: int) -> AttentionMetadata:
        """The captured sub-batch's metadata (host fields empty: the host functions read the
        executor's buffers)."""
        rows = gpu_rows + host_rows
        return AttentionMetadata.for_captured_decodes(self.positions[:rows], self.slot_mapping[:rows],
                                                      self.block_table[:gpu_rows], self.seq_lens[:gpu_rows],
                                                      host_rows)

    def load(self, inputs: BatchInputs, gpu_rows: int, host_rows: int) -> None:
        """Copy a sub-batch's inputs in, laid out for the captured ``gpu_rows`` / ``host_rows``."""
        meta = inputs.metadata
        gpu, host = meta.num_gpu_decodes, meta.num_host_decodes
        host_part = slice(gpu_rows, gpu_rows + host)
        self.input_ids[:gpu].copy_(inputs.input_ids[:gpu], non_blocking=True)
        self.input_ids[host_part].copy_(inputs.input_ids[gpu:gpu + host], non_blocking=True)
        self.positions[:gpu].copy_(meta.positions[:gpu], non_blocking=True)
        self.positions[host_part].copy_(meta.positions[gpu:gpu + host], non_blocking=True)
        # Another shape may have left GPU slots in rows that are padding or host rows here.
        self.slot_mapping[:gpu].copy_(meta.slot_mapping[:gpu], non_blocking=True)
        self.slot_mapping[gpu:gpu_rows + host_rows].fill_(-1)
        if gpu_rows:
            width = meta.gpu_block_table.shape[1]
            self.seq_lens[:gpu].copy_(meta.gpu_seq_lens, non_blocking=True)
            self.seq_lens[gpu:gpu_rows].fill_(1)
            self.block_table[:gpu, :width].copy_(meta.gpu_block_table, non_blocking=True)
            self.block_table[gpu:gpu_rows].zero_()

    @staticmethod
    def real_rows(hidden: torch.Tensor, inputs: BatchInputs, gpu_rows: int) -> list[torch.Tensor]:
        meta = inputs.metadata
        return [hidden[:meta.num_gpu_decodes], hidden[gpu_rows:gpu_rows + meta.num_host_decodes]]


class PipelineGraphs:
    """Captured decode-only iterations with host decodes, keyed by padded shape."""

    def __init__(self, model, executor: PipelineExecutor, max_decodes: int, max_context: int,
                 block_size: int, device: torch.device, capacity: int = DEFAULT_CAPACITY,
                 parts: list[range] | None = None):
        """``parts``: consecutive layer ranges from layer 0 to the last, one graph each (None:
        one part of every layer)."""
        if not executor.stream_ordered_host_work:
            raise ValueError("pipeline graphs need the stream-ordered host stage (CUDA and the ISPC kernels)")
        self.parts = [range(executor.num_layers)] if parts is None else list(parts)
        starts = [0] + [layers.stop for layers in self.parts[:-1]]
        if ([layers.start for layers in self.parts] != starts or self.parts[-1].stop != executor.num_layers
                or any(layers.step != 1 or not layers for layers in self.parts)):
            raise ValueError(f"parts must be consecutive non-empty layer ranges from 0 to {executor.num_layers}, "
                             f"got {self.parts}")
        self.model = model
        self.executor = executor
        self.device = device
        self.capacity = capacity
        self.sizes = padded_counts(max_decodes)
        self.max_blocks = graph_block_width(max_context, block_size)
        largest = self.sizes[-1]
        self.inputs = [StaticInputs(2 * largest, largest, self.max_blocks, device) for _ in range(MAX_SUB_BATCHES)]
        self.captures: OrderedDict[tuple, _Capture] = OrderedDict()
        self.pool = None
        self.capture_stream = torch.cuda.Stream(device)  # see ``neo.cuda_graphs``: a workspace of its own
        self.enabled = True

    def release(self) -> None:
        """Free every capture and turn the graphs off, after their last replay (a rank must,
        before it leaves its tensor-parallel group: ``DecodeGraphs.release``)."""
        for capture in self.captures.values():
            for graph in capture.graphs:
                graph.reset()
        self.captures.clear()
        self.enabled = False

    def shape(self, batches: list[BatchInputs]) -> tuple[tuple[int, int], ...] | None:
        """The padded ``((G, C), ...)`` a plan's sub-batches replay with; None when the plan is
        not a decode-only iteration with host decodes within the captured limits. (A plan's
        swaps are the caller's to copy before the replay.)"""
        if not self.enabled or not 1 <= len(batches) <= len(self.inputs):
            return None
        return graph_shape([inputs.metadata for inputs in batches], self.sizes, self.max_blocks)

    @torch.inference_mode()
    def run(self, batches: list[BatchInputs], shape: tuple[tuple[int, int], ...],
            order: StageOrder) -> torch.Tensor | None:
        """Replay ``shape`` (from ``shape``) in ``order`` for the plan, every part at once;
        returns float32 logits ``[requests, vocab]`` in batch order, or None when the capture
        failed (run the plan eagerly)."""
        replay = self.start(batches, shape, order)
        if replay is None:
            return None
        while not replay.all_queued:
            replay.queue_next()
        return replay.logits()

    @torch.inference_mode()
    def capture(self, shape: tuple[tuple[int, int], ...], order: StageOrder) -> bool:
        """Capture ``shape`` in ``order`` now, unless it is captured already (``start`` would
        capture it in the first plan of that shape); False when the capture failed and the
        graphs are off (one rank; above one, the failure is raised)."""
        return (order.name, shape) in self.captures or self._capture(shape, order) is not None

    @torch.inference_mode()
    def start(self, batches: list[BatchInputs], shape: tuple[tuple[int, int], ...],
              order: StageOrder) -> "PartReplay | None":
        """Capture ``shape`` in ``order`` if it is new, then load the plan's inputs (the static
        buffers and the executor's host metadata, which stay the plan's until its last part has
        run); returns the replay to queue part by part, or None when the capture failed (run the
        plan eagerly)."""
        key = (order.name, shape)
        capture = self.captures.get(key)
        if capture is None:
            capture = self._capture(shape, order)
            if capture is None:
                return None
        self.captures.move_to_end(key)
        self.executor.prepare([inputs.metadata for inputs in batches])
        for static, inputs, (gpu_rows, host_rows) in zip(self.inputs, batches, shape):
            static.load(inputs, gpu_rows, host_rows)
        return PartReplay(self, capture, batches, shape)

    def _capture(self, shape: tuple[tuple[int, int], ...], order: StageOrder) -> _Capture | None:
        while len(self.captures) >= self.capacity:
            self.captures.popitem(last=False)
        metadata = [static.metadata(gpu_rows, host_rows)
                    for static, (gpu_rows, host_rows) in zip(self.inputs, shape)]
        input_ids = [static.input_ids[:gpu_rows + host_rows] for static, (gpu_rows, host_rows) in zip(self.inputs, shape)]
        last_layer = self.parts[-1].stop
        graphs, boundaries = [], []
        self.executor.take_wait_events()
        try:
            for layers in self.parts:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream,
                                      capture_error_mode="thread_local"):
                    states = self.executor.embed(input_ids) if not boundaries else boundaries[-1]
                    states = self.executor.forward_layers(states, metadata, order, layers)
                    if layers.stop == last_layer:
                        hidden = self.executor.final_norm(states)
                self.pool = graph.pool()
                graphs.append(graph)
                boundaries.append(states)
        except RuntimeError as error:
            if self.model.parallel.size > 1:
                raise RuntimeError(f"capturing the pipelined decode iteration {shape} as CUDA graphs failed on "
                                   f"tensor-parallel rank {self.model.parallel.rank} ({error}); run with "
                                   f"use_cuda_graphs off (--no-cuda-graphs)") from error
            self.enabled = False
            self.captures.clear()
            logger.warning("capturing the pipelined decode iteration %s as CUDA graphs failed (%s): "
                           "these iterations run eagerly from now on", shape, error)
            return None
        capture = _Capture(graphs, boundaries, hidden, self.executor.take_wait_events())
        self.captures[(order.name, shape)] = capture
        logger.info("captured a pipelined decode CUDA graph for (GPU, host) rows %s in the %s order, "
                    "in %d part(s)", shape, order.name, len(graphs))
        return capture


class PartReplay(LayerPartWalk):
    """One plan's replay of a captured iteration (``PipelineGraphs.start``), its parts' graphs
    queued in order on the current stream, then its logits."""

    def __init__(self, graphs: PipelineGraphs, capture: _Capture, batches: list[BatchInputs],
                 shape: tuple[tuple[int, int], ...]):
        super().__init__(len(capture.graphs))
        self._graphs = graphs
        self._capture = capture
        self._batches = batches
        self._shape = shape

    def _queue_part(self, index: int) -> None:
        self._capture.graphs[index].replay()

    def _logits(self) -> torch.Tensor:
        executor = self._graphs.executor
        executor.end(self._capture.wait_events)
        rows = [row for static, inputs, hidden, (gpu_rows, _) in zip(self._graphs.inputs, self._batches,
                                                                       self._capture.hidden, self._shape)
                for row in static.real_rows(hidden, inputs, gpu_rows)]
        return executor.compute_logits(torch.cat(rows))
