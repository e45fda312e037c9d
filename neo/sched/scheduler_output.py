"""The plan a scheduler hands to the runner for one iteration."""

from dataclasses import dataclass, field

from neo.request import KVLocation, Request

from .stage_order import StageOrder


@dataclass
class SubBatch:
    """Requests that go through the layers together.

    ``prefills`` already have blocks in their destination pool (``request.location``): a prefill
    whose location is the host pool computes on the compute device and has its KV copied out
    layer by layer. ``gpu_decodes`` attend on the compute device, ``host_decodes`` on the host.
    """

    prefills: list[Request] = field(default_factory=list)
    gpu_decodes: list[Request] = field(default_factory=list)
    host_decodes: list[Request] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(request.num_tokens for request in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.gpu_decodes) + len(self.host_decodes)

    @property
    def requests(self) -> list[Request]:
        return self.prefills + self.gpu_decodes + self.host_decodes

    def __bool__(self) -> bool:
        return bool(self.prefills or self.gpu_decodes or self.host_decodes)


@dataclass
class SchedulerOutput:
    """One iteration: one sub-batch or two, the ``stage_order`` they go through the layers in
    (the one the scheduler's estimate used; None: the runner's order for that many sub-batches),
    plus the whole-request block copies between pools to perform first (per layer). Under the
    async host pipeline, ``host_batch`` is a sub-batch of host decodes to launch on the host
    stream now; it completes in a later iteration (its requests are outside ``requests``)."""

    sub_batches: list[SubBatch] = field(default_factory=list)
    stage_order: StageOrder | None = None
    host_batch: SubBatch | None = None
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, host_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host_block, gpu_block)
    finished: list[Request] = field(default_factory=list)  # ended while planning (out of room)
    # Requests whose blocks ``swap_out``/``swap_in`` copy; a swapped-out one may be in no
    # sub-batch (it waits in the host pool, or decodes there in a later iteration).
    moved: list[Request] = field(default_factory=list)
    predicted_time: float | None = None  # seconds, from the PerfModel (offloading policies)
    predicted_host_time: float | None = None  # of which host attention (both sub-batches)
    profiled_host_time: float | None = None  # the same from the profile alone (uncalibrated)
    # The host batch's estimates: seconds until its tokens, of which host attention (calibrated,
    # and from the profile alone).
    host_batch_predicted_time: float | None = None
    host_batch_predicted_host_time: float | None = None
    host_batch_profiled_host_time: float | None = None
    # Under the async host pipeline: whether a host batch is in flight beside this plan's GPU
    # work (the one launched with it included); None under the other pipelines.
    beside_host_batch: bool | None = None
    # A decode-only iteration under the async host pipeline that moves no blocks: its estimated
    # seconds alone from the profile (uncorrected), against which its measured time teaches the
    # calibration of iterations alone (``Estimates.gpu_decode_calibration``, from those beside no
    # host batch) and the slowdown beside host batches (``HostBatchInterference``) once it has
    # run. Carried by the plan, as async scheduling makes the next plan before this one's time
    # is measured.
    gpu_decode_sample: float | None = None

    @property
    def is_empty(self) -> bool:
        """Nothing for the compute stream (a host batch to launch aside)."""
        return not any(self.sub_batches) and not self.swap_out and not self.swap_in and not self.finished

    @property
    def requests(self) -> list[Request]:
        return [request for batch in self.sub_batches for request in batch.requests]

    @property
    def affected_requests(self) -> list[Request]:
        """Every request whose state executing the plan changes: ``requests`` and ``moved``."""
        seen = set()
        return [r for r in self.requests + self.moved if id(r) not in seen and not seen.add(id(r))]

    def runs_ahead(self) -> bool:
        """Whether, under async scheduling, the plan may be launched before the previous
        iteration's tokens are read: it has device work, all of it on requests whose KV is in
        the GPU pool (a host batch beside it is launched and collected on its own), it copies no
        blocks between the pools, and no request needs its tokens on the host when the next
        plan launches (penalties count them; log-probabilities are recorded with them). The
        copies: a host batch runs on streams of its own, so one launched while they may not
        have run would read a request's blocks before they arrive in the host pool, or write a
        new token's K/V into a freed host block that a copy back to the GPU has yet to read; a
        plan with copies is read before the next plan is made."""
        return any(self.sub_batches) and not self.has_swaps and all(
            request.location is KVLocation.GPU and not request.sampling_params.uses_penalties
            and request.sampling_params.logprobs is None for request in self.requests)

    @property
    def touches_host_pool(self) -> bool:
        """Whether the plan's device work reads or writes the host pool: host decodes, prefills
        whose KV goes there, or swaps."""
        return self.has_swaps or any(request.location is not KVLocation.GPU for request in self.requests)

    def drop_finished(self) -> None:
        """Take out the decodes of requests that ended after the plan was made (async
        scheduling: the tokens of the iteration before were read only then, and the blocks of
        a request they ended are free)."""
        for batch in self.sub_batches:
            batch.gpu_decodes = [request for request in batch.gpu_decodes if not request.is_finished]
            batch.host_decodes = [request for request in batch.host_decodes if not request.is_finished]

    @property
    def has_swaps(self) -> bool:
        return bool(self.swap_out or self.swap_in)

    @property
    def num_tokens(self) -> int:
        return sum(batch.num_tokens for batch in self.sub_batches)
