"""Test-only fault injection: makes chosen calls of an engine's parts raise ``InjectedFault``.

``Faults.install(engine)`` wraps, on that engine object only, the places where a real fault
would surface:

- ``swap``: a whole-request block copy between the pools. Copied layer by layer (an eager
  walk's ``KVCache.swap_layer``), it raises after half the layers were copied, so the copy is
  partial; copied over all layers at once (``KVCache.swap``: a plan with no sub-batch, or one
  that replays a graph), it raises before the copy;
- ``iteration``: the compute executor, raising in the middle layer's pre-attention stage,
  after the lower layers wrote their K/V;
- ``launch``: launching a host batch (async host pipeline), raising in the middle layer of
  its executor, after the lower layers wrote their K/V;
- ``host_attention``: the host's decode-attention kernel (a Python kernel registered as
  ``fault_injecting``, which runs the reference kernel unless told to raise). An engine uses
  it with ``cpu_attention_kernel=HOST_ATTENTION_KERNEL``.

``Faults.fail_at(kind, calls)`` picks which calls of a kind raise (0 = the first call of that
kind after ``reset``). Nothing here is reachable from the engine's settings.
"""

import collections

from neo.ops import implementations, reference, register_kernel

HOST_ATTENTION_KERNEL = "fault_injecting"
KINDS = ("swap", "iteration", "launch", "host_attention")


class InjectedFault(RuntimeError):
    pass


class Faults:
    """Counts the calls of each kind and raises at the chosen ones."""

    active: "Faults | None" = None  # the one the host-attention kernel consults

    def __init__(self):
        self.failing: dict[str, set[int]] = {kind: set() for kind in KINDS}
        self.calls = collections.Counter()
        self.fired = collections.Counter()

    def reset(self) -> None:
        self.failing = {kind: set() for kind in KINDS}
        self.calls.clear()
        self.fired.clear()

    def fail_at(self, kind: str, calls) -> None:
        self.failing[kind] |= set(calls)

    def check(self, kind: str) -> None:
        call = self.calls[kind]
        self.calls[kind] += 1
        if call in self.failing[kind]:
            self.fired[kind] += 1
            raise InjectedFault(f"injected {kind} fault (call {call})")

    def install(self, engine) -> None:
        """Wrap ``engine``'s parts (see the module docstring) and make this the active set."""
        Faults.active = self
        middle = engine.kv_cache.layout.num_layers // 2
        swap_layer = engine.kv_cache.swap_layer

        def faulty_swap_layer(layer_index, swap_out, swap_in):
            if layer_index == middle:
                self.check("swap")
            return swap_layer(layer_index, swap_out, swap_in)

        engine.kv_cache.swap_layer = faulty_swap_layer
        swap = engine.kv_cache.swap

        def faulty_swap(swap_out, swap_in):
            self.check("swap")
            return swap(swap_out, swap_in)

        engine.kv_cache.swap = faulty_swap
        self._wrap_pre(engine.runner.executor, "iteration", middle)
        if engine.runner.host_batches is not None:
            self._wrap_pre(engine.runner.host_batches.executor, "launch", middle)

    def _wrap_pre(self, executor, kind: str, middle: int) -> None:
        pre = executor._pre

        def faulty_pre(state, layer_index):
            if layer_index == middle:
                self.check(kind)
            return pre(state, layer_index)

        executor._pre = faulty_pre


def _fault_injecting_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale):
    if Faults.active is not None and q.shape[0] > 0:
        Faults.active.check("host_attention")
    reference.paged_decode_attention(out, q, k_cache, v_cache, block_table, seq_lens, scale)


def register_host_attention_kernel() -> None:
    """Register the ``fault_injecting`` kernel (once per process). Call it from a test, not at
    import: test modules collected later would list it among the implementations."""
    registered = implementations("paged_decode_attention", "cpu", available_only=False)
    if not any(implementation.name == HOST_ATTENTION_KERNEL for implementation in registered):
        register_kernel("paged_decode_attention", HOST_ATTENTION_KERNEL, _fault_injecting_attention)
