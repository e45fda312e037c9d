"""``LLMEngine``: add requests, then ``step`` = schedule -> execute -> postprocess."""

import itertools
import logging
import time
from collections.abc import Callable

import torch

from neo.sched.async_offload_scheduler import AsyncOffloadScheduler
from neo.sched.block_manager import BlockManager
from neo.config import EngineConfig
from neo.runner.host_worker import HostAttentionWorker, default_cpu_attention_threads
from neo.runner.decode_graphs import DecodeGraphs
from neo.runner.executor import PipelineExecutor
from neo.runner.gemm_rows import warm_up as warm_up_gemm_rows
from neo.runner.host_batches import HostBatchResult, HostBatchRunner
from neo.kv.kv_cache import GIB, CacheLayout, KVCache
from neo.kv.budget import gpu_kv_cache_bytes
from .metrics import EngineMetrics, IterationRecord, IterationTrace
from neo.models.config import parse_dtype
from neo.runner.model_runner import ModelRunner
from neo.sched.offload_scheduler import OffloadScheduler
from neo.outputs import CompletionOutput, RequestMetrics, RequestOutput
from neo.runner.pipeline_graphs import PipelineGraphs
from neo.runner.profiler import load_perf_model
from neo.request import Request, RequestStatus
from neo.sampling_params import SamplingParams
from neo.sched.scheduler import Scheduler
from neo.sched.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

# With no GPU work to run, a step waits this long at most for the host batch in flight, so that
# a caller adding requests meanwhile (the server) gets them scheduled soon.
HOST_BATCH_WAIT_SECONDS = 0.02


class LLMEngine:
    """The serving engine. Not thread-safe: one thread owns it (see ``neo.server``)."""

    def __init__(self, config: EngineConfig):
        from neo.models.loader import load_model, resolve_model_config
        from neo.tokenizer import load_tokenizer

        self.config = config
        self.device = config.compute_device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model_config = resolve_model_config(config.model)
        self.dtype = self._resolve_dtype(config.dtype, model_config.dtype)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.model = load_model(config.model, dtype=self.dtype, device=self.device,
                                load_format=config.load_format, seed=config.seed,
                                max_positions=self.max_model_len)
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer and self.tokenizer.eos_token_ids
                                       else self.model_config.eos_token_ids)

        self.layout = CacheLayout.for_budgets(
            self.model_config, self.dtype, config.block_size,
            gpu_bytes=gpu_kv_cache_bytes(config, self.model, self.device, self.max_model_len),
            cpu_bytes=int(config.cpu_kv_cache_gib * GIB))
        if self.layout.num_gpu_blocks == 0 and config.policy != "full-offload":
            raise ValueError(f"the GPU KV pool holds no block of {self.layout.block_bytes} bytes: "
                             f"raise gpu_kv_cache_gib or gpu_memory_utilization")
        self.kv_cache = KVCache(self.layout, self.device)
        self.block_manager = BlockManager(self.layout.num_gpu_blocks, self.layout.num_host_blocks,
                                          config.block_size)
        self.worker = None
        if config.policy != "gpu-only":
            self.worker = HostAttentionWorker(config.cpu_attention_threads or default_cpu_attention_threads())
        max_blocks_per_sequence = -(-self.max_model_len // config.block_size)
        pad_rows = config.pad_gemm_rows if config.pad_gemm_rows is not None else self.device.type == "cuda"
        executor = PipelineExecutor(self.model, self.kv_cache, self.device, self.worker,
                                    max_host_decodes=config.max_num_seqs,
                                    max_blocks_per_sequence=max_blocks_per_sequence,
                                    measure_gpu_busy=config.trace_path is not None, pad_rows=pad_rows)
        asynchronous = config.host_pipeline == "async" and self.worker is not None
        graph_context = None
        if self.device.type == "cuda" and config.use_cuda_graphs:
            graph_context = min(self.max_model_len, config.cuda_graph_max_context)
        decode_graphs = pipeline_graphs = host_batches = None
        if graph_context is not None:
            decode_graphs = DecodeGraphs(self.model, self.kv_cache, config.max_num_seqs, graph_context, self.device)
            if executor.stream_ordered_host_work and not asynchronous:
                pipeline_graphs = PipelineGraphs(self.model, executor, config.max_num_seqs, graph_context,
                                                 config.block_size, self.device)
        if asynchronous:
            host_batches = HostBatchRunner(self.model, self.kv_cache, self.worker, self.device, config.max_num_seqs,
                                           max_blocks_per_sequence, graph_context, pad_rows)
        if pad_rows and self.device.type == "cuda":
            warm_up_gemm_rows(self.model, config.max_num_batched_tokens, config.max_num_seqs)
        self.runner = ModelRunner(self.model, self.kv_cache, executor, self.device, decode_graphs, pipeline_graphs,
                                  host_batches)
        if config.policy == "gpu-only":
            self.scheduler = Scheduler(config, self.block_manager)
        else:  # the profiler, when it runs, measures through the runner built above
            scheduler_class = AsyncOffloadScheduler if asynchronous else OffloadScheduler
            self.scheduler = scheduler_class(config, self.block_manager, load_perf_model(config, self),
                                             self.model_config.num_layers)
        self.metrics = EngineMetrics()
        self.trace = IterationTrace() if config.trace_path else None
        self._requests: dict[str, Request] = {}
        self._host_batch_plan: SchedulerOutput | None = None  # the plan that launched the batch in flight
        self._host_batch_wait_seconds = 0.0  # steps spent waiting for it
        self._request_counter = itertools.count()
        logger.info("neo engine: %s on %s (%s), policy %s, GPU pool %d blocks (%.2f GiB), host pool "
                    "%d blocks (%.2f GiB)", self.model_config.name or config.model, self.device,
                    self.dtype, config.policy, self.layout.num_gpu_blocks,
                    self.layout.num_gpu_blocks * self.layout.block_bytes / GIB,
                    self.layout.num_host_blocks, self.layout.num_host_blocks * self.layout.block_bytes / GIB)

    def _resolve_dtype(self, name: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if name == "auto":
            return checkpoint_dtype if self.device.type == "cuda" else torch.float32
        return parse_dtype(name)

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Validate and queue a request. Raises ``ValueError`` naming the problem; the engine
        and the requests already queued are unaffected by a rejected one."""
        params = sampling_params or SamplingParams()
        request_id = str(next(self._request_counter)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids, params)
        request = Request(request_id, token_ids, params, prompt=text, arrival_time=arrival_time)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer.json: pass prompts "
                                 f"as lists of token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return None, list(prompt)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        length = len(token_ids)
        if length == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((token for token in token_ids if not 0 <= token < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if length >= self.max_model_len:
            raise ValueError(f"prompt of {length} tokens is too long: the model's context is "
                             f"{self.max_model_len} tokens (prompt + at least one new token)")
        if length > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt of {length} tokens exceeds max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens} (a prompt is prefilled in one "
                             f"iteration); raise max_num_batched_tokens")
        capacity = self._largest_pool_tokens()
        if length + 1 > capacity:
            raise ValueError(f"prompt of {length} tokens can never fit the KV pools: the largest "
                             f"holds {capacity} tokens (GPU pool {self.layout.num_gpu_blocks} "
                             f"blocks, host pool {self.layout.num_host_blocks} blocks of "
                             f"{self.config.block_size} tokens)")

    def _largest_pool_tokens(self) -> int:
        if self.config.policy == "gpu-only":
            blocks = self.layout.num_gpu_blocks
        elif self.config.policy == "full-offload":
            blocks = self.layout.num_host_blocks
        else:
            blocks = max(self.layout.num_gpu_blocks, self.layout.num_host_blocks)
        return blocks * self.config.block_size

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request; its blocks are free when this returns. False if it is unknown/done."""
        request = self._requests.pop(str(request_id), None)
        if request is None or request.is_finished:
            return False
        self.scheduler.abort(request, reason)
        request.finish_time = time.monotonic()
        self.metrics.requests_aborted += 1
        return True

    def abort_all(self) -> int:
        """Abort every unfinished request; returns how many there were."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort_request(request_id)
        return len(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests still to finish, or a host batch still to collect (its blocks with it)."""
        return self.scheduler.num_unfinished > 0 or self.runner.host_batch_in_flight

    # -- the loop ------------------------------------------------------------------------------

    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> postprocess. Returns the requests that got a
        token (finished ones marked so).

        ``on_launched`` is called once per step: when the iteration's device work is queued,
        before the engine waits for it (at once when the plan is empty). A caller that hands
        out outputs on another thread (``neo.server``) passes the previous iteration's there,
        so that handing them out overlaps the device's work instead of delaying the launch.

        Under the async host pipeline the step first launches the plan's host batch, if any,
        and ends by collecting the host batch in flight if it has completed (waiting for it a
        little when the plan had no GPU work); its requests' tokens are among the outputs.
        """
        segments_freed = self._device_segments_freed()
        scheduling_start = time.perf_counter()
        plan = self.scheduler.schedule()
        start = time.perf_counter()
        self.metrics.schedule_seconds += start - scheduling_start
        if plan.host_batch is not None:
            self._launch_host_batch(plan)
        launch_seconds = time.perf_counter() - start
        outputs = []
        if plan.is_empty:
            if on_launched is not None:
                on_launched()
        else:
            try:
                tokens = self.runner.execute(plan, on_launched)
            except BaseException:
                self._fail(plan.requests)
                raise
            elapsed = time.perf_counter() - start
            self._count(plan)
            host_seconds = self._host_seconds()
            self.scheduler.observe(plan, host_seconds, elapsed)
            if self.trace is not None:
                self._record(plan, elapsed, host_seconds, start - scheduling_start, launch_seconds, segments_freed)
            outputs = self._postprocess(plan, tokens)
        if self.runner.host_batch_in_flight:
            outputs += self._collect_host_batch(HOST_BATCH_WAIT_SECONDS if plan.is_empty else 0.0)
        if plan.host_batch is not None or not plan.is_empty:
            self.metrics.busy_seconds += time.perf_counter() - start
        return outputs

    def _host_seconds(self) -> float:
        """Host attention time of the iteration just executed."""
        if self.worker is None:
            return 0.0
        measured = self.runner.host_busy_seconds()
        return self.worker.take_busy_seconds() if measured is None else measured

    def _fail(self, requests: list[Request]) -> None:
        """Their iteration (or host batch) raised: end them (their KV may be half written) and
        give their blocks back; every other request carries on."""
        for request in requests:
            if not request.is_finished:
                logger.error("request %s ended: its iteration failed", request.request_id)
                self.abort_request(request.request_id, reason="error")

    # -- host batches (async host pipeline) ----------------------------------------------------

    def _launch_host_batch(self, plan: SchedulerOutput) -> None:
        self._host_batch_plan = plan
        self._host_batch_wait_seconds = 0.0
        try:
            self.runner.launch_host_batch(plan)
        except BaseException:
            self._fail(self.scheduler.host_batch_done(None))
            raise

    def _collect_host_batch(self, wait_seconds: float) -> list[RequestOutput]:
        """Hand out the host batch's tokens if it has completed (waiting up to ``wait_seconds``)."""
        waited = time.perf_counter()
        try:
            result = self.runner.collect_host_batch(wait_seconds)
        except BaseException:
            self._fail(self.scheduler.host_batch_done(None))
            raise
        finally:
            self._host_batch_wait_seconds += time.perf_counter() - waited
        if result is None:
            return []
        requests = self.scheduler.host_batch_done(result.host_seconds)
        self.metrics.host_batches += 1
        self.metrics.host_decode_tokens += len(result.requests)
        if self.trace is not None:
            self._record_host_batch(result)
        tokens = dict(zip(map(id, result.requests), result.tokens))
        outputs = self._append_tokens([(request, tokens[id(request)]) for request in requests])
        self.scheduler.remove_finished()
        return outputs

    def _device_segments_freed(self) -> int | None:
        """Segments the device's caching allocator has returned so far (traced CUDA engines only)."""
        if self.trace is None or self.device.type != "cuda":
            return None
        return torch.cuda.memory_stats(self.device).get("segment.all.freed", 0)

    def _record(self, plan: SchedulerOutput, elapsed: float, host_busy: float, schedule_seconds: float,
                launch_seconds: float, segments_freed_before: int | None) -> None:
        segments_freed = self._device_segments_freed()
        batches = [batch for batch in plan.sub_batches if batch]
        self.trace.add(IterationRecord(
            iteration=self.metrics.iterations, num_sub_batches=len(batches),
            prefill_tokens=sum(b.num_prefill_tokens for b in batches),
            gpu_decodes=sum(len(b.gpu_decodes) for b in batches),
            host_decodes=sum(len(b.host_decodes) for b in batches),
            predicted_seconds=plan.predicted_time, predicted_host_seconds=plan.predicted_host_time,
            profiled_host_seconds=plan.profiled_host_time,
            measured_seconds=elapsed, launch_seconds=launch_seconds, queue_seconds=self.runner.queue_seconds,
            host_busy_seconds=host_busy,
            gpu_busy_seconds=self.runner.gpu_busy_seconds(), schedule_seconds=schedule_seconds,
            graph_replayed=self.runner.replayed_graph,
            device_segments_freed=(None if segments_freed is None else segments_freed - segments_freed_before)))

    def _record_host_batch(self, result: HostBatchResult) -> None:
        plan = self._host_batch_plan
        self.trace.add(IterationRecord(
            iteration=self.metrics.iterations, num_sub_batches=1, prefill_tokens=0, gpu_decodes=0,
            host_decodes=len(result.requests), predicted_seconds=plan.host_batch_predicted_time,
            predicted_host_seconds=plan.host_batch_predicted_host_time,
            profiled_host_seconds=plan.host_batch_profiled_host_time, measured_seconds=result.seconds,
            launch_seconds=0.0, queue_seconds=0.0,
            host_busy_seconds=result.host_seconds, gpu_busy_seconds=None, schedule_seconds=0.0,
            graph_replayed=result.replayed_graph, host_batch=True,
            host_batch_wait_seconds=self._host_batch_wait_seconds))

    def _count(self, plan: SchedulerOutput) -> None:
        metrics = self.metrics
        metrics.iterations += 1
        metrics.two_batch_iterations += len([b for b in plan.sub_batches if b]) > 1
        metrics.graph_iterations += self.runner.replayed_graph
        for batch in plan.sub_batches:
            metrics.prefill_tokens += batch.num_prefill_tokens
            metrics.gpu_decode_tokens += len(batch.gpu_decodes)
            metrics.host_decode_tokens += len(batch.host_decodes)
        metrics.blocks_swapped_out += len(plan.swap_out)
        metrics.blocks_swapped_in += len(plan.swap_in)

    def _postprocess(self, plan: SchedulerOutput, tokens: list[int]) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for request in plan.finished:
            logger.warning("request %s was ended at %d tokens: the KV pools had no room left for it",
                           request.request_id, request.num_tokens)
            request.finish_time = now
            self._requests.pop(request.request_id, None)
            self.metrics.requests_finished += 1
            outputs.append(self._output(request))
        outputs += self._append_tokens(zip(plan.requests, tokens))
        self.scheduler.remove_finished()
        self.metrics.preemptions = self.scheduler.num_preemptions
        return outputs

    def _append_tokens(self, pairs) -> list[RequestOutput]:
        """Append each (request, sampled token) and finish the requests that are done."""
        now = time.monotonic()
        outputs = []
        for request, token in pairs:
            request.num_cached_tokens = request.num_tokens
            request.append_token(token)
            if request.first_token_time is None:
                request.first_token_time = now
            self.metrics.output_tokens += 1
            reason = self._finish_reason(request, token)
            if reason is not None:
                self.scheduler.finish(request, reason)
                request.finish_time = now
                self._requests.pop(request.request_id, None)
                self.metrics.requests_finished += 1
            outputs.append(self._output(request))
        return outputs

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self.tokenizer is not None and self._cut_at_stop_string(request):
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _cut_at_stop_string(self, request: Request) -> bool:
        text = self.tokenizer.decode(request.output_token_ids)
        positions = [text.find(stop) for stop in request.sampling_params.stop]
        found = [position for position in positions if position >= 0]
        if not found:
            return False
        request.output_text = text[:min(found)]
        return True

    def _output(self, request: Request) -> RequestOutput:
        """A snapshot of the request; text and metrics once it has finished."""
        completion = CompletionOutput(0, request.output_token_ids[:], "", request.finish_reason)
        output = RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                               request.status is RequestStatus.FINISHED)
        if output.finished:
            text = request.output_text
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(request.output_token_ids)
            completion.text = text or ""
            output.metrics = RequestMetrics(request.arrival_time, request.first_token_time,
                                            request.finish_time, request.num_preemptions)
        return output

    def close(self) -> None:
        if self.runner.host_batch_in_flight:  # its host functions use the pools freed below
            try:
                self.runner.collect_host_batch(wait_seconds=float("inf"))
            except RuntimeError as error:
                logger.warning("the host batch in flight at close failed: %s", error)
        if self.trace is not None:
            self.trace.save(self.config.trace_path)
        if self.worker is not None:
            self.worker.shutdown()
        self.kv_cache.close()

