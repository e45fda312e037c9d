"""Request latency histograms for ``/metrics``: time to first token, inter-token latency,
end-to-end latency and queue time, in seconds, with Prometheus' cumulative ``le`` buckets.

``RequestLatencies`` is fed by the engine thread after each iteration and read through
immutable snapshots, so the event loop never sees a histogram mid-update.
"""

import bisect
from dataclasses import dataclass

from neo.request import Request, RequestStatus
from neo.sched.runner_output import UNRESOLVED_TOKEN

# Upper bounds (seconds) of the buckets; the +Inf bucket is implied. They span a fast GPU's
# milliseconds to a saturated CPU server's minutes.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                               20.0, 40.0, 80.0)
E2E_REQUEST_LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                      40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)


def resolved_output_tokens(request: Request) -> int:
    """The request's output tokens the host has read: under async scheduling its newest one
    may still be on its way (``UNRESOLVED_TOKEN``) when its output goes out."""
    tokens = request.output_token_ids
    return len(tokens) - (1 if tokens and tokens[-1] == UNRESOLVED_TOKEN else 0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """bounds: bucket upper bounds, increasing. counts: observations per bucket, not
    cumulative (``len(bounds) + 1`` entries, the last one above every bound). total: the sum
    of the observed values."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    """Counts of observed values per bucket (``bounds``: upper bounds, increasing)."""

    def __init__(self, bounds: tuple[float, ...]):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be increasing, got {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Count ``value`` ``times`` times (in the first bucket whose bound is >= it)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)


@dataclass
class _Progress:
    """What was already observed of one request."""

    num_tokens: int = 0
    last_token_time: float = 0.0


class RequestLatencies:
    """The four histograms, fed from the requests the engine runs (``time.monotonic`` seconds).

    Queue time is arrival to the start of the first iteration that scheduled the request;
    time to first token and end-to-end latency are measured from arrival; each inter-token
    interval is the time between two iterations' outputs of a request, split evenly over the
    tokens the later one brought.
    """

    def __init__(self):
        self.time_to_first_token = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = Histogram(E2E_REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(QUEUE_TIME_BUCKETS)
        self._progress: dict[str, _Progress] = {}
        self._unscheduled: dict[str, Request] = {}

    def added(self, request: Request) -> None:
        """Start following ``request`` (just added to the engine)."""
        self._progress[request.request_id] = _Progress()
        self._unscheduled[request.request_id] = request

    def dropped(self, request_id: str) -> None:
        """Stop following a request that ended without a finished output (aborted)."""
        self._progress.pop(request_id, None)
        self._unscheduled.pop(request_id, None)

    def iteration_ran(self, started: float) -> None:
        """An iteration that started at ``started`` ran: the requests it scheduled first have
        waited from arrival until then."""
        for request_id, request in list(self._unscheduled.items()):
            if request.status is not RequestStatus.WAITING or request.first_token_time is not None:
                self.queue_time.observe(max(0.0, started - request.arrival_time))
                del self._unscheduled[request_id]

    def output(self, request: Request, finished: bool, now: float) -> None:
        """``request`` got an output at ``now``; ``finished``: it is the request's last."""
        progress = self._progress.get(request.request_id)
        if progress is None:
            return
        num_tokens = resolved_output_tokens(request)
        new_tokens = num_tokens - progress.num_tokens
        if new_tokens > 0:
            if progress.num_tokens == 0:
                first_token_time = request.first_token_time or now
                self.time_to_first_token.observe(max(0.0, first_token_time - request.arrival_time))
                progress.last_token_time = first_token_time
            else:
                interval = max(0.0, now - progress.last_token_time)
                self.inter_token_latency.observe(interval / new_tokens, times=new_tokens)
                progress.last_token_time = now
            progress.num_tokens = num_tokens
        if finished:
            finish_time = request.finish_time or now
            self.e2e_request_latency.observe(max(0.0, finish_time - request.arrival_time))
            self.dropped(request.request_id)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        """``{metric name without prefix: snapshot}``."""
        return {"time_to_first_token_seconds": self.time_to_first_token.snapshot(),
                "inter_token_latency_seconds": self.inter_token_latency.snapshot(),
                "e2e_request_latency_seconds": self.e2e_request_latency.snapshot(),
                "request_queue_time_seconds": self.queue_time.snapshot()}
