"""Stage orders: what one iteration runs, in which order, on which resource, declared as data.

A sub-batch goes through every layer in four stages (``models/llama.py``)::

    pre        GPU   add + RMSNorm, QKV projection, rotary, new K/V stored in the device cache
    attn_gpu   GPU   attention of the prefill and GPU-decode rows
    attn_host  host  attention of the host-decode rows: their new K/V stored in the host cache,
                     then decode attention over it on the host CPU
    post       GPU   O projection, add + RMSNorm, gated MLP

A ``StageOrder`` lists one layer's steps in the order the launching thread issues them; a step
may belong to an earlier layer (``layer=-1``: the ``post`` of layer ``i - 1`` issued among the
steps of layer ``i``). Expanded over the model's layers (``steps``), that is the exact sequence
the executor walks (``neo.runner.executor``), and the cost function (``neo.sched.cost``) turns
the same declaration into an iteration time. The GPU runs its steps in issue order on one
stream; the host runs its steps in issue order too (one after another, each on all its
threads). Every step waits for the steps whose results it reads (``Step.waits_for``: a layer's
``pre`` needs the previous layer's ``post``, the attentions need the ``pre``, the ``post`` needs
both attentions), and a host step also waits for the GPU work issued before it: the hand-off
queues its copies behind that work on the compute stream.

The orders the engine runs:

- ``sequential`` (one sub-batch; any iteration of the gpu-only policy, and an offloading
  iteration with one sub-batch): ``post(0, i-1) pre(0, i) attn_gpu(0, i) attn_host(0, i)``;
  the GPU waits for the host attention before the ``post``.
- ``asymmetric`` (the lockstep host pipeline's two sub-batches; batch 0 holds the prefills,
  the GPU decodes and a few host decodes, batch 1 host decodes): per layer the GPU works on one
  sub-batch while the host attends for the other::

      layer i:  GPU  | post(1,i-1) pre(1,i)  | post(0,i-1) pre(0,i) attn_gpu(0,i) |
                host |    attn_host(0,i-1)   |           attn_host(1,i)           |

- ``asymmetric-early-host``: the same, but each sub-batch's host attention is issued right
  after its ``pre`` (its keys and values are then in the caches), before its GPU attention, so
  the host may start while the GPU attends.
- ``host-batch`` (the async host pipeline's batch of host decodes, on a stream of its own):
  the sequential order. Between two layers' host attention the host waits for the batch's own
  ``post`` and ``pre`` on the GPU, beside the GPU's iterations.
- ``host-batch-pair``: the async host pipeline's batch in two halves, in the ``asymmetric``
  order: the host attends for one half while the batch's stream runs the other half's ``post``
  and ``pre``, so the host need not wait between layers; each half's GPU stages read the
  weights, twice per layer for the batch (``EngineConfig.host_batch_order``).

A new order is a new ``StageOrder`` in ``STAGE_ORDERS`` (``validate`` checks it keeps the
transformer's data dependencies and can run to the end), selected with
``EngineConfig.stage_order`` for the lockstep pipeline; ``tests/test_stage_order.py`` shows the
tests it needs.
"""

import enum
import functools
from dataclasses import dataclass


class Stage(enum.Enum):
    PRE = "pre"
    ATTN_GPU = "attn_gpu"
    ATTN_HOST = "attn_host"
    POST = "post"


class Resource(enum.Enum):
    """Who runs a step: the compute device's stream, or the host CPU (through the hand-off)."""

    GPU = "gpu"
    HOST = "host"


@dataclass(frozen=True)
class Step:
    """One stage of one sub-batch at one layer (in a ``StageOrder``'s declaration, ``layer`` is
    relative to the layer being declared: 0 or -1)."""

    stage: Stage
    sub_batch: int
    layer: int = 0

    @property
    def resource(self) -> Resource:
        return Resource.HOST if self.stage is Stage.ATTN_HOST else Resource.GPU

    @property
    def waits_for(self) -> tuple["Step", ...]:
        """The steps whose results this one reads (the same sub-batch's)."""
        batch, layer = self.sub_batch, self.layer
        if self.stage is Stage.PRE:
            return (Step(Stage.POST, batch, layer - 1),)
        if self.stage is Stage.POST:
            return Step(Stage.ATTN_GPU, batch, layer), Step(Stage.ATTN_HOST, batch, layer)
        return (Step(Stage.PRE, batch, layer),)

    def __str__(self) -> str:
        return f"{self.stage.value}({self.sub_batch},{self.layer})"


def pre(sub_batch: int, layer: int = 0) -> Step:
    return Step(Stage.PRE, sub_batch, layer)


def attn_gpu(sub_batch: int, layer: int = 0) -> Step:
    return Step(Stage.ATTN_GPU, sub_batch, layer)


def attn_host(sub_batch: int, layer: int = 0) -> Step:
    return Step(Stage.ATTN_HOST, sub_batch, layer)


def post(sub_batch: int, layer: int = -1) -> Step:
    return Step(Stage.POST, sub_batch, layer)


@dataclass(frozen=True)
class StageOrder:
    """One layer's steps in issue order (see the module docstring)."""

    name: str
    num_sub_batches: int
    layer_steps: tuple[Step, ...]
    summary: str

    def __post_init__(self):
        validate(self)

    def __hash__(self) -> int:
        """By name and size only: the cost function's caches look an order up on every estimate,
        and the generated hash would walk every step and its enums each time. Orders that share
        a name but differ in their steps still compare unequal."""
        return hash((self.name, self.num_sub_batches))

    def steps(self, num_layers: int) -> tuple[Step, ...]:
        """The whole iteration's steps, in issue order, for a model of ``num_layers`` layers."""
        return _expanded(self, num_layers)

    def __str__(self) -> str:
        gpu = [str(step) for step in self.layer_steps if step.resource is Resource.GPU]
        host = [str(step) for step in self.layer_steps if step.resource is Resource.HOST]
        return (f"{self.name} ({self.num_sub_batches} sub-batch{'es' if self.num_sub_batches > 1 else ''}): "
                f"{' '.join(map(str, self.layer_steps))} | GPU {' '.join(gpu)} | host {' '.join(host)}")


@functools.cache
def _expanded(order: StageOrder, num_layers: int) -> tuple[Step, ...]:
    """Layer ``i``'s declaration for ``i`` in ``[0, num_layers - min offset)``, the steps of
    layers outside ``[0, num_layers)`` dropped: the first layers' missing ``post(-1)`` and the
    last layers' trailing ``post`` fall out of it."""
    lowest = min(step.layer for step in order.layer_steps)
    steps = []
    for layer in range(num_layers - lowest):
        for step in order.layer_steps:
            absolute = layer + step.layer
            if 0 <= absolute < num_layers:
                steps.append(Step(step.stage, step.sub_batch, absolute))
    return tuple(steps)


def validate(order: StageOrder) -> None:
    """Raise ``ValueError`` unless the declaration names each stage of each sub-batch once,
    with a layer offset of 0 or -1, and its expansion issues every step after the steps it
    waits for (which also means it cannot deadlock)."""
    if order.num_sub_batches < 1:
        raise ValueError(f"stage order {order.name!r}: needs at least one sub-batch")
    expected = {(stage, batch) for stage in Stage for batch in range(order.num_sub_batches)}
    declared = [(step.stage, step.sub_batch) for step in order.layer_steps]
    if sorted(declared, key=str) != sorted(expected, key=str):
        missing = expected - set(declared)
        extra = [item for item in declared if declared.count(item) > 1 or item not in expected]
        raise ValueError(f"stage order {order.name!r} must declare each stage of each of its "
                         f"{order.num_sub_batches} sub-batches once; missing "
                         f"{sorted(f'{s.value}({b})' for s, b in missing)}, extra or repeated "
                         f"{sorted(set(f'{s.value}({b})' for s, b in extra))}")
    for step in order.layer_steps:
        if step.layer not in (0, -1):
            raise ValueError(f"stage order {order.name!r}: {step} has layer offset {step.layer}; "
                             f"offsets are 0 (this layer) or -1 (the one before)")
    for num_layers in (1, 3):
        issued: set[Step] = set()
        for step in order.steps(num_layers):
            late = [needed for needed in step.waits_for if 0 <= needed.layer and needed not in issued]
            if late:
                raise ValueError(f"stage order {order.name!r} issues {step} before {late[0]}, "
                                 f"whose result it needs")
            issued.add(step)


SEQUENTIAL = StageOrder(
    "sequential", 1, (post(0), pre(0), attn_gpu(0), attn_host(0)),
    "one sub-batch, its stages one after another; the GPU waits for its host attention")
ASYMMETRIC = StageOrder(
    "asymmetric", 2, (post(1), pre(1), attn_gpu(1), attn_host(1), post(0), pre(0), attn_gpu(0), attn_host(0)),
    "two sub-batches; the GPU runs one's linear stages while the host attends for the other")
ASYMMETRIC_EARLY_HOST = StageOrder(
    "asymmetric-early-host", 2,
    (post(1), pre(1), attn_host(1), attn_gpu(1), post(0), pre(0), attn_host(0), attn_gpu(0)),
    "asymmetric, each host attention issued before its sub-batch's GPU attention")
HOST_BATCH = StageOrder(
    "host-batch", 1, SEQUENTIAL.layer_steps,
    "the async host pipeline's batch of host decodes, on its own stream, stages one after another")

HOST_BATCH_PAIR = StageOrder(
    "host-batch-pair", 2, ASYMMETRIC.layer_steps,
    "the async host pipeline's batch of host decodes in two halves, asymmetric: the host attends for one "
    "half while the GPU runs the other's stages")

STAGE_ORDERS = {order.name: order
                for order in (SEQUENTIAL, ASYMMETRIC, ASYMMETRIC_EARLY_HOST, HOST_BATCH, HOST_BATCH_PAIR)}
# The orders a host batch of the async host pipeline may follow (``EngineConfig.host_batch_order``).
HOST_BATCH_ORDERS = (HOST_BATCH.name, HOST_BATCH_PAIR.name)
# The orders a lockstep iteration of two sub-batches may follow (``EngineConfig.stage_order``).
TWO_SUB_BATCH_ORDERS = tuple(name for name, order in STAGE_ORDERS.items()
                             if order.num_sub_batches == 2 and name not in HOST_BATCH_ORDERS)


def two_sub_batch_order(name: str) -> StageOrder:
    """The two-sub-batch order called ``name``; a ``ValueError`` lists them otherwise."""
    if name not in TWO_SUB_BATCH_ORDERS:
        raise ValueError(f"unknown two-sub-batch stage order {name!r}; choose one of "
                         f"{', '.join(TWO_SUB_BATCH_ORDERS)}")
    return STAGE_ORDERS[name]


def host_batch_order(name: str) -> StageOrder:
    """The host-batch order called ``name``; a ``ValueError`` lists them otherwise."""
    if name not in HOST_BATCH_ORDERS:
        raise ValueError(f"unknown host batch order {name!r}; choose one of {', '.join(HOST_BATCH_ORDERS)}")
    return STAGE_ORDERS[name]


def host_batch_sub_batches(order: StageOrder, count: int) -> tuple[StageOrder, list[slice]]:
    """How a host batch of ``count`` decodes goes through ``order``: the order it runs in and
    each sub-batch's slice of its decodes, contiguous and as even as they can be (the first
    ones a decode longer). A batch of fewer decodes than ``order`` has sub-batches runs in
    ``host-batch``, whole."""
    parts = order.num_sub_batches
    if count < parts:
        return HOST_BATCH, [slice(0, count)]
    sizes = [count // parts + (index < count % parts) for index in range(parts)]
    starts = [sum(sizes[:index]) for index in range(parts)]
    return order, [slice(start, start + size) for start, size in zip(starts, sizes)]
