"""``Scheduler``: decides each iteration's plan and learns from its results. Never touches tensors.

One core serves every policy; where host decodes go is its pluggable part, a ``Placement``
(``neo.sched.placement``): none (gpu-only), the lockstep pipeline's two sub-batches, or the
async pipeline's host batches, each with ``full_offload`` as a parameter. Each iteration:

1. **Slots.** Every running request the placement may plan gets room for its next token, GPU
   pool first. When a pool runs out, the newest request of that pool is evicted: one that
   outgrows every pool it may decode in ends; a GPU request moves to the host pool if it has
   room (where it decodes on, or, under gpu-only, waits as a preempted request to come back);
   otherwise it gives its blocks back and waits to be prefilled again.
2. **Returns and admissions.** Requests on the host pool come back to the GPU pool while it has
   room: under the offloading policies those with the most tokens left first
   (``return_order="most-remaining"``, the default), else oldest first; waiting requests are
   prefilled within the token budget, into the GPU pool while it has room, else the host pool
   while the placement judges that more host decodes would pay. Where host decodes pay,
   admissions go first; where they do not (always under gpu-only), requests on the host come
   back first and new ones are admitted only once none is left there, as a gpu-only engine swaps
   in before it admits. Under gpu-only no request comes back in an iteration that had to evict
   one.
3. **Placement.** The placement puts host decodes into the plan (sub-batch 1, or a host batch)
   and estimates it, with what was judged about whether host decodes pay.

Whether host decodes pay is judged again when what it depends on changes (request counts, the
waiting head, the measured corrections) and at least every ``ECONOMICS_REFRESH_ITERATIONS``;
judging costs tens of estimates. Host requests always progress: while host decodes pay, or for
a request that could never fit the GPU pool, no host request waits more than ``max_host_wait``
iterations for a decode.

Results come back through ``update``: the sampled tokens (appended, finished requests freed),
the completed host batch, and the measured times, which correct later estimates. A host batch
that completes between two plans may be followed at once by the next (``schedule_host_batch``),
where the next plan would launch that batch whatever else it decided. The requests
added between decisions and the iterations' times also give the rate at which work arrives
(``ArrivalRate``), which the placement weighs against the backlog.

Under async scheduling (``EngineConfig.async_scheduling``) the engine plans the next iteration
before the tokens of the one running are known: ``advance`` gives each of its requests an
``UNRESOLVED_TOKEN`` (so positions and slots move on by one), ``update`` later puts the real
token in its place and applies the stop conditions, and a request that ended meanwhile (a stop
found in its previous token, an abort) has the token dropped. The engine plans ahead only while
``can_plan_ahead``: no request can be evicted, so an unresolved token never leaves the running
requests (by a preemption or an end for lack of room).
"""

import logging
from collections import deque
from collections.abc import Callable

from neo.config import EngineConfig
from neo.request import KVLocation, Request, RequestStatus

from .arrivals import ArrivalRate
from .block_manager import BlockManager
from .estimates import Estimates
from .placement import Placement
from .runner_output import UNRESOLVED_TOKEN, HostBatchOutput, IterationOutput
from .scheduler_output import SchedulerOutput, SubBatch

GPU, HOST = KVLocation.GPU, KVLocation.HOST
logger = logging.getLogger(__name__)

ECONOMICS_REFRESH_ITERATIONS = 16


def length_limit_reached(request: Request, token: int) -> str | None:
    """"length" once the request has its ``max_tokens``; the default finish rule (the engine
    passes one that also knows end-of-sequence tokens, stop strings and the context limit)."""
    return "length" if request.num_output_tokens >= request.sampling_params.max_tokens else None


def tokens_left(request: Request) -> int:
    """The most tokens ``request`` may still generate (its ``max_tokens`` less those it has)."""
    return request.sampling_params.max_tokens - request.num_output_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, placement: Placement,
                 estimates: Estimates, finish_reason: Callable[[Request, int], str | None] = length_limit_reached,
                 max_host_wait: int = 4):
        """``finish_reason(request, token)``: why the request ends after ``token`` (None: it
        goes on)."""
        self.config = config
        self.block_manager = block_manager
        self.placement = placement
        self.estimates = estimates
        self.finish_reason = finish_reason
        self.max_host_wait = max_host_wait
        self.waiting: deque[Request] = deque()
        self.arrivals = ArrivalRate()  # the work arriving per second, for the placement's judgement
        self.running: list[Request] = []  # decoding, in the GPU pool or the host pool
        self.swapped: deque[Request] = deque()  # preempted to the host pool, waiting to come back
        # Keep a few GPU blocks back when admitting, so one more decode token rarely preempts.
        self.watermark_blocks = max(1, block_manager.num_total(GPU) // 100)
        self.num_preemptions = 0
        self.iteration = 0
        self._evictions = 0  # in the iteration being planned
        self.iterations_without_host_decode = 0
        # Judged for the next iterations: whether host decodes pay at all (else host requests
        # return to the GPU before new admissions), and whether more of them would raise the
        # estimated throughput (new requests go to the host pool only then).
        self.host_decodes_pay = self.host_admission_open = placement.full_offload
        self._economics_seen: tuple | None = None  # what the last judgement was made on
        self._economics_iteration = 0

    # -- queues --------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if not self.has_unfinished:  # idle: the arrivals so far did not keep the engine busy
            self.arrivals.restart()
        self.waiting.append(request)
        self.arrivals.arrive(request)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """End a request; its blocks are free when this returns, unless a host batch in flight
        still uses them (then they are freed when it completes)."""
        if self.placement.defer_abort(request):
            self.running.remove(request)
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            return
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        self.finish(request, reason)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and return its blocks; the caller has removed it from the queues. An
        unresolved newest token (async scheduling) is dropped: it comes after the end."""
        if request.output_token_ids and request.output_token_ids[-1] == UNRESOLVED_TOKEN:
            request.output_token_ids.pop()
            request.num_tokens -= 1
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    @property
    def has_unfinished(self) -> bool:
        """Requests still to finish, or a host batch still to complete (its blocks with it)."""
        return self.num_unfinished > 0 or self.placement.host_batch_in_flight

    # -- planning ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.iteration += 1
        self._evictions = 0
        self.arrivals.decide()
        plan = SchedulerOutput()
        batch0 = SubBatch()
        host_requests = self._make_decode_slots(batch0, plan)
        host_requests = self._return_and_admit(batch0, host_requests, plan)
        self._judge_or_reset(host_requests + self.placement.in_flight_requests)
        self.placement.place(self, batch0, host_requests, plan)
        if self.placement.decodes_on_host:  # the fairness clock of host requests
            for request in plan.requests:
                request.last_scheduled_iteration = self.iteration
        return plan

    def schedule_host_batch(self, beside: SchedulerOutput,
                            unfinished: tuple[SchedulerOutput, ...] = ()) -> SchedulerOutput | None:
        """A plan of a host batch alone, to launch now: the host batch in flight has just
        completed (``update``) while the GPU runs ``beside``, the last plan made, and the
        placement launches host batches between steps; ``unfinished``: the other plans whose
        device work may not have run yet. None where one of them copies blocks between the
        pools (a host block a copy back to the GPU reads is free already, and a new token's
        slot may take it: the batch would write its K/V there before the copy runs), or where
        the next ``schedule`` might decide otherwise than launch the batch now, so that it
        decides: host decodes do not pay (host requests would come back to the GPU first), a
        host request would come back to the GPU pool now (it has room for the first in
        ``config.return_order``), or the host pool lacks a block for a host request's next
        token (``schedule`` evicts then).
        Otherwise every host request but those ``beside`` holds (a prompt prefilled into the
        host pool there) gets its slot and the placement launches the batch if ``schedule``
        would beside ``beside``'s GPU work (``Placement.place_host_batch``); a host
        batch not launched counts no wait (``count_host_wait`` counts iterations)."""
        placement = self.placement
        if not placement.places_between_steps or placement.host_batch_in_flight or not self.host_decodes_pay:
            return None
        if any(plan.has_swaps for plan in (beside, *unfinished)):
            return None
        in_beside = {id(request) for request in beside.requests}  # prefilled into the host pool there
        host_requests = [r for r in placement.plannable(self.running) if r.location is HOST and id(r) not in in_beside]
        manager = self.block_manager
        if not host_requests or self._would_return(host_requests):
            return None
        if sum(map(manager.needs_new_block, host_requests)) > manager.num_free(HOST):
            return None
        for request in host_requests:
            manager.append_slot(request)
        plan = SchedulerOutput()
        placement.place_host_batch(self, beside, host_requests, plan)
        return plan if plan.host_batch is not None else None

    def _would_return(self, host_requests: list[Request]) -> bool:
        """Whether ``_return_host_requests`` would move one of ``host_requests`` (in ``running``
        order) to the GPU pool now: it moves none unless the first in its order fits."""
        if GPU not in self.placement.decode_pools:
            return False
        first = host_requests[0] if self.config.return_order == "oldest" else max(host_requests, key=tokens_left)
        reserve = self.watermark_blocks if self.running else 0
        return self.block_manager.can_move(first, GPU, reserve=reserve)

    def _make_decode_slots(self, batch0: SubBatch, plan: SchedulerOutput) -> list[Request]:
        """Slots for every plannable request's next token, GPU pool first. GPU requests go into
        ``batch0``; returns the host requests that got a slot (GPU requests evicted just now
        among them), oldest first."""
        plannable = self.placement.plannable(self.running)
        gpu_queue = deque(r for r in plannable if r.location is GPU)
        while gpu_queue:
            request = gpu_queue.popleft()
            if self._make_slot(request, gpu_queue, plan):
                batch0.gpu_decodes.append(request)
        host_queue = deque(r for r in plannable if r.location is HOST)
        ready = []
        while host_queue:
            request = host_queue.popleft()
            if self._make_slot(request, host_queue, plan):
                ready.append(request)
        return ready

    def _make_slot(self, request: Request, queue: deque[Request], plan: SchedulerOutput) -> bool:
        """Room for ``request``'s next token in its pool. While the pool is full, evict the newest
        request of ``queue`` (``request`` itself when none is left). True if it got the slot."""
        manager = self.block_manager
        if not manager.needs_new_block(request):
            return True
        while manager.num_free(request.location) == 0:
            victim = queue.pop() if queue else request
            self._evict(victim, plan)
            if victim is request:
                return False
        manager.append_slot(request)
        return True

    def _evict(self, request: Request, plan: SchedulerOutput) -> None:
        """Out of the request's pool: it ends if it outgrows every pool it may decode in; a GPU
        request moves to the host pool if it has room (keeping a block for the next token where
        it decodes there); otherwise it gives its blocks back to be prefilled again."""
        manager = self.block_manager
        self._evictions += 1
        if len(request.block_table) + 1 > max(manager.num_total(pool) for pool in self.placement.decode_pools):
            self.running.remove(request)
            self.finish(request, "length")
            plan.finished.append(request)
            return
        decodes_on_host = self.placement.decodes_on_host
        if request.location is GPU and manager.can_move(request, HOST, reserve=1 if decodes_on_host else 0):
            plan.swap_out += manager.move(request, HOST)
            plan.moved.append(request)
            if not decodes_on_host:  # preempted: it waits in the host pool to come back
                request.num_preemptions += 1
                self.num_preemptions += 1
                request.status = RequestStatus.SWAPPED
                self.running.remove(request)
                self.swapped.append(request)
            return
        self._recompute_or_end(request, plan)

    def _recompute_or_end(self, request: Request, plan: SchedulerOutput) -> None:
        """Preempt by recompute if the request (prompt + output so far) can be prefilled again
        in one iteration; otherwise it would wait forever and block the queue, so it ends."""
        if request in self.running:
            self.running.remove(request)
        if request.num_tokens <= self.config.max_num_batched_tokens:
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.block_manager.free(request)
            request.num_cached_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
            return
        logger.warning("request %s ends at %d tokens: no KV pool has room for it and it is longer than "
                       "max_num_batched_tokens=%d, so it cannot be prefilled again", request.request_id,
                       request.num_tokens, self.config.max_num_batched_tokens)
        self.finish(request, "length")
        plan.finished.append(request)

    def _return_and_admit(self, batch0: SubBatch, host_requests: list[Request],
                          plan: SchedulerOutput) -> list[Request]:
        """Step 2 (see the module docstring); returns the host requests left on the host."""
        if not self.placement.decodes_on_host:  # gpu-only: preempted requests come back first
            if not self._evictions:
                self.swapped = deque(self._return_to_gpu(list(self.swapped), batch0, plan))
            if not self.swapped:
                self._admit_prefills(batch0, self._token_budget(batch0, []))
            return []
        if self.host_decodes_pay:
            self._admit_prefills(batch0, self._token_budget(batch0, host_requests))
            return self._return_host_requests(host_requests, batch0, plan)
        host_requests = self._return_host_requests(host_requests, batch0, plan)
        if not host_requests:
            self._admit_prefills(batch0, self._token_budget(batch0, host_requests))
        return host_requests

    def _token_budget(self, batch0: SubBatch, host_requests: list[Request]) -> int:
        """Prefill tokens the iteration has room for beside its decodes."""
        return self.config.max_num_batched_tokens - len(batch0.gpu_decodes) - len(host_requests)

    def _return_host_requests(self, host_requests: list[Request], batch0: SubBatch,
                              plan: SchedulerOutput) -> list[Request]:
        """``_return_to_gpu`` over the host requests (oldest first) in ``config.return_order``;
        returns those left on the host, oldest first."""
        if self.config.return_order == "oldest":
            return self._return_to_gpu(host_requests, batch0, plan)
        most_left_first = sorted(host_requests, key=tokens_left, reverse=True)  # stable: ties oldest first
        left = {id(request) for request in self._return_to_gpu(most_left_first, batch0, plan)}
        return [request for request in host_requests if id(request) in left]

    def _return_to_gpu(self, candidates: list[Request], batch0: SubBatch, plan: SchedulerOutput) -> list[Request]:
        """Move requests of the host pool back to the GPU pool, oldest first, while it has room
        (and, for a preempted request, while a sequence may be added) and the placement decodes
        there; they decode there this iteration. Returns those left on the host."""
        manager = self.block_manager
        if GPU not in self.placement.decode_pools:
            return candidates
        for index, request in enumerate(candidates):
            preempted = request.status is RequestStatus.SWAPPED  # no seat and no slot yet
            if preempted and len(self.running) >= self.config.max_num_seqs:
                return candidates[index:]
            reserve = (1 if preempted else 0) + (self.watermark_blocks if self.running else 0)
            if not manager.can_move(request, GPU, reserve=reserve):
                return candidates[index:]
            plan.swap_in += manager.move(request, GPU)
            plan.moved.append(request)
            if preempted:
                manager.append_slot(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
            batch0.gpu_decodes.append(request)
        return []

    def _admit_prefills(self, batch: SubBatch, budget: int) -> None:
        """Prefill waiting requests, oldest first, while the budget, the sequence cap and the
        pools allow."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_tokens > budget:
                break
            location = self._prefill_location(request)
            if location is None:
                break
            self.waiting.popleft()
            self.block_manager.allocate(request, location)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.prefills.append(request)
            budget -= request.num_tokens

    def _prefill_location(self, request: Request) -> KVLocation | None:
        """The GPU pool while it has room (keeping the watermark unless the request is alone),
        else the host pool while the placement decodes there and more host decodes would pay
        (a prompt's KV is copied out layer by layer as the prefill makes it); None: it waits."""
        pools = self.placement.decode_pools
        reserve = self.watermark_blocks if self.running else 0
        if GPU in pools and self.block_manager.can_allocate(request.num_tokens, GPU, reserve=reserve):
            return GPU
        if HOST not in pools or (not self.host_admission_open and self.running):  # alone, it always may
            return None
        return HOST if self.block_manager.can_allocate(request.num_tokens + 1, HOST) else None

    # -- whether host decodes pay ---------------------------------------------------------------

    def _judge_or_reset(self, host_population: list[Request]) -> None:
        """Judge whether host decodes pay (``_judge``) while requests wait or live on the host;
        with neither there is nothing to decide, and gpu-only rules hold until there is."""
        if self.placement.full_offload or not self.placement.decodes_on_host:
            return
        if host_population or self.waiting:
            self._judge(host_population)
        else:
            self.host_decodes_pay = self.host_admission_open = False
            self._economics_seen = None

    def _judge(self, host_requests: list[Request]) -> None:
        """Update ``host_decodes_pay`` and ``host_admission_open`` from the placement's
        economics when their inputs changed or ``ECONOMICS_REFRESH_ITERATIONS`` passed."""
        gpu_requests = [r for r in self.running if r.location is GPU]
        seen = (len(gpu_requests), len(host_requests), self.waiting[0].num_tokens if self.waiting else 0,
                self.placement.measured_corrections(self))
        if seen == self._economics_seen and self.iteration - self._economics_iteration < ECONOMICS_REFRESH_ITERATIONS:
            return
        self._economics_seen, self._economics_iteration = seen, self.iteration
        self.host_decodes_pay, self.host_admission_open = self.placement.economics(self, gpu_requests, host_requests)

    # -- rules the placements share ------------------------------------------------------------

    @staticmethod
    def oldest_first(requests: list[Request]) -> list[Request]:
        """Host requests in fairness order: the longest since they last decoded first."""
        return sorted(requests, key=lambda r: r.last_scheduled_iteration)

    @property
    def host_decode_due(self) -> bool:
        """A host request has waited ``max_host_wait`` iterations for a decode."""
        return self.iterations_without_host_decode >= self.max_host_wait

    def count_host_wait(self, waited: bool) -> None:
        """One more iteration in which host requests waited without a decode, or none did."""
        self.iterations_without_host_decode = self.iterations_without_host_decode + 1 if waited else 0

    def never_fits_gpu(self, request: Request) -> bool:
        return len(request.block_table) + 1 + self.watermark_blocks > self.block_manager.num_total(GPU)

    def extra_requests(self) -> list[tuple[int, int]]:
        """(requests, context tokens) of 1, 2, 4, ... more requests like the oldest waiting one,
        up to the sequence cap (none when nothing waits)."""
        if not self.waiting:
            return []
        length = self.waiting[0].num_tokens + 1
        extras, extra = [], 1
        while extra <= self.config.max_num_seqs - len(self.running):
            extras.append((extra, extra * length))
            extra *= 2
        return extras

    # -- planning ahead (async scheduling) -------------------------------------------------------

    def can_plan_ahead(self) -> bool:
        """Whether every running request of the GPU pool can have its next token's slot without
        evicting a request, so that a plan made now preempts and ends none."""
        manager = self.block_manager
        needed = sum(1 for request in self.running if request.location is GPU and manager.needs_new_block(request))
        return needed <= manager.num_free(GPU)

    def advance(self, plan: SchedulerOutput) -> None:
        """The plan was launched and its tokens are not known yet: each of its unfinished
        requests gets an ``UNRESOLVED_TOKEN`` in their place (``update`` resolves it)."""
        for request in plan.requests:
            if not request.is_finished:
                request.num_cached_tokens = request.num_tokens
                request.append_token(UNRESOLVED_TOKEN)

    # -- results -------------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, output: IterationOutput | None,
               host_batch: HostBatchOutput | None = None) -> list[Request]:
        """What executing ``plan`` gave (None when it had nothing to run) and the host batch
        that completed meanwhile, if any: appends each sampled token, ends the requests that are
        done (their blocks are free), learns from the measured times. Returns the requests that
        got a token, plan's first."""
        decoded = []
        if output is not None:
            self.arrivals.elapse(output.seconds)
            self.placement.observe(self, plan, output)
            decoded += self._append(list(zip(plan.requests, output.tokens)))
        if host_batch is not None:
            requests = self.placement.host_batch_done(self, host_batch)
            tokens = dict(zip(map(id, host_batch.requests), host_batch.tokens))
            decoded += self._append([(request, tokens[id(request)]) for request in requests])
        return decoded

    def fail_host_batch(self) -> list[Request]:
        """The host batch in flight failed: frees what aborts left behind and returns its
        requests (the caller ends them)."""
        return self.placement.host_batch_done(self, None)

    def _append(self, pairs: list[tuple[Request, int]]) -> list[Request]:
        """Give each request its token (in place of its unresolved one, if it has one; dropped
        for a request that ended meanwhile); returns the requests that got one."""
        requests = []
        for request, token in pairs:
            if request.is_finished:
                continue
            if request.output_token_ids and request.output_token_ids[-1] == UNRESOLVED_TOKEN:
                request.output_token_ids[-1] = token
            else:
                request.num_cached_tokens = request.num_tokens
                request.append_token(token)
            reason = self.finish_reason(request, token)
            if reason is not None:
                self.finish(request, reason)
            requests.append(request)
        self.running = [request for request in self.running if not request.is_finished]
        return requests
