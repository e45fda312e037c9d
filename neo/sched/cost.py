"""The cost function: an iteration's time from its stage times and its ``StageOrder``.

Every caller that needs an iteration time asks this one function: the scheduler for the plans
it weighs, the profiler to fit the launch overhead it measures, and anything that simulates the
engine. It simulates the two resources of ``neo.sched.stage_order``: the GPU runs its steps in
issue order, the host runs its steps in issue order, each step starts once its resource is free
and the steps it waits for have finished, and a host step also waits for the GPU steps issued
before it. Stage times are whole-model seconds (all layers), so the simulated time is that of
one layer in the steady state, with each stage lasting the whole model's time: the per-layer
pipeline's fill and drain (at most one layer's worth of a stage at the ends) are left out, and
the launching thread's overheads come in as

- ``launch_overhead``: GPU time the launching thread adds to the iteration (launches,
  hand-offs), spread evenly over the sub-batches' ``pre`` stages, so that it hides under host
  attention where the host is the longer side, as it does in the engine;
- ``fixed_overhead``: added once (input preparation, sampling).

The steady state of that simulation is its longest cycle: each step is a node weighted by its
time; an edge says "starts after that one finishes" and counts how many layers back that one
was issued (0 or 1); the time per layer is the largest over the graph's cycles of their total
weight divided by their total layer count. The cycles depend on the order only, so each order's
are found once (``_cycles``), and an evaluation is a few sums. ``tests/test_cost.py`` checks it
against a plain event-by-event simulation over many layers.

For the ``asymmetric`` order that is ``max(lin1 + o/2, host0) + max(lin0 + gpu0 + o/2, host1)``
(``lin`` = pre + post, ``o`` the launch overhead), and for ``sequential`` ``lin + gpu + host``.
"""

import functools
from typing import NamedTuple, Sequence

from .stage_order import Resource, Stage, StageOrder, Step


class StageTimes(NamedTuple):
    """One sub-batch's stage times, whole-model seconds. ``linear`` is ``pre`` + ``post``,
    split by the perf model's ``pre_fraction``."""

    linear: float
    gpu_attention: float
    host_attention: float


def iteration_seconds(order: StageOrder, times: Sequence[StageTimes], pre_fraction: float = 0.5,
                      launch_overhead: float = 0.0, fixed_overhead: float = 0.0) -> float:
    """Seconds of an iteration of ``order`` whose sub-batch ``b`` has ``times[b]`` (see the
    module docstring). ``pre_fraction``: the share of a sub-batch's linear time in its ``pre``
    stage (the QKV projection's share of the layer's weights)."""
    if len(times) != order.num_sub_batches:
        raise ValueError(f"stage order {order.name!r} runs {order.num_sub_batches} sub-batches, "
                         f"got stage times for {len(times)}")
    launch_share = launch_overhead / order.num_sub_batches
    post_fraction = 1.0 - pre_fraction
    weights = []
    for stage, batch in _nodes(order):
        linear, gpu, host = times[batch]
        if stage is Stage.PRE:
            weights.append(linear * pre_fraction + launch_share)
        elif stage is Stage.POST:
            weights.append(linear * post_fraction)
        else:
            weights.append(gpu if stage is Stage.ATTN_GPU else host)
    return max(sum([weights[node] for node in nodes]) / layers for nodes, layers in _cycles(order)) + fixed_overhead


@functools.cache
def _nodes(order: StageOrder) -> tuple[tuple[Stage, int], ...]:
    return tuple((step.stage, step.sub_batch) for step in order.layer_steps)


@functools.cache
def _edges(order: StageOrder) -> tuple[tuple[int, int, int], ...]:
    """``(before, after, layers)``: step ``after`` (an index into ``order.layer_steps``) starts
    once step ``before`` of ``layers`` layers earlier has finished."""
    steps = order.layer_steps
    edges = set()
    for resource in Resource:
        indices = [index for index, step in enumerate(steps) if step.resource is resource]
        for first, second in zip(indices, indices[1:]):
            edges.add((first, second, 0))
        if indices:
            edges.add((indices[-1], indices[0], 1))
    gpu = [index for index, step in enumerate(steps) if step.resource is Resource.GPU]
    for index, step in enumerate(steps):
        if step.resource is Resource.HOST and gpu:
            earlier = [g for g in gpu if g < index]
            edges.add((earlier[-1], index, 0) if earlier else (gpu[-1], index, 1))
        for needed in step.waits_for:
            source = next(i for i, s in enumerate(steps) if (s.stage, s.sub_batch) == (needed.stage, needed.sub_batch))
            # ``step`` (declared at offset step.layer) in layer r reads layer r + needed.layer;
            # ``source`` handles that layer in the declaration of layer r + needed.layer - offset.
            layers = steps[source].layer - needed.layer
            edges.add((source, index, layers))
    return tuple(sorted(edges))


@functools.cache
def _cycles(order: StageOrder) -> tuple[tuple[tuple[int, ...], int], ...]:
    """The simple cycles of the order's graph that can be the longest, as ``(nodes, layers it
    spans)`` (those with the same nodes and span kept once: they weigh the same)."""
    count = len(order.layer_steps)
    outgoing: dict[int, list[tuple[int, int]]] = {node: [] for node in range(count)}
    for before, after, layers in _edges(order):
        outgoing[before].append((after, layers))
    found = set()

    def walk(start: int, node: int, path: list[int], layers: int) -> None:
        for following, step_layers in outgoing[node]:
            if following == start:
                found.add((tuple(sorted(path)), layers + step_layers))
            elif following > start and following not in path:
                walk(start, following, path + [following], layers + step_layers)

    for start in range(count):
        walk(start, start, [start], 0)
    if any(layers == 0 for _, layers in found):
        raise ValueError(f"stage order {order.name!r} deadlocks: a cycle of steps waits on itself "
                         f"within one layer")
    # A cycle inside another of the same span weighs no more unless the other's extra steps
    # include a ``pre``, whose launch overhead share may be negative: only those are kept.
    pre_steps = {index for index, step in enumerate(order.layer_steps) if step.stage is Stage.PRE}
    kept = [(nodes, layers) for nodes, layers in found
            if not any(layers == other_layers and set(nodes) < set(other) and not (set(other) - set(nodes)) & pre_steps
                       for other, other_layers in found)]
    return tuple(sorted(kept))


def simulate(order: StageOrder, times: Sequence[StageTimes], num_layers: int, pre_fraction: float = 0.5,
             launch_overhead: float = 0.0) -> float:
    """The event-by-event simulation over ``num_layers`` layers, each stage lasting its
    whole-model time over ``num_layers`` (the plain reading of the module docstring, fill and
    drain included; ``iteration_seconds`` is its steady state)."""
    launch_share = launch_overhead / order.num_sub_batches
    finished: dict[Step, float] = {}
    free = {Resource.GPU: 0.0, Resource.HOST: 0.0}
    last_gpu = 0.0
    for step in order.steps(num_layers):
        linear, gpu, host = times[step.sub_batch]
        duration = {Stage.PRE: linear * pre_fraction + launch_share, Stage.POST: linear * (1.0 - pre_fraction),
                    Stage.ATTN_GPU: gpu, Stage.ATTN_HOST: host}[step.stage] / num_layers
        ready = max([finished.get(needed, 0.0) for needed in step.waits_for], default=0.0)
        if step.resource is Resource.HOST:
            ready = max(ready, last_gpu)
        start = max(ready, free[step.resource])
        finished[step] = free[step.resource] = start + duration
        if step.resource is Resource.GPU:
            last_gpu = finished[step]
    return max(free.values())
