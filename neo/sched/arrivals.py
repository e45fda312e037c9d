"""``ArrivalRate``: how fast new work arrives, estimated from the arrival times the scheduler sees.

The requests a scheduling decision finds waiting are its backlog; the rate is about the work
that comes after it. Each decision (``Scheduler.schedule``) that finds new requests records one
entry: the newest arrival time among them and the prompt and output tokens they bring (their
``max_tokens``, the bound). Over the last ``window`` entries, the oldest entry opens the window
and is not counted: the rate is the tokens of the later entries over the time from the opening
entry's newest arrival until now. An offline burst (every request added before one decision)
is a single entry, so it opens the window and adds nothing to the rate: it is backlog only.
The scheduler starts the record again (``restart``) when a request comes to an idle engine: the
arrivals before it did not keep the engine busy, and a burst added then (a second offline run)
opens the new window.

The scheduler has no clock of the arrival times' own (they are the engine's monotonic clock, or
the simulator's), so "now" is the newest arrival time plus the seconds of the iterations the
engine reported since the decision that recorded it (``elapse``): a lower bound of the time
passed, through which the rate falls while the engine works on after arrivals stop. Until
``min_arrivals`` requests arrived after the opening entry, the rate is zero: a few requests
close together tell a short burst from a steady stream no better than a single one does.
"""

from collections import deque
from dataclasses import dataclass

from neo.request import Request


@dataclass(frozen=True)
class ArrivingWork:
    """Work arriving per second: prompt tokens to prefill and output tokens to decode."""

    prompt_tokens_per_s: float
    output_tokens_per_s: float


NO_ARRIVALS = ArrivingWork(0.0, 0.0)


@dataclass
class ArrivalEntry:
    """The requests one decision found newly arrived."""

    newest_arrival: float  # seconds, on the requests' arrival clock
    requests: int
    prompt_tokens: int
    output_tokens: int


class ArrivalRate:
    """A bounded record of arrivals and the rate of work they bring (see the module docstring)."""

    def __init__(self, window: int = 32, min_arrivals: int = 4):
        if window < 2:
            raise ValueError(f"window must be at least 2 entries (one opens it), got {window}")
        if min_arrivals < 1:
            raise ValueError(f"min_arrivals must be at least 1, got {min_arrivals}")
        self.min_arrivals = min_arrivals
        self._entries: deque[ArrivalEntry] = deque(maxlen=window)
        self._pending: list[Request] = []  # added since the last decision
        self._seconds_since_newest = 0.0  # iterations reported since the newest entry

    def restart(self) -> None:
        """Forget every arrival: the engine is idle."""
        self._entries.clear()
        self._pending = []
        self._seconds_since_newest = 0.0

    def arrive(self, request: Request) -> None:
        """A request added to the waiting queue; it joins the next decision's entry."""
        self._pending.append(request)

    def decide(self) -> None:
        """A scheduling decision: the requests added since the last one become one entry."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._entries.append(ArrivalEntry(max(r.arrival_time for r in pending), len(pending),
                                          sum(r.num_tokens for r in pending),
                                          sum(r.sampling_params.max_tokens for r in pending)))
        self._seconds_since_newest = 0.0

    def elapse(self, seconds: float) -> None:
        """The engine ran an iteration of ``seconds`` (ignored unless positive)."""
        if seconds > 0:
            self._seconds_since_newest += seconds

    def arriving_work(self) -> ArrivingWork:
        """Prompt and output tokens per second arriving after the window's opening entry;
        ``NO_ARRIVALS`` until ``min_arrivals`` requests did or when no time has passed."""
        if len(self._entries) < 2:
            return NO_ARRIVALS
        opening, *later = self._entries
        if sum(entry.requests for entry in later) < self.min_arrivals:
            return NO_ARRIVALS
        span = later[-1].newest_arrival + self._seconds_since_newest - opening.newest_arrival
        if span <= 0:
            return NO_ARRIVALS
        return ArrivingWork(sum(entry.prompt_tokens for entry in later) / span,
                            sum(entry.output_tokens for entry in later) / span)
