"""``LLMEngine``: add requests, then ``step`` = schedule -> execute -> update."""

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import torch

from neo.config import EngineConfig
from neo.outputs import CompletionOutput, RequestMetrics, RequestOutput
from neo.request import Request, RequestStatus
from neo.sampling_params import SamplingParams
from neo.sched.placement.host_batches import InFlightHostBatch
from neo.runner.model_runner import LaunchedIteration
from neo.sched.runner_output import HostBatchOutput, IterationOutput
from neo.sched.scheduler_output import SchedulerOutput

from .build import build
from .hardware_queues import request_hardware_queues
from .metrics import EngineMetrics, IterationRecord, IterationTrace
from .parallel_sampling import ParentRequest, child_params, child_request_id
from .rank_workers import RankWorkers
from .startup_phases import StartupPhases
from .torch_profiler import TorchProfiler

logger = logging.getLogger(__name__)

# With no GPU work to run, a step waits this long at most for the host batch in flight, so that
# a caller adding requests meanwhile (the server) gets them scheduled soon.
HOST_BATCH_WAIT_SECONDS = 0.02
# Under async scheduling with a host batch in flight, a step waiting for the tokens of the
# iteration in flight checks this often whether the host batch has completed.
HOST_BATCH_POLL_SECONDS = 0.0002


@dataclasses.dataclass
class _IterationInFlight:
    """Async scheduling: a launched iteration whose tokens are read in the next step; ``start``
    and ``schedule_seconds`` as ``LLMEngine._schedule`` gave them for its plan."""

    plan: SchedulerOutput
    launched: LaunchedIteration
    start: float
    schedule_seconds: float
    segments_freed: int | None


class LLMEngine:
    """The serving engine. Not thread-safe: one thread owns it (see ``neo.server``).

    Its parts are built by ``neo.engine.build`` for the policy and the host pipeline. A step is
    ``_step`` (schedule -> execute -> update) or, with async scheduling, ``_step_ahead``
    (schedule -> launch -> update with the previous iteration's tokens). Under the async and
    auto host pipelines both also launch and collect host batches (under auto a plan is either
    a lockstep iteration of two sub-batches or a GPU iteration, possibly launching a host batch,
    as the scheduler chose).

    With ``tensor_parallel_size`` N > 1 this process is rank 0 of N: it starts the other ranks
    (``RankWorkers``), and its runner hands them each plan; a failed rank fails the iteration it
    broke and every later step raises.

    ``startup_seconds`` says where the construction spent its time: ``{phase: seconds, ...,
    "other", "total"}`` (``neo.engine.startup_phases``), ``startup_notes`` what some phases did
    (how many graphs, GEMM shapes); both are also logged as one line.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.device is None or torch.device(config.device).type == "cuda":
            request_hardware_queues()  # before this process's CUDA context exists
        self.device = config.compute_device
        startup = StartupPhases(self.device)
        self.rank_workers = None
        if config.tensor_parallel_size > 1:
            with startup.phase("rank workers"):
                self.rank_workers = RankWorkers(config)
        try:
            parts = (build(config, startup=startup) if self.rank_workers is None
                     else build(config, self.rank_workers.parallel, self.rank_workers.channel, startup))
        except BaseException as error:
            if self.rank_workers is not None:
                rank_error = self.rank_workers.failure(error)
                self.rank_workers.shutdown()
                if self.rank_workers.failed_rank is not None:
                    raise rank_error from error
            raise
        self.model = parts.model
        self.model_config = parts.model.config
        self.tokenizer = parts.tokenizer
        self.dtype = parts.dtype
        self.max_model_len = parts.max_model_len
        self.layout = parts.layout
        self.kv_cache = parts.kv_cache
        self.block_manager = parts.block_manager
        self.worker = parts.worker
        self.runner = parts.runner
        self.profiler = parts.profiler
        self.scheduler = parts.scheduler
        self.stop_rule = parts.scheduler.finish_reason  # a ``neo.engine.stop.StopRule``
        self._host_batches = parts.asynchronous  # host batches run beside the GPU's iterations
        self.async_scheduling = config.schedules_ahead
        self._step_function = self._step_ahead if self.async_scheduling else self._step
        self._in_flight: _IterationInFlight | None = None  # async scheduling: tokens not read yet
        self._last_read = 0.0  # when the tokens of the last iteration were read (perf_counter)
        self.metrics = EngineMetrics()
        self.trace = IterationTrace() if config.trace_path else None
        self.torch_profiler = (TorchProfiler(config.torch_profiler_dir, 0, self.device.type)
                               if config.torch_profiler_dir else None)
        self._requests: dict[str, Request] = {}
        # Parallel sampling: the parents by id, and each child's parent and index.
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, tuple[ParentRequest, int]] = {}
        self._request_counter = itertools.count()
        self._closed = False
        self.startup_seconds = startup.finish()
        self.startup_notes = dict(startup.notes)  # e.g. how many graphs a phase captured
        logger.info(startup.summary())

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request | ParentRequest:
        """Validate and queue a request. Raises ``ValueError`` naming the problem; the engine
        and the requests already queued are unaffected by a rejected one.

        With ``sampling_params.n > 1`` the request is fanned out into ``n`` child requests
        (``neo.engine.parallel_sampling``) and their ``ParentRequest`` is returned; ``step``
        and ``abort_request`` then speak of the parent's id only."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        # A private copy, checked again: the caller may have changed its object after creating it.
        params = dataclasses.replace(sampling_params) if sampling_params is not None else SamplingParams()
        request_id = str(next(self._request_counter)) if request_id is None else str(request_id)
        child_ids = [child_request_id(index, request_id) for index in range(params.n)] if params.n > 1 else []
        used = next((identifier for identifier in [request_id] + child_ids
                     if identifier in self._requests or identifier in self._parents), None)
        if used is not None:
            raise ValueError(f"request id {used!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids, params)
        if params.n == 1:
            return self._queue(Request(request_id, token_ids, params, prompt=text, arrival_time=arrival_time))
        children = [Request(child_id, token_ids, child_params(params, index), prompt=text, arrival_time=arrival_time)
                    for index, child_id in enumerate(child_ids)]
        parent = ParentRequest(request_id, children)
        self._parents[request_id] = parent
        for index, child in enumerate(children):
            self._parent_of[child.request_id] = (parent, index)
            self._queue(child)
        return parent

    def _queue(self, request: Request) -> Request:
        request.min_tokens_stop_ids = self.stop_rule.stop_ids_before_min_tokens(request)
        self._requests[request.request_id] = request
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
        if params.min_tokens > 0:
            eos = frozenset() if params.ignore_eos else self.stop_rule.eos_token_ids
            if len({token for token in eos | set(params.stop_token_ids) if token < vocab}) >= vocab:
                raise ValueError(f"min_tokens={params.min_tokens} with stop_token_ids covering the whole "
                                 f"vocabulary of {vocab} tokens leaves no token to sample")
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
        pools = self.scheduler.placement.decode_pools
        return max(self.block_manager.num_total(pool) for pool in pools) * self.config.block_size

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a request (a parallel-sampling parent: all its children, also when given a
        child's id); its blocks are free when this returns. False if it is unknown/done."""
        request_id = str(request_id)
        link = self._parent_of.get(request_id)
        parent = self._parents.get(request_id) or (link[0] if link is not None else None)
        if parent is None:
            return self._abort(request_id, reason)
        self._forget(parent)
        return any([self._abort(child.request_id, reason) for child in parent.children])

    def _abort(self, request_id: str, reason: str) -> bool:
        request = self._requests.pop(request_id, None)
        if request is None or request.is_finished:
            return False
        self.scheduler.abort(request, reason)
        request.finish_time = time.monotonic()
        self.metrics.requests_aborted += 1
        return True

    def _forget(self, parent: ParentRequest) -> None:
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._parent_of.pop(child.request_id, None)

    def abort_all(self) -> int:
        """Abort every unfinished request; returns how many there were (a parallel-sampling
        parent counts once)."""
        request_ids = [request_id for request_id in self._requests if request_id not in self._parent_of]
        request_ids += list(self._parents)
        for request_id in request_ids:
            self.abort_request(request_id)
        return len(request_ids)

    @property
    def iteration_in_flight(self) -> bool:
        """Whether an iteration's tokens are still to be read (async scheduling): the next step
        returns them."""
        return self._in_flight is not None

    def has_unfinished_requests(self) -> bool:
        """Requests still to finish, or a host batch still to complete (its blocks with it)."""
        return self.scheduler.has_unfinished

    # -- the loop ------------------------------------------------------------------------------

    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One iteration: schedule -> execute -> update. Returns the requests that got a token
        (finished ones marked so), and those whose work failed.

        ``on_launched`` is called once per step: when the iteration's device work is queued,
        before the engine waits for it (at once when the plan is empty). A caller that hands
        out outputs on another thread (``neo.server``) passes the previous iteration's there,
        so that handing them out overlaps the device's work instead of delaying the launch.

        Under the async and auto host pipelines the step first launches the plan's host batch, if any,
        and ends by collecting the host batch in flight if it has completed (waiting for it a
        little when the plan had no GPU work); its requests' tokens are among the outputs.

        A failure in running work (the iteration, a swap copy, launching or running a host
        batch) ends the requests that work touched, whose KV may be half written: each comes
        back finished with finish reason "error" and ``RequestOutput.error`` saying why, and
        every other request carries on. Only what belongs to no request (a failure in
        scheduling, or an interrupt such as ``KeyboardInterrupt``, after the requests the
        interrupted work touched were ended) is raised.

        A parallel-sampling parent (``SamplingParams.n > 1``) comes back as one output holding
        all its completions, in place of its children's (``neo.engine.parallel_sampling``).
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self.rank_workers is not None:
            self.rank_workers.raise_if_failed()
        outputs = self._step_function(on_launched)
        return self._gather_children(outputs) if self._parent_of else outputs

    def _step(self, on_launched: Callable[[], None] | None) -> list[RequestOutput]:
        plan, start, schedule_seconds, segments_freed = self._schedule()
        return self._run(plan, on_launched, start, schedule_seconds, segments_freed, [], [])

    def _run(self, plan: SchedulerOutput, on_launched, start: float, schedule_seconds: float,
             segments_freed: int | None, decoded: list[Request], failed: list[Request]) -> list[RequestOutput]:
        """Execute the plan and read its tokens. Under the async and auto host pipelines, first
        queue the next layer parts of the host batch in flight that are due and launch the plan's
        host batch, if any; after the plan, collect the host batch in flight if it has completed
        (waiting for it a little when the plan had no GPU work). ``decoded`` and ``failed``:
        what the step already settled, returned first."""
        self._launch_host_batch(plan, failed)
        launch_seconds = time.perf_counter() - start if self._host_batches else 0.0
        output = self._execute(plan, on_launched, start, schedule_seconds, launch_seconds, segments_freed, failed)
        host_batch = self._collect_host_batch(plan, HOST_BATCH_WAIT_SECONDS if output is None else 0.0, failed)
        decoded += self.scheduler.update(plan, output, host_batch)
        if plan.host_batch is not None or output is not None:
            self.metrics.busy_seconds += time.perf_counter() - start
        return self._outputs(plan, decoded, failed)

    def _launch_host_batch(self, plan: SchedulerOutput, failed: list[Request]) -> None:
        """Queue the due layer parts of the host batch in flight, then the plan's host batch, if
        any (when its launch fails its requests are ended and added to ``failed``)."""
        self.runner.advance_host_batch()
        if plan.host_batch is None:
            return
        try:
            self.runner.launch_host_batch(plan.host_batch)
        except BaseException as error:
            error = self._as_rank_failure(error)
            failed += self._fail(self.scheduler.fail_host_batch(), error, "its host batch failed to launch")
            if not isinstance(error, Exception):
                self._fail(plan.affected_requests, error, "the engine was interrupted")
                raise

    def _collect_host_batch(self, plan: SchedulerOutput, wait_seconds: float,
                            failed: list[Request]) -> HostBatchOutput | None:
        """The host batch in flight if it completed within ``wait_seconds`` (None: none did; when
        it failed its requests are ended and added to ``failed``)."""
        if not self.runner.host_batch_in_flight:
            return None
        flight = self.scheduler.placement.in_flight
        try:
            host_batch = self.runner.collect_host_batch(wait_seconds)
        except BaseException as error:
            # Every rank stops now: a failure while the driver queued the batch's parts can leave
            # the ranks' collectives out of step, and a failed host attention fails the other
            # ranks at their next batch anyway.
            error = self._as_rank_failure(error)
            failed += self._fail(self.scheduler.fail_host_batch(), error, "its host batch failed")
            if not isinstance(error, Exception):  # the plan's tokens would not be appended
                self._fail(plan.affected_requests, error, "the engine was interrupted")
                raise
            return None
        if host_batch is not None:
            self._count_host_batch(host_batch, flight)
        return host_batch

    def _step_ahead(self, on_launched: Callable[[], None] | None) -> list[RequestOutput]:
        """Async scheduling: plan and launch iteration k+1 before reading iteration k's tokens.

        While the device runs iteration k the engine plans k+1 (each request of k counts one
        unresolved token: ``Scheduler.advance``) and queues it, its requests' input ids taken on
        the device from k's samples; only then does it wait for k's tokens (copied to the host
        behind k's sampling), apply the stop conditions to them (``Scheduler.update``) and return
        them. So the host's bookkeeping, planning and input building of one iteration overlap
        the device's previous one, and each step returns the tokens of the iteration before. A
        request that stopped at k has its token of k+1 dropped and its blocks freed; when k's
        tokens end every request, the step reads k+1 too (``_read_last_iteration``).

        Under the async and auto host pipelines a host batch is independent of the GPU's
        iterations: the plan's host batch, if any, is launched before k+1 and the one in flight
        collected after k's tokens are read, as ``_run`` does; one that completes while the step
        waits for those tokens is collected then, and the next one launched at once
        (``_relaunch_host_batch_while_waiting``).

        It falls back to ``_step``'s order (the tokens of k read before k+1 is planned) where
        planning needs them: when a request might be evicted for room
        (``Scheduler.can_plan_ahead``). A plan that uses the tokens on the host when it launches
        (penalties, log-probabilities), decodes on the host in the iteration itself or
        prefills a prompt into the host pool, copies blocks between the pools, or has no sub-batch
        (``SchedulerOutput.runs_ahead``) runs after k's tokens are read, as ``_step`` runs it.
        """
        failed: list[Request] = []
        decoded: list[Request] = []
        if self._in_flight is not None and not self.scheduler.can_plan_ahead():
            decoded += self._settle(failed)
        plan, start, schedule_seconds, segments_freed = self._schedule()
        if not plan.runs_ahead():
            if self._in_flight is not None:
                decoded += self._settle(failed)
                plan.drop_finished()
            return self._run(plan, on_launched, start, schedule_seconds, segments_freed, decoded, failed)
        self._launch_host_batch(plan, failed)
        launched, launch_error = self._launch(plan, on_launched)
        if self._in_flight is not None:
            if launched is not None:
                decoded += self._relaunch_host_batch_while_waiting(plan, failed)
            decoded += self._settle(failed)
        if launch_error is not None:  # after the read, so its requests keep the tokens computed before
            failed += self._fail(plan.affected_requests, launch_error, "its iteration failed")
            if not isinstance(launch_error, Exception):
                raise launch_error
        host_batch = self._collect_host_batch(plan, 0.0, failed)
        if host_batch is not None:
            decoded += self.scheduler.update(plan, None, host_batch)
        outputs = self._outputs(plan, decoded, failed)  # snapshots before the plan's tokens are counted
        if launched is not None:
            self.scheduler.advance(plan)
            self._in_flight = _IterationInFlight(plan, launched, start, schedule_seconds, segments_freed)
        if self._in_flight is not None and not self.scheduler.has_unfinished:
            outputs += self._read_last_iteration()
        self.metrics.busy_seconds += time.perf_counter() - start
        return outputs

    def _relaunch_host_batch_while_waiting(self, beside: SchedulerOutput, failed: list[Request]) -> list[Request]:
        """Wait for the tokens of the iteration in flight, and if the host batch in flight
        completes first, collect it and launch the next one now (``Scheduler.schedule_host_batch``,
        beside ``beside``, the plan just launched) rather than in the next step, which plans only
        once those tokens are read: the host would sit idle for up to an iteration in between.
        Returns the requests that got a token from the completed batch (on one rank; ranks that
        follow queue a batch's parts as the driver's steps tell them)."""
        if self.rank_workers is not None or not self.runner.host_batch_in_flight:
            return []
        launched = self._in_flight.launched
        try:
            while not launched.ready():
                if self.runner.host_batch_ready():
                    break
                time.sleep(HOST_BATCH_POLL_SECONDS)
            else:
                return []
        except Exception:  # reading the iteration and the batch raises it again, ending what they touched
            return []
        except BaseException as error:  # an interrupt while waiting: as ``_settle`` handles one
            flight, self._in_flight = self._in_flight, None
            self._fail(flight.plan.affected_requests, error, "its iteration failed")
            raise
        host_batch = self._collect_host_batch(beside, 0.0, failed)
        decoded = [] if host_batch is None else self.scheduler.update(beside, None, host_batch)
        relaunch = self.scheduler.schedule_host_batch(beside, (self._in_flight.plan,))
        if relaunch is not None:
            self._launch_host_batch(relaunch, failed)
            self.metrics.host_batches_between_steps += 1
        return decoded

    def _read_last_iteration(self) -> list[RequestOutput]:
        """Read the iteration in flight when every request it holds has ended (with the tokens
        this step read, the ones it computed are dropped): nothing would step the engine again
        until new requests come, and its measured time, which runs until its read, would count
        the engine's idle stretch in between (the scheduler's calibrations and the trace divide
        by it). Returns the outputs of requests whose reading failed (none ended otherwise)."""
        failed: list[Request] = []
        self._settle(failed)
        return [self._output(request) for request in failed]

    def _launch(self, plan: SchedulerOutput,
                on_launched) -> tuple[LaunchedIteration | None, BaseException | None]:
        """Queue the plan's work, its unresolved tokens taken from the iteration in flight; returns
        it, or what its launch raised (the caller ends its requests once the iteration in flight
        is read)."""
        previous = None if self._in_flight is None else self._in_flight.launched.previous_tokens()
        try:
            return self.runner.launch(plan, on_launched, previous, read_later=True), None
        except BaseException as error:
            return None, self._as_rank_failure(error)

    def _settle(self, failed: list[Request]) -> list[Request]:
        """Read the tokens of the iteration in flight and update the scheduler with them;
        returns the requests that got one (a request that ended meanwhile gets none). When
        reading fails, its requests are ended and added to ``failed``."""
        flight, self._in_flight = self._in_flight, None
        try:
            output = self.runner.collect(flight.launched)
        except BaseException as error:
            error = self._as_rank_failure(error)
            failed += self._fail(flight.plan.affected_requests, error, "its iteration failed")
            if not isinstance(error, Exception):
                raise
            return []
        output.seconds = self._step_seconds(flight.start)
        self._count(flight.plan, output)
        if self.trace is not None:
            self._record(flight.plan, output, flight.schedule_seconds, 0.0, flight.segments_freed)
        return self.scheduler.update(flight.plan, output)

    def _schedule(self) -> tuple[SchedulerOutput, float, float, int | None]:
        """The plan, when scheduling ended (the step's time counts from there), the scheduler's
        seconds, and the device segments freed so far (traced CUDA engines)."""
        segments_freed = self._device_segments_freed()
        began = time.perf_counter()
        plan = self.scheduler.schedule()
        start = time.perf_counter()
        self.metrics.schedule_seconds += start - began
        return plan, start, start - began, segments_freed

    def _execute(self, plan: SchedulerOutput, on_launched, start: float, schedule_seconds: float,
                 launch_seconds: float, segments_freed: int | None, failed: list[Request]) -> IterationOutput | None:
        """Run the plan's compute-stream work (None when it has none, or when it failed: its
        requests are then ended and added to ``failed``); ``start``: when the step began after
        scheduling, from which its measured time counts."""
        if plan.is_empty:
            if on_launched is not None:
                on_launched()
            return None
        try:
            output = self.runner.execute(plan, on_launched)
        except BaseException as error:
            error = self._as_rank_failure(error)
            failed += self._fail(plan.affected_requests, error, "its iteration failed")
            if not isinstance(error, Exception):
                raise
            return None
        output.seconds = self._step_seconds(start)  # the step's launch of a host batch included
        self._count(plan, output)
        if self.trace is not None:
            self._record(plan, output, schedule_seconds, launch_seconds, segments_freed)
        return output

    def _step_seconds(self, start: float) -> float:
        """An iteration's seconds on the engine's timeline, its tokens read now: from ``start``
        (its step's, after planning) or, when later, from the read of the tokens of the
        iteration before. Under async scheduling an iteration is launched while the one before
        it still runs, so the time from its launch would count the end of that one twice;
        this way the iterations' seconds add up to the time that passed (the interference and
        arrival-rate estimates and the trace's prediction errors divide by them)."""
        now = time.perf_counter()
        seconds = now - max(start, self._last_read)
        self._last_read = now
        return seconds

    def _as_rank_failure(self, error: BaseException) -> BaseException:
        """Under tensor parallelism, an ``Exception`` from the driver's work is the ranks' failure
        (``RankWorkers.failure``: it names a worker that failed and stops the others, and every
        later step raises it); otherwise ``error`` itself."""
        if self.rank_workers is not None and isinstance(error, Exception):
            return self.rank_workers.failure(error)
        return error

    def _fail(self, requests: list[Request], error: BaseException, what: str) -> list[Request]:
        """Work on ``requests`` raised ``error``: wait until no queued work touches their
        blocks, then end them with finish reason "error" (their KV may be half written) and
        give their blocks back. Returns those ended here (not the ones already finished)."""
        self._quiesce()
        reason = f"{what}: {type(error).__name__}: {error}"
        ended = [request for request in requests if not request.is_finished]
        if ended:  # an interrupt (Ctrl-C) was asked for: no error, and its traceback is no news
            interrupted = not isinstance(error, Exception)
            logger.log(logging.INFO if interrupted else logging.ERROR, "%d requests ended (%s): %s", len(ended),
                       reason, ", ".join(request.request_id for request in ended),
                       exc_info=None if interrupted else error)
        for request in ended:
            request.error = reason
            self._abort(request.request_id, "error")
        return ended

    def _quiesce(self) -> None:
        """Wait for the device's queued work and the host worker's tasks, so that nothing still
        reads or writes the blocks of requests about to be ended."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as error:  # the device itself failed: its queued work is gone
                logger.error("waiting for the device after a failure failed: %s", error)
        if self.worker is not None:
            self.worker.drain()

    # -- outputs and metrics -------------------------------------------------------------------

    def _gather_children(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Replace the outputs of parallel-sampling children by one output per parent, where
        its first child's was. A failed child ends its siblings (aborted) and its parent."""
        gathered: list[RequestOutput | ParentRequest] = []
        touched: set[str] = set()
        for output in outputs:
            link = self._parent_of.get(output.request_id)
            if link is None:
                gathered.append(output)
                continue
            parent, index = link
            parent.update(index, output)
            if output.error is not None:
                for sibling_index, sibling in enumerate(parent.children):
                    if self._abort(sibling.request_id, "abort"):
                        parent.update(sibling_index, self._output(sibling))
            if parent.request_id not in touched:
                touched.add(parent.request_id)
                gathered.append(parent)
        results = []
        for item in gathered:
            if isinstance(item, ParentRequest):
                if item.finished:
                    self._forget(item)
                item = item.output()
            results.append(item)
        return results

    def _outputs(self, plan: SchedulerOutput, decoded: list[Request], failed: list[Request]) -> list[RequestOutput]:
        """The requests whose work failed, the plan's requests ended while planning, then those
        that got a token; one output per request. (Under async scheduling a request can get the
        token of the previous iteration and then end in the same step, its work failed or no
        room left for it: its one output is then the ended one, that token included. It can
        also get two tokens in one step, when the plan runs after the late read: one output
        holds both.)"""
        now = time.monotonic()
        outputs = [self._output(request) for request in failed]
        ended = {id(request) for request in failed}
        for request in plan.finished:
            logger.warning("request %s was ended at %d tokens: the KV pools had no room left for it",
                           request.request_id, request.num_tokens)
            outputs.append(self._finished(request, now))
            ended.add(id(request))
        for request in decoded:  # twice when a late read and the plan run after it both gave it a token
            if request.first_token_time is None:
                request.first_token_time = now
            self.metrics.output_tokens += 1
            if id(request) not in ended:
                ended.add(id(request))
                outputs.append(self._finished(request, now) if request.is_finished else self._output(request))
        self.metrics.preemptions = self.scheduler.num_preemptions
        return outputs

    def _finished(self, request: Request, now: float) -> RequestOutput:
        request.finish_time = now
        self._requests.pop(request.request_id, None)
        self.metrics.requests_finished += 1
        return self._output(request)

    def _output(self, request: Request) -> RequestOutput:
        """A snapshot of the request; text, the log-probabilities' token texts and metrics once
        it has finished."""
        completion = CompletionOutput(0, request.output_token_ids[:], "", request.finish_reason)
        if request.sampling_params.logprobs is not None:
            completion.logprobs = request.output_logprobs[:]
            completion.cumulative_logprob = request.cumulative_logprob
        output = RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [completion],
                               request.status is RequestStatus.FINISHED, error=request.error)
        if output.finished:
            text = request.output_text
            if text is None and self.tokenizer is not None:
                text = self.tokenizer.decode(request.output_token_ids)
            completion.text = text or ""
            if completion.logprobs and self.tokenizer is not None:
                self._decode_logprob_tokens(completion.logprobs)
            output.metrics = RequestMetrics(request.arrival_time, request.first_token_time,
                                            request.finish_time, request.num_preemptions)
        return output

    def _decode_logprob_tokens(self, entries: list[dict]) -> None:
        """Set each ``Logprob.decoded_token``: the token's text alone, special tokens spelled out."""
        token_ids = list({token_id for entry in entries for token_id in entry})
        texts = dict(zip(token_ids, self.tokenizer.backend.decode_batch([[token_id] for token_id in token_ids],
                                                                        skip_special_tokens=False)))
        for entry in entries:
            for token_id, logprob in entry.items():
                logprob.decoded_token = texts[token_id]

    def _count(self, plan: SchedulerOutput, output: IterationOutput) -> None:
        metrics = self.metrics
        metrics.iterations += 1
        metrics.two_batch_iterations += len([b for b in plan.sub_batches if b]) > 1
        metrics.graph_iterations += output.replayed_graph
        metrics.graph_swap_iterations += output.replayed_graph and plan.has_swaps
        for batch in plan.sub_batches:
            metrics.prefill_tokens += batch.num_prefill_tokens
            metrics.gpu_decode_tokens += len(batch.gpu_decodes)
            metrics.host_decode_tokens += len(batch.host_decodes)
        metrics.blocks_swapped_out += len(plan.swap_out)
        metrics.blocks_swapped_in += len(plan.swap_in)

    def _count_host_batch(self, result: HostBatchOutput, flight: InFlightHostBatch) -> None:
        self.metrics.host_batches += 1
        self.metrics.graph_host_batches += result.replayed_graph
        self.metrics.host_decode_tokens += len(result.requests)
        if self.trace is not None:
            self.trace.add(IterationRecord(
                iteration=self.metrics.iterations, num_sub_batches=1, prefill_tokens=0, gpu_decodes=0,
                host_decodes=len(result.requests), predicted_seconds=flight.predicted_time,
                predicted_host_seconds=flight.predicted_host_time, profiled_host_seconds=flight.profiled_host_time,
                measured_seconds=result.seconds, launch_seconds=0.0, queue_seconds=0.0,
                host_busy_seconds=result.host_seconds, gpu_busy_seconds=None, schedule_seconds=0.0,
                graph_replayed=result.replayed_graph, host_batch=True, host_batch_wait_seconds=result.wait_seconds,
                host_batch_beside_prefill=flight.beside_prefill,
                host_context_tokens=sum(request.num_tokens for request in result.requests)))

    def _device_segments_freed(self) -> int | None:
        """Segments the device's caching allocator has returned so far (traced CUDA engines only)."""
        if self.trace is None or self.device.type != "cuda":
            return None
        return torch.cuda.memory_stats(self.device).get("segment.all.freed", 0)

    def _record(self, plan: SchedulerOutput, output: IterationOutput, schedule_seconds: float,
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
            measured_seconds=output.seconds, launch_seconds=launch_seconds, queue_seconds=output.queue_seconds,
            host_busy_seconds=output.host_seconds, gpu_busy_seconds=output.gpu_busy_seconds,
            schedule_seconds=schedule_seconds, graph_replayed=output.replayed_graph,
            blocks_swapped=len(plan.swap_out) + len(plan.swap_in),
            device_segments_freed=(None if segments_freed is None else segments_freed - segments_freed_before),
            host_context_tokens=sum(request.num_tokens for batch in batches for request in batch.host_decodes),
            beside_host_batch=plan.beside_host_batch))

    def start_profile(self) -> None:
        """Start recording a ``torch.profiler`` timeline on every rank
        (``neo.engine.torch_profiler``); ``stop_profile`` ends it."""
        torch_profiler = self._torch_profiler_or_raise()
        torch_profiler.start()
        if self.runner.plan_channel is not None:
            self.runner.plan_channel.send_torch_profiler("start")

    def stop_profile(self) -> list[str]:
        """Stop recording and write each rank's timeline; returns the files, rank 0's first
        (the other ranks write theirs as they get the stop, before their next plan)."""
        torch_profiler = self._torch_profiler_or_raise()
        if not torch_profiler.running:
            raise RuntimeError("the torch profiler is not recording: start_profile() first")
        if self.runner.plan_channel is not None:
            self.runner.plan_channel.send_torch_profiler("stop")
        return [torch_profiler.stop()] + [torch_profiler.trace_path(torch_profiler.stretches, rank)
                                    for rank in range(1, self.config.tensor_parallel_size)]

    def _torch_profiler_or_raise(self) -> TorchProfiler:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self.torch_profiler is None:
            raise ValueError("profiling needs torch_profiler_dir (--torch-profiler-dir): where to write the "
                             "timelines")
        return self.torch_profiler

    def close(self) -> None:
        """Release the pools and the host worker; later calls of ``add_request`` and ``step``
        raise. Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight is not None:  # its device work writes the pools freed below
            try:
                self.runner.collect(self._in_flight.launched)
            except RuntimeError as error:
                logger.warning("the iteration in flight at close failed: %s", error)
            self._in_flight = None
        if self.runner.host_batch_in_flight:  # its host functions use the pools freed below
            try:
                self.runner.collect_host_batch(wait_seconds=float("inf"))
            except RuntimeError as error:
                logger.warning("the host batch in flight at close failed: %s", error)
        if self.trace is not None:
            self.trace.save(self.config.trace_path)
        if self.torch_profiler is not None and self.torch_profiler.running:  # the other ranks stop on exit
            self.torch_profiler.stop()
        try:
            self.runner.release_graphs()
        except RuntimeError as error:  # a device in an error state refuses the release too
            logger.warning("releasing the CUDA graphs at close failed: %s", error)
        if self.worker is not None:
            self.worker.shutdown()
        self.kv_cache.close()
        if self.rank_workers is not None:
            self.rank_workers.shutdown()
