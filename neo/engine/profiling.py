"""``neo profile``: build an engine of an offloading policy and write its perf-model table."""

import os

from neo.config import EngineConfig

from .engine import LLMEngine


def profile_to_file(config: EngineConfig, path: str | None) -> str:
    """Measure this machine's stage times for ``config`` (gpu-only is profiled as neo, which
    needs the table) and write the table to ``path`` (None: the per-user cache); returns the
    path."""
    policy = "neo" if config.policy == "gpu-only" else config.policy
    engine = LLMEngine(EngineConfig(**{**config.__dict__, "perf_model": "zero", "policy": policy}))
    try:
        table = engine.profiler.run()
        path = path or engine.profiler.default_path()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        table.save(path)
    finally:
        engine.close()
    return path
