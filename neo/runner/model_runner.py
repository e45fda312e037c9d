"""``ModelRunner``: executes a plan. It never decides anything."""

import time
from collections.abc import Callable

import torch

from .batch_inputs import build_batch_inputs
from .decode_graphs import DecodeGraphs
from .executor import PipelineExecutor
from .host_batches import HostBatchResult, HostBatchRunner
from neo.kv.kv_cache import KVCache
from .pipeline_graphs import PipelineGraphs
from .sampler import Sampler
from neo.sched.scheduler_output import SchedulerOutput

HOST_BATCH_POLL_SECONDS = 0.0005  # between checks whether a host batch has completed


def _block_pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(len(pairs), 2)


class ModelRunner:
    """Builds each sub-batch's inputs, runs the executor, samples one token per request."""

    def __init__(self, model, kv_cache: KVCache, executor: PipelineExecutor, device: torch.device,
                 decode_graphs: DecodeGraphs | None = None, pipeline_graphs: PipelineGraphs | None = None,
                 host_batches: HostBatchRunner | None = None):
        """``host_batches``: runs the host batches of the async host pipeline (None: lockstep)."""
        self.model = model
        self.kv_cache = kv_cache
        self.executor = executor
        self.device = device
        self.decode_graphs = decode_graphs
        self.pipeline_graphs = pipeline_graphs
        self.host_batches = host_batches
        self.replayed_graph = False  # whether the last plan was replayed from a captured graph
        self.queue_seconds = 0.0  # the last plan's: building its inputs and queuing its device work
        self._replayed_decode_graph = False  # ... from DecodeGraphs (no executor involved)
        self.block_size = kv_cache.layout.block_size
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, on_launched: Callable[[], None] | None = None) -> list[int]:
        """Run the plan; returns the sampled token of each request in ``plan.requests`` order.
        ``on_launched`` is called once the device work (sampling included) is queued, before
        waiting for the tokens."""
        self.replayed_graph = False
        began = time.perf_counter()
        batches = [build_batch_inputs(batch, self.block_size, self.device, self.executor.pad_rows)
                   for batch in plan.sub_batches if batch]
        requests = [request for inputs in batches for request in inputs.requests]
        if not requests:
            if plan.swap_out or plan.swap_in:
                self.swap(plan)
            self.queue_seconds = time.perf_counter() - began
            if on_launched is not None:
                on_launched()
            return []
        swaps = bool(plan.swap_out or plan.swap_in)
        graphs = self.decode_graphs
        self._replayed_decode_graph = (graphs is not None and len(batches) == 1 and not swaps
                                       and graphs.can_run(batches[0]))
        logits = None
        if self._replayed_decode_graph:
            logits = graphs.run(batches[0])
        elif self.pipeline_graphs is not None and not swaps:
            shape = self.pipeline_graphs.shape(batches)
            if shape is not None:
                logits = self.pipeline_graphs.run(batches, shape)
        self.replayed_graph = logits is not None
        if logits is None:
            logits = self.executor.run(batches, _block_pairs(plan.swap_out), _block_pairs(plan.swap_in))
        sampled = self.sampler(logits, [r.sampling_params for r in requests], [r.generator for r in requests])
        self.queue_seconds = time.perf_counter() - began
        if on_launched is not None:
            on_launched()
        tokens = sampled.tolist()  # waits for the device
        self.executor.raise_host_failure()
        return tokens

    def launch_host_batch(self, plan: SchedulerOutput) -> None:
        """Launch the plan's host batch on its own stream (async host pipeline)."""
        if self.host_batches is None:
            raise RuntimeError("this engine runs no host batches (host_pipeline is not 'async')")
        self.host_batches.launch(plan.host_batch)

    @property
    def host_batch_in_flight(self) -> bool:
        return self.host_batches is not None and self.host_batches.in_flight

    def collect_host_batch(self, wait_seconds: float) -> HostBatchResult | None:
        """The host batch in flight once it has completed, waiting up to ``wait_seconds`` for
        it; None if none is in flight or it is still running."""
        if not self.host_batch_in_flight:
            return None
        deadline = time.perf_counter() + wait_seconds
        while not self.host_batches.ready() and time.perf_counter() < deadline:
            time.sleep(HOST_BATCH_POLL_SECONDS)
        return self.host_batches.collect(wait=False)

    def gpu_busy_seconds(self) -> float | None:
        """GPU busy time of the last iteration, when the executor's work (queued or replayed
        from a pipeline graph) measured it."""
        return None if self._replayed_decode_graph else self.executor.gpu_busy_seconds()

    def host_busy_seconds(self) -> float | None:
        """Host attention time of the last iteration when the executor measured it (host
        functions on a CUDA stream); None when the worker thread counts it."""
        return None if self._replayed_decode_graph else self.executor.host_busy_seconds()

    def swap(self, plan: SchedulerOutput) -> None:
        swap_out, swap_in = _block_pairs(plan.swap_out), _block_pairs(plan.swap_in)
        for layer_index in range(self.kv_cache.layout.num_layers):
            self.kv_cache.swap_layer(layer_index, swap_out, swap_in)
