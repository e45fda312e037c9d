"""``AsyncEngine``: the ``LLMEngine`` on a thread of its own, driven from asyncio.

::

    event loop (HTTP handlers)                    engine thread (owns the LLMEngine)
    generate() / abort() --commands--> [lock] --> applied between iterations:
                                                    add_request / abort_request
                                                    step() -> outputs
    per-request asyncio.Queue <-- loop.call_soon_threadsafe(deliver, [(queue, item), ...])

The event loop never waits for the engine: it only appends a command under a lock that the
engine thread holds for a few instructions. The engine thread sleeps on a condition while
there is nothing to do. Each pass of its loop applies the pending commands, runs one
iteration, hands every output to its request's queue in one batch, feeds the latency
histograms (``latency.py``) and publishes an ``EngineStats`` snapshot for ``/metrics``.

A request with ``SamplingParams.n`` > 1 is a ``ParentRequest`` in the engine: its outputs, its
abort (the client gone, a shutdown) and its final output speak of the parent's id and cover all
its children; the latency histograms follow each child as a request of its own.

When another iteration follows at once, an iteration's outputs are handed out only once that
next iteration's device work is queued (``LLMEngine.step``'s ``on_launched``): the event
loop's work on them (detokenizing, SSE events, sockets) then runs while the engine thread
waits for the device, instead of competing with it for the GIL while it launches the next
iteration. A token reaches its client one launch later; the time between tokens stays the
engine's own.
"""

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from neo.engine import LLMEngine
from neo.engine.parallel_sampling import ParentRequest
from neo.outputs import CompletionOutput, RequestMetrics, RequestOutput
from neo.request import KVLocation, Request
from neo.sampling_params import SamplingParams

from .latency import HistogramSnapshot, RequestLatencies

logger = logging.getLogger(__name__)


def still_running(output: RequestOutput) -> RequestOutput:
    """``output`` as an unfinished one: its tokens, no finish reason, no error."""
    completions = [dataclasses.replace(completion, finish_reason=None) for completion in output.outputs]
    return dataclasses.replace(output, outputs=completions, finished=False, error=None)


class RequestFailed(RuntimeError):
    """The engine ended this request because something went wrong while running it."""


class EngineStopped(RuntimeError):
    """The engine is shutting down (or has stopped) and takes no new requests."""


@dataclass(frozen=True)
class EngineStats:
    """One consistent snapshot of the engine, taken by the engine thread after a pass.

    counters: ``EngineMetrics.as_dict()``. token_window: ``(start time, output tokens at
    start, latest time, output tokens at latest)`` over the last ``window_seconds``
    (``time.monotonic`` seconds). histograms: the request latency histograms
    (``RequestLatencies.snapshot``).
    """

    running: int
    waiting: int
    swapped: int
    running_in_gpu_pool: int
    running_in_host_pool: int
    gpu_blocks_used: int
    gpu_blocks_total: int
    host_blocks_used: int
    host_blocks_total: int
    counters: dict
    token_window: tuple[float, int, float, int]
    window_seconds: float
    histograms: dict[str, HistogramSnapshot]

    def tokens_per_second(self, now: float) -> float:
        """Output tokens per second over the window ending ``now``; 0 once it saw none."""
        start_time, start_tokens, latest_time, latest_tokens = self.token_window
        start_time = max(start_time, now - self.window_seconds)
        if now - latest_time > self.window_seconds or now <= start_time:
            return 0.0
        return (latest_tokens - start_tokens) / (now - start_time)


@dataclass
class _Tracked:
    queue: asyncio.Queue  # the request's outputs, read on the event loop
    request: Request | ParentRequest  # a parent when n > 1

    @property
    def engine_requests(self) -> list[Request]:
        """The engine's requests behind it: the parent's children, or the request itself."""
        request = self.request
        return request.children if isinstance(request, ParentRequest) else [request]


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    queue: asyncio.Queue


@dataclass
class _Abort:
    request_id: str
    notify: bool  # deliver a final "abort" output (False: nobody listens any more)


@dataclass
class _AbortAll:
    pass


@dataclass
class _Profile:
    start: bool  # start recording (False: stop)
    queue: asyncio.Queue  # gets the trace files (stop), [] (start) or the error


class AsyncEngine:
    """Runs ``engine`` on a background thread; ``start`` it from the event loop that will call
    ``generate``.

    stats_window_seconds: the window of ``EngineStats.tokens_per_second``.
    stalled_wait_seconds: how long the engine thread waits before trying again when requests
        are queued but the last pass could schedule none of them.
    """

    def __init__(self, engine: LLMEngine, stats_window_seconds: float = 10.0,
                 stalled_wait_seconds: float = 0.005):
        self.engine = engine
        self.stats_window_seconds = stats_window_seconds
        self.stalled_wait_seconds = stalled_wait_seconds
        self._condition = threading.Condition()
        self._commands: list = []  # guarded by _condition
        self._stop_requested = False  # guarded by _condition
        self._accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Engine-thread state.
        self._tracked: dict[str, _Tracked] = {}
        self._held: list[tuple[asyncio.Queue, object]] = []  # outputs waiting for the next launch
        self._stalled = False
        self._token_samples: collections.deque[tuple[float, int]] = collections.deque()
        self._latencies = RequestLatencies()
        self._stats = self._snapshot()
        # The engine thread works on the CUDA device current here (where the engine was built).
        self._cuda_device = torch.cuda.current_device() if engine.device.type == "cuda" else None

    # -- event-loop side -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the running event loop."""
        if self._thread is not None:
            raise RuntimeError("the async engine was already started")
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="neo-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and new requests are taken."""
        return self._accepting and self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its ``RequestOutput`` as tokens arrive; the last one is
        ``finished``. When the outputs come faster than they are consumed, only the newest is
        yielded (each carries all token ids so far).

        Raises ``ValueError`` when the engine rejects the request (the message names the
        problem), ``RequestFailed`` when an iteration running it failed, ``EngineStopped``
        when the engine is shutting down. Leaving the iteration early (``aclose``, task
        cancellation) aborts the request; its KV blocks are free after the next pass.
        """
        if not self.is_running:
            raise EngineStopped("the server is shutting down and takes no new requests")
        queue = asyncio.Queue()
        self._submit(_Add(request_id, prompt, params, time.monotonic(), queue))
        finished = False
        error = None  # an error queued behind the output being yielded
        try:
            while not finished:
                item = error or await queue.get()
                while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
                    following = queue.get_nowait()
                    if isinstance(following, BaseException):
                        error = following
                        break
                    item = following
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._submit(_Abort(request_id, notify=False))

    async def profile(self, start: bool) -> list[str]:
        """Start (``start``) or stop the engine's ``torch.profiler`` timeline between two passes
        of the engine thread (``LLMEngine.start_profile`` / ``stop_profile``); stopping returns
        the trace files. Raises what the engine raised: ``ValueError`` without
        ``torch_profiler_dir``, ``RuntimeError`` when already (or not) recording."""
        if not self.is_running:
            raise EngineStopped("the server is shutting down")
        queue = asyncio.Queue()
        self._submit(_Profile(start, queue))
        result = await queue.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def abort(self, request_id: str) -> None:
        """End a request now; its stream gets a final output with finish reason "abort"."""
        self._submit(_Abort(request_id, notify=True))

    def stop_accepting(self) -> None:
        """Refuse new requests and abort those in flight: each ends with finish reason
        "abort". Call from the event loop (``stop_accepting_threadsafe`` elsewhere)."""
        if self._accepting:
            self._accepting = False
            self._submit(_AbortAll())

    def stop_accepting_threadsafe(self) -> None:
        """``stop_accepting`` from any thread or a signal handler: it only schedules the call
        on the event loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.stop_accepting)

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, stop the engine thread and close the engine."""
        self._accepting = False
        with self._condition:
            self._stop_requested = True
            self._condition.notify()
        if self._thread is None:  # never started: nothing else owns the engine
            self.engine.close()
            return
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.1f s", timeout)

    def _submit(self, command) -> None:
        with self._condition:
            self._commands.append(command)
            self._condition.notify()

    @staticmethod
    def _deliver(deliveries: list[tuple[asyncio.Queue, object]]) -> None:
        for queue, item in deliveries:
            queue.put_nowait(item)

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        try:
            while True:
                commands, stopping = self._wait_for_work()
                deliveries, self._held = self._held, []
                self._apply(commands, deliveries, stopping)
                if stopping:
                    self._abort_all(deliveries, reason_error=None)
                elif self.engine.has_unfinished_requests():
                    self._step(deliveries)
                    if self.engine.has_unfinished_requests() and not self._stalled:
                        # The next pass launches at once: these go out then, with the stats.
                        self._held = deliveries
                        continue
                self._publish(deliveries)
                if stopping:
                    break
        except Exception as error:
            logger.exception("the engine thread failed")
            deliveries, self._held = self._held, []
            failure = RequestFailed(f"the engine thread failed: {error}")
            self._abort_all(deliveries, reason_error=failure)
            self._publish(deliveries)
        finally:
            self._accepting = False
            self.engine.close()

    def _wait_for_work(self) -> tuple[list, bool]:
        with self._condition:
            if not self._commands and not self._stop_requested:
                if not self.engine.has_unfinished_requests():
                    self._condition.wait()
                elif self._stalled:
                    self._condition.wait(self.stalled_wait_seconds)
            commands, self._commands = self._commands, []
            return commands, self._stop_requested

    def _apply(self, commands: list, deliveries: list, stopping: bool) -> None:
        for command in commands:
            if isinstance(command, _Add):
                self._add(command, deliveries, stopping)
            elif isinstance(command, _Abort):
                tracked = self._tracked.pop(command.request_id, None)
                if tracked is not None:
                    self._drop_latencies(tracked)
                    self.engine.abort_request(command.request_id)
                    if command.notify:
                        deliveries.append((tracked.queue, self._final_output(tracked.request)))
            elif isinstance(command, _Profile):
                deliveries.append((command.queue, self._profile(command.start)))
            else:
                self._abort_all(deliveries, reason_error=None)

    def _profile(self, start: bool) -> list[str] | Exception:
        try:
            if start:
                self.engine.start_profile()
                return []
            return self.engine.stop_profile()
        except (ValueError, RuntimeError) as error:
            return error

    def _add(self, command: _Add, deliveries: list, stopping: bool) -> None:
        if stopping:
            deliveries.append((command.queue, EngineStopped("the server is shutting down")))
            return
        try:
            request = self.engine.add_request(command.prompt, command.params, command.request_id,
                                              arrival_time=command.arrival_time)
        except ValueError as error:
            deliveries.append((command.queue, ValueError(str(error))))
        except Exception as error:
            logger.exception("adding request %s failed", command.request_id)
            deliveries.append((command.queue, RequestFailed(f"the engine could not add the "
                                                            f"request: {error}")))
        else:
            tracked = _Tracked(command.queue, request)
            self._tracked[command.request_id] = tracked
            for engine_request in tracked.engine_requests:
                self._latencies.added(engine_request)
            self._stalled = False

    def _step(self, deliveries: list) -> None:
        """Run one iteration. What ``deliveries`` holds goes out once the iteration is launched;
        the iteration's outputs are appended to it."""
        def hand_out() -> None:
            self._publish(deliveries[:])
            deliveries.clear()

        started = time.monotonic()
        try:
            outputs = self.engine.step(on_launched=hand_out)
        except Exception as error:
            logger.exception("an engine iteration failed")
            self._end_failed_requests(error, deliveries)
            return
        self._stalled = not outputs and not self.engine.iteration_in_flight  # in flight: its tokens come next
        self._latencies.iteration_ran(started)
        now = time.monotonic()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.error is not None:  # the engine ended it: its work failed
                self._drop_latencies(tracked)
                if any(completion.token_ids for completion in output.outputs):
                    # Tokens computed before the failure go out first (under async scheduling the
                    # step that ends the request is the one that reads its previous token).
                    deliveries.append((tracked.queue, still_running(output)))
                deliveries.append((tracked.queue, RequestFailed(f"the engine failed running this request: "
                                                                f"{output.error}")))
            else:
                for engine_request in tracked.engine_requests:
                    self._latencies.output(engine_request, engine_request.is_finished, now)
                deliveries.append((tracked.queue, output))
            if output.finished:
                del self._tracked[output.request_id]

    def _end_failed_requests(self, error: Exception, deliveries: list) -> None:
        """A step raised: the failure belongs to no request (the engine ends the requests of
        failed work itself and returns them), so end every request, lest the loop fail the
        same way forever."""
        logger.error("an engine step failed outside any request's work: ending all %d requests",
                     len(self._tracked))
        for request_id, tracked in self._tracked.items():
            self._drop_latencies(tracked)
            self.engine.abort_request(request_id, reason="error")
            deliveries.append((tracked.queue, RequestFailed(f"the engine failed: {error}")))
        self._tracked.clear()

    def _abort_all(self, deliveries: list, reason_error: Exception | None) -> None:
        """End every tracked request: with ``reason_error`` delivered, or else a final
        "abort" output."""
        for request_id, tracked in self._tracked.items():
            self._drop_latencies(tracked)
            self.engine.abort_request(request_id)
            item = reason_error if reason_error is not None else self._final_output(tracked.request)
            deliveries.append((tracked.queue, item))
        self._tracked.clear()

    def _drop_latencies(self, tracked: _Tracked) -> None:
        for engine_request in tracked.engine_requests:
            self._latencies.dropped(engine_request.request_id)

    def _final_output(self, request: Request | ParentRequest) -> RequestOutput:
        """The finished output of a request that ``abort_request`` ended (a parent's: every
        child's final state, through ``ParentRequest.output``)."""
        if isinstance(request, ParentRequest):
            for index, child in enumerate(request.children):
                request.update(index, self._final_output(child))
            return request.output()
        tokenizer = self.engine.tokenizer
        token_ids = list(request.output_token_ids)
        text = request.output_text  # set when a stop string cut it
        if text is None:
            text = tokenizer.decode(token_ids) if tokenizer is not None and token_ids else ""
        completion = CompletionOutput(0, token_ids, text, request.finish_reason)
        if request.sampling_params.logprobs is not None:
            completion.logprobs = list(request.output_logprobs)
            completion.cumulative_logprob = request.cumulative_logprob
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=True,
            metrics=RequestMetrics(request.arrival_time, request.first_token_time,
                                   request.finish_time, request.num_preemptions))

    def _publish(self, deliveries: list) -> None:
        """Hand the outputs to the event loop, then update the stats snapshot."""
        if deliveries and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, deliveries)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                logger.warning("dropped %d outputs: the event loop is closed", len(deliveries))
        self._stats = self._snapshot()

    def _snapshot(self) -> EngineStats:
        engine = self.engine
        scheduler = engine.scheduler
        pools = engine.block_manager.pools
        now = time.monotonic()
        samples = self._token_samples
        samples.append((now, engine.metrics.output_tokens))
        while len(samples) > 2 and samples[1][0] < now - self.stats_window_seconds:
            samples.popleft()
        in_gpu_pool = sum(request.location is KVLocation.GPU for request in scheduler.running)
        return EngineStats(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            swapped=len(scheduler.swapped), running_in_gpu_pool=in_gpu_pool,
            running_in_host_pool=len(scheduler.running) - in_gpu_pool,
            gpu_blocks_used=pools[KVLocation.GPU].num_used,
            gpu_blocks_total=pools[KVLocation.GPU].num_blocks,
            host_blocks_used=pools[KVLocation.HOST].num_used,
            host_blocks_total=pools[KVLocation.HOST].num_blocks,
            counters=dataclasses.asdict(engine.metrics),
            token_window=(*samples[0], *samples[-1]),
            window_seconds=self.stats_window_seconds,
            histograms=self._latencies.snapshot())
