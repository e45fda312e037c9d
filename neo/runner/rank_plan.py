"""What the driver rank sends the other tensor-parallel ranks each iteration, and the channel.

The scheduler runs once, on rank 0 (the driver). Before its runner executes a plan, it
broadcasts the plan: per sub-batch, a ``PlannedRequest`` per request with exactly what
``build_batch_inputs`` reads (token ids, block table, KV location), plus the swaps and the stage
order. Every rank's runner then builds the same inputs, walks the same stage order over its own
shard and KV heads, and meets the others in the model's collectives in the same order. Block
tables are the same on every rank (one block manager), so the pools of all ranks hold the same
number of blocks. Sampling stays on the driver: the sampled tokens reach the other ranks as the
next plan's decode inputs, or, under async scheduling, where the next plan was made before they
were read (``UNRESOLVED_TOKEN``), by a broadcast on the device after every iteration
(``ModelRunner`` with ``share_samples``).

Block tables travel incrementally: the other ranks keep each request's table by request id
(``HeldTables``), and the driver (``SentTables``) sends a request's whole table the first time
the request is planned or after its table was replaced (allocated anew after a preemption,
moved between pools by a swap), and afterwards only the blocks appended since the last message
that carried the request; every message also names the requests that finished (or were aborted)
since the last one, so the other ranks drop their tables.

Messages are ``(kind, payload)``: ``("execute", planned(plan))`` before an iteration,
``("launch", planned_sub_batch(host_batch))`` before a host batch of the async host pipeline is
launched, ``("parts", count)`` before the driver queues more of that batch's layer parts (the
first ``count`` then: the others queue theirs up to it), ``("profile", None)`` before the driver
profiles stage times (every rank then runs its own profiler in lockstep: the model's collectives
join their measurements), ``("torch_profiler", "start" | "stop")`` when the driver starts or
stops recording a timeline (``neo.engine.torch_profiler``); ``None`` tells the others to stop.
On the wire, "execute" and "launch" carry a third element, the ids of the finished requests.
The channel is a gloo group of its own (``PlanChannel``): ``broadcast_object_list`` pickles the
message on rank 0 and unpickles it on the others.
"""

from dataclasses import dataclass

import torch.distributed as dist

from neo.request import KVLocation, Request
from neo.sched.scheduler_output import SchedulerOutput, SubBatch

PLAN_KINDS = ("execute", "launch")  # the messages that carry requests


@dataclass
class PlannedRequest:
    """The part of a ``Request`` a rank needs to lay out its tokens (``build_batch_inputs``):
    ``all_token_ids`` is filled for prefills only (decodes read ``last_token_id``).
    ``block_table`` holds the request's blocks from index ``table_start`` on: on the wire, the
    whole table (``table_start`` 0) or the blocks appended since the last message that carried
    the request; ``PlanChannel.receive`` hands out whole tables."""

    request_id: str
    num_tokens: int
    table_start: int
    block_table: list[int]
    location: KVLocation
    last_token_id: int
    all_token_ids: list[int]


class SentTables:
    """The driver's record, per request id, of the block table the other ranks hold: the table
    object last sent and how many of its blocks they have. The block manager gives a request a
    new list whenever it allocates, frees or moves its blocks (prefill, preemption, swap) and
    extends the list in place when it appends a block, so a table that is still the recorded
    object, no shorter than recorded, has only gained blocks since; any other is sent whole."""

    def __init__(self):
        self.sent: dict[str, tuple[Request, list[int], int]] = {}  # id -> (request, table, blocks sent)

    def planned(self, request: Request, prefill: bool) -> PlannedRequest:
        """``request`` as the next message carries it (recorded as sent)."""
        table = request.block_table
        record = self.sent.get(request.request_id)
        start = record[2] if record is not None and record[1] is table and record[2] <= len(table) else 0
        self.sent[request.request_id] = (request, table, len(table))
        return PlannedRequest(request.request_id, request.num_tokens, start, table[start:], request.location,
                              request.last_token_id, list(request.all_token_ids) if prefill else [])

    def forget_finished(self) -> list[str]:
        """The ids of the recorded requests that have finished (aborted ones included), no
        longer recorded."""
        finished = [request_id for request_id, (request, _, _) in self.sent.items() if request.is_finished]
        for request_id in finished:
            del self.sent[request_id]
        return finished


class HeldTables:
    """A rank other than the driver: the whole block table of each request the driver has
    planned and not yet reported finished, by request id."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def restore(self, request: PlannedRequest) -> None:
        """Give ``request`` (as received) its whole block table, extending the one held."""
        if request.table_start == 0:
            table = request.block_table
        else:
            table = self.tables.get(request.request_id)
            held = None if table is None else len(table)
            if held != request.table_start:
                raise RuntimeError(f"request {request.request_id!r}: the driver sent blocks from index "
                                   f"{request.table_start} on, but this rank holds {held} blocks of its table")
            table.extend(request.block_table)
        self.tables[request.request_id] = table
        request.block_table = table
        request.table_start = 0

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.tables.pop(request_id, None)


def planned_sub_batch(batch: SubBatch, tables: SentTables) -> SubBatch:
    """``batch`` with every request replaced by its ``PlannedRequest`` (recorded in ``tables``)."""
    return SubBatch(prefills=[tables.planned(request, True) for request in batch.prefills],
                    gpu_decodes=[tables.planned(request, False) for request in batch.gpu_decodes],
                    host_decodes=[tables.planned(request, False) for request in batch.host_decodes])


def planned(plan: SchedulerOutput, tables: SentTables) -> SchedulerOutput:
    """The parts of ``plan`` the other ranks execute: sub-batches of ``PlannedRequest``s, the
    swaps and the stage order (no estimates, no finished requests; the plan's host batch went
    to them already, in the "launch" message sent before the iteration runs)."""
    return SchedulerOutput(sub_batches=[planned_sub_batch(batch, tables) for batch in plan.sub_batches],
                           stage_order=plan.stage_order,
                           swap_out=list(plan.swap_out), swap_in=list(plan.swap_in))


def _sub_batches(kind: str, payload) -> list[SubBatch]:
    """The sub-batches of a received "execute" or "launch" payload, in the order the driver
    planned their requests."""
    return [payload] if kind == "launch" else payload.sub_batches


class PlanChannel:
    """Rank 0 -> every other rank, over its own gloo group (``group``: made by every rank with
    ``dist.new_group(backend="gloo")``). Rank 0 records the tables it sent (``sent``), the
    others the tables they hold (``held``)."""

    def __init__(self, group: dist.ProcessGroup, rank: int):
        self.group = group
        self.rank = rank
        self.sent = SentTables()
        self.held = HeldTables()

    def send_plan(self, plan: SchedulerOutput) -> None:
        """Rank 0: the plan of an iteration, before executing it."""
        finished = self.sent.forget_finished()
        self.send(("execute", planned(plan, self.sent), finished))

    def send_host_batch(self, batch: SubBatch) -> None:
        """Rank 0: a host batch of the async host pipeline, before launching it."""
        finished = self.sent.forget_finished()
        self.send(("launch", planned_sub_batch(batch, self.sent), finished))

    def send_parts(self, count: int) -> None:
        """Rank 0: the host batch in flight is about to have its first ``count`` layer parts queued."""
        self.send(("parts", count))

    def send_torch_profiler(self, action: str) -> None:
        """Rank 0: every rank starts ("start") or stops ("stop") its torch profiler now."""
        self.send(("torch_profiler", action))

    def send(self, message) -> None:
        """Rank 0: hand ``message`` (picklable; None: stop) to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self):
        """Ranks 1..N-1: the next message of rank 0 (blocks until it comes), its requests with
        their whole block tables."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        message = box[0]
        if message is None or message[0] not in PLAN_KINDS:
            return message
        kind, payload, finished = message
        self.held.forget(finished)
        for batch in _sub_batches(kind, payload):
            for request in batch.requests:
                self.held.restore(request)
        return kind, payload
