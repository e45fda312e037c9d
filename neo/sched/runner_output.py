"""What executing a plan gives back to the scheduler (``Scheduler.update``): the sampled tokens
and what the runner measured."""

from dataclasses import dataclass

from neo.request import Request

# Under async scheduling (``EngineConfig.async_scheduling``) a request's newest output token
# while the iteration that samples it still runs: it counts as a token for planning (positions,
# slots), and the runner takes the real one from the device for the next iteration's input. It
# is replaced when the tokens reach the host, or dropped if the request ends first.
UNRESOLVED_TOKEN = -1


@dataclass
class IterationOutput:
    """An executed plan's sub-batches."""

    tokens: list[int]  # one sampled token per request of ``plan.requests``, in that order
    seconds: float  # from starting the plan until its tokens were on the host
    host_seconds: float  # host attention time of the iteration
    queue_seconds: float = 0.0  # building its inputs and queuing its device work
    gpu_busy_seconds: float | None = None  # GPU time outside waits for the host, when measured
    replayed_graph: bool = False  # replayed from a captured CUDA graph


@dataclass
class HostBatchOutput:
    """A completed host batch of the async host pipeline."""

    requests: list[Request]
    tokens: list[int]  # one sampled token per request, in ``requests`` order
    seconds: float  # from launch until its tokens were on the host
    host_seconds: float  # host attention time
    replayed_graph: bool
    wait_seconds: float  # steps of the engine spent waiting for it, with no GPU work to run
