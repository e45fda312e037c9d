"""``DecodeGraphs``: CUDA graphs of the whole forward for decode-only batches.

A decode-only iteration launches a few hundred small kernels whose launch time on the host can
exceed their run time on the GPU. The forward (all layers and the final norm) is captured once
per padded batch size and replayed with the batch's inputs copied into static buffers; the
logits of the real rows are computed after the replay (one GEMM, its rows padded to a ``neo.runner.gemm_rows``
bucket), so the graphs keep only small hidden-state outputs alive (a captured ``[batch, vocab]``
float32 output per size would hold several GiB at a few hundred sequences). Padding rows decode
a dummy token (slot -1: nothing is stored; length 1 against block 0) whose logits are dropped.
Used only for one sub-batch of GPU decodes with block tables no wider than the captured width
(longer contexts run eagerly): the runner's ``GraphCoverage``. A plan's swaps are copied before
the replay, on the same stream.

The padded batch sizes are 1, 2, 4 and every multiple of 8 up to the largest batch. Coarser
steps (the GEMM row buckets: multiples of 32 above 64) would halve the graphs to capture at
start-up, but every padding row costs a replay its share of the GEMMs and the elementwise
kernels, so batches between the coarser sizes would decode a little slower all the time.

Under tensor parallelism the captured forward holds the model's collectives: every rank captures
the same sizes in the same order at start-up, and replays whenever the driver's plan does, so
the ranks meet in the same collectives.

Every owner of graphs (these, each ``PipelineGraphs``) captures on a stream of its own. A
captured cuBLAS GEMM keeps the workspace of the stream it was captured on (PyTorch keys the
workspaces by stream), and ``torch.cuda.graph`` otherwise captures every graph on one shared
stream: the GPU iterations' graphs and the host batches' graphs, which the async host pipeline
replays at the same time on two streams, then shared a workspace, and their GEMMs waited on
each other forever: the GPU deadlocked (``benchmarks/concurrent_graphs.py`` reproduces it).
"""

import logging

import torch

from neo.models.attention_metadata import AttentionMetadata
from .batch_inputs import BatchInputs
from .gemm_rows import padded_logits

logger = logging.getLogger(__name__)


def padded_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to ``max_batch_size`` (included)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [size for size in (1, 2, 4) if size < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


def padded_batch_size(count: int, sizes: list[int]) -> int:
    """The captured size a batch of ``count`` decodes replays: the smallest of ``sizes`` at or
    above it (a ``ValueError`` when none is)."""
    size = next((size for size in sizes if size >= count), None)
    if size is None or count < 1:
        raise ValueError(f"no captured batch size for {count} decodes (sizes {sizes[0]} to {sizes[-1]})")
    return size


def graph_block_width(max_context: int, block_size: int) -> int:
    """Block-table columns the graphs are captured with: wider tables run eagerly."""
    return -(-max_context // block_size)


class DecodeGraphs:
    """Captured forwards, one per padded batch size, sharing one memory pool."""

    def __init__(self, model, kv_cache, max_batch_size: int, max_context: int, device: torch.device):
        self.model = model
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.max_blocks = graph_block_width(max_context, self.block_size)
        self.sizes = padded_batch_sizes(max_batch_size)
        largest = self.sizes[-1]
        int32, int64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(largest, **int64)
        self.positions = torch.zeros(largest, **int64)
        self.slot_mapping = torch.full((largest,), -1, **int64)
        self.block_table = torch.zeros(largest, self.max_blocks, **int32)
        self.seq_lens = torch.ones(largest, **int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # [size, hidden] final-normed states
        self._kv_layers = kv_cache.gpu_layers
        self.capture_stream = torch.cuda.Stream(device)
        self._capture_all()

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata.for_captured_decodes(self.positions[:size], self.slot_mapping[:size],
                                                      self.block_table[:size], self.seq_lens[:size], 0)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first, so the pool fits every later one
            meta = self._metadata(size)

            def forward():
                return self.model.forward(self.input_ids[:size], meta, self._kv_layers)

            stream = self.capture_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up outside the graph (kernel selection, caches)
                forward()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (the NCCL watchdog's event queries under
            # tensor parallelism) do not invalidate the capture.
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.hidden[size] = forward()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def release(self) -> None:
        """Free the graphs and their memory, after their last replay. Under tensor parallelism
        a rank releases them before it leaves its process group: NCCL cannot destroy a
        communicator whose collectives a live graph holds, and leaving would wait forever."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.hidden.clear()

    def run(self, inputs: BatchInputs) -> torch.Tensor:
        """Replay for a decode-only batch the runner's ``GraphCoverage`` says these graphs cover;
        returns float32 logits ``[num_decodes, vocab]``."""
        meta = inputs.metadata
        count = meta.num_gpu_decodes
        size = padded_batch_size(count, self.sizes)
        self.input_ids[:count].copy_(inputs.input_ids[:count], non_blocking=True)
        self.positions[:count].copy_(meta.positions[:count], non_blocking=True)
        self.slot_mapping[:count].copy_(meta.slot_mapping[:count], non_blocking=True)
        self.slot_mapping[count:size].fill_(-1)
        self.seq_lens[:count].copy_(meta.gpu_seq_lens, non_blocking=True)
        self.seq_lens[count:size].fill_(1)
        width = meta.gpu_block_table.shape[1]
        self.block_table[:count, :width].copy_(meta.gpu_block_table, non_blocking=True)
        self.block_table[count:size].zero_()
        self.graphs[size].replay()
        return padded_logits(self.model, self.hidden[size][:count])
