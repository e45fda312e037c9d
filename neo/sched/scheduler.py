"""``Scheduler``: decides each iteration's plan. It never touches tensors."""

import logging
from collections import deque

from .block_manager import BlockManager
from neo.config import EngineConfig
from neo.request import KVLocation, Request, RequestStatus
from .scheduler_output import SchedulerOutput, SubBatch

GPU, HOST = KVLocation.GPU, KVLocation.HOST
logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching over the two KV pools (gpu-only policy).

    Each iteration: every running request decodes one token (prefill and decode tokens mixed in
    one batch), waiting requests are prefilled while the token budget
    (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and free GPU blocks allow.
    When GPU blocks run out, the most recently admitted requests are preempted by swapping
    their KV to the host pool (or, if the host pool is full too, by freeing it to recompute
    later); swapped requests come back, oldest first, before new requests are admitted.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # Keep a few GPU blocks back when admitting, so one more decode token rarely preempts.
        self.watermark_blocks = max(1, block_manager.num_total(GPU) // 100)
        self.num_preemptions = 0

    # -- queue management ----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request, reason: str = "abort") -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        self.finish(request, reason)

    def finish(self, request: Request, reason: str) -> None:
        """Mark finished and return its blocks; the caller has removed it from the queues."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.block_manager.free(request)

    def remove_finished(self) -> None:
        self.running = [request for request in self.running if not request.is_finished]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # -- planning ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        batch = SubBatch()
        preempted = self._schedule_decodes(batch, output)
        if not preempted:
            self._swap_in(batch, output)
        if not self.swapped:
            self._admit_prefills(batch, budget=self.config.max_num_batched_tokens - batch.num_tokens)
        if batch:
            output.sub_batches.append(batch)
        return output

    def observe(self, plan: SchedulerOutput, host_seconds: float, measured_seconds: float) -> None:
        """What executing ``plan`` measured (its host attention seconds and its own seconds),
        for schedulers that learn from it; gpu-only does not."""

    def _schedule_decodes(self, batch: SubBatch, output: SchedulerOutput) -> bool:
        """Give each running request its next slot, preempting the newest when blocks run out."""
        manager = self.block_manager
        queue = deque(self.running)
        scheduled: list[Request] = []
        preempted = False
        while queue:
            request = queue.popleft()
            while manager.needs_new_block(request) and manager.num_free(GPU) == 0:
                victim = queue.pop() if queue else request
                self._preempt(victim, output)
                preempted = True
                if victim is request:
                    break
            else:
                manager.append_slot(request)
                scheduled.append(request)
        self.running = scheduled
        batch.gpu_decodes.extend(scheduled)
        return preempted

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        if len(request.block_table) + 1 > self.block_manager.num_total(GPU):
            # It alone outgrows the GPU pool: it could never come back, so it ends here.
            self.finish(request, "length")
            output.finished.append(request)
            return
        if self.block_manager.can_move(request, HOST):
            request.num_preemptions += 1
            self.num_preemptions += 1
            output.swap_out += self.block_manager.move(request, HOST)
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
        else:  # no room on the host either: drop the KV and prefill again later
            self._recompute_or_end(request, output)

    def _recompute_or_end(self, request: Request, output: SchedulerOutput) -> None:
        """Preempt by recompute if the request (prompt + output so far) can be prefilled again
        in one iteration; otherwise it would wait forever and block the queue, so it ends."""
        if request.num_tokens <= self.config.max_num_batched_tokens:
            self._recompute_later(request)
            return
        logger.warning("request %s ends at %d tokens: no KV pool has room for it and it is longer than "
                       "max_num_batched_tokens=%d, so it cannot be prefilled again", request.request_id,
                       request.num_tokens, self.config.max_num_batched_tokens)
        if request in self.running:
            self.running.remove(request)
        self.finish(request, "length")
        output.finished.append(request)

    def _recompute_later(self, request: Request) -> None:
        """Preempt by dropping the request's KV; it waits at the head of the queue to be
        prefilled again (prompt and output so far)."""
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request in self.running:
            self.running.remove(request)
        self.block_manager.free(request)
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _swap_in(self, batch: SubBatch, output: SchedulerOutput) -> None:
        manager = self.block_manager
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            reserve = 1 + (self.watermark_blocks if self.running else 0)
            if not manager.can_move(request, GPU, reserve=reserve):
                break
            self.swapped.popleft()
            output.swap_in += manager.move(request, GPU)
            manager.append_slot(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.gpu_decodes.append(request)

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
        """The pool a new request's KV goes to, or None if it must wait."""
        reserve = self.watermark_blocks if self.running else 0  # alone, it may use it all
        return GPU if self.block_manager.can_allocate(request.num_tokens, GPU, reserve=reserve) else None
