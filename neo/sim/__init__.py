"""``neo simulate``: what-if throughput and latency of the policies on a machine described by a
few numbers, from the real scheduler against simulated time.

- ``hardware.py``: ``Hardware`` and its presets;
- ``stage_times.py``: the ``PerfTable`` synthesized from a model's shapes and a ``Hardware``;
- ``parts.py``: the scheduler, block manager and pools, sized and wired as the engine's;
- ``simulator.py``: the engine's loop on a simulated clock;
- ``scenario.py``: what to simulate, and one run per policy;
- ``command.py``: the command line; ``plots.py``: gain maps.
"""
