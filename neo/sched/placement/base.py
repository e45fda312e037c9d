"""``Placement``: the interface between the scheduler core and a host-decode placement."""

from neo.request import KVLocation, Request

from ..runner_output import HostBatchOutput, IterationOutput
from ..scheduler_output import SchedulerOutput, SubBatch


class Placement:
    """Where host decodes go. ``place`` is required; the other hooks have defaults.

    ``full_offload``: no GPU pool; every request decodes on the host, every iteration.
    ``decodes_on_host``: False for gpu-only, whose host pool only holds preempted requests.
    """

    decodes_on_host = True

    def __init__(self, full_offload: bool = False):
        self.full_offload = full_offload

    @property
    def decode_pools(self) -> tuple[KVLocation, ...]:
        """The pools a request may decode in (a request that outgrows all of them ends)."""
        if not self.decodes_on_host:
            return (KVLocation.GPU,)
        return (KVLocation.HOST,) if self.full_offload else (KVLocation.GPU, KVLocation.HOST)

    def place(self, scheduler, batch0: SubBatch, host_requests: list[Request], plan: SchedulerOutput) -> None:
        """Complete ``plan``: its sub-batches (``batch0`` holds the prefills and the GPU
        decodes; ``host_requests`` got their slots, oldest first), its stage order, host batch
        and estimates. Put a host request in the plan only to decode it this iteration; count
        ``scheduler.count_host_wait`` so that none waits beyond ``max_host_wait``."""
        raise NotImplementedError

    def economics(self, scheduler, gpu_requests: list[Request], host_requests: list[Request]) -> tuple[bool, bool]:
        """(do host decodes pay, would more of them pay), judged by the scheduler before
        ``place`` when what they depend on changed (``host_requests``: those on the host,
        in flight included): where they do not pay, host requests return to the GPU before new
        admissions; new requests go to the host pool only while more would pay. The default:
        they never pay, so the host pool only takes requests evicted from the GPU's."""
        return False, False

    def measured_corrections(self, scheduler) -> tuple:
        """What the engine's measurements currently correct the estimates by (a change calls
        for judging the economics again)."""
        return (scheduler.estimates.host_calibration.scale,)

    def plannable(self, running: list[Request]) -> list[Request]:
        """The running requests this iteration may decode, evict or move."""
        return running

    def observe(self, scheduler, plan: SchedulerOutput, output: IterationOutput) -> None:
        """An executed plan's measured times: its host time corrects later host estimates
        (plans that also copied out a prefill's K/V to the host are left out: the estimate
        omits it)."""
        if not plan.profiled_host_time or any(
                r.location is KVLocation.HOST for batch in plan.sub_batches for r in batch.prefills):
            return
        scheduler.estimates.host_calibration.observe(plan.profiled_host_time, output.host_seconds)

    # -- host batches in flight (the async pipeline's; none elsewhere) --------------------------

    @property
    def host_batch_in_flight(self) -> bool:
        return False

    @property
    def in_flight_requests(self) -> list[Request]:
        """Host requests in a host batch in flight (out of planning, still on the host)."""
        return []

    def defer_abort(self, request: Request) -> bool:
        """Whether an abort of ``request`` must leave its blocks until its host batch is done."""
        return False

    def host_batch_done(self, scheduler, output: HostBatchOutput | None) -> list[Request]:
        """The host batch in flight completed (``output`` None: it failed); returns the
        requests whose tokens the caller appends."""
        raise RuntimeError("this placement launches no host batches")

    #: Whether ``place_host_batch`` may launch a host batch between two plans.
    places_between_steps = False

    def place_host_batch(self, scheduler, beside: SchedulerOutput, host_requests: list[Request],
                         plan: SchedulerOutput) -> None:
        """Put a host batch of ``host_requests`` (their slots made, in ``running`` order) into
        ``plan``, which holds nothing else, if ``place`` would have launched it with ``beside``:
        the batch in flight has just completed while the GPU runs ``beside``, the last plan made
        (``Scheduler.schedule_host_batch``)."""
        raise RuntimeError("this placement launches no host batches between steps")
