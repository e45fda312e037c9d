"""The engine loop and its wiring: ``LLMEngine`` (schedule -> execute -> update) and the
composition root that builds the scheduler, the runner and the KV pools for a policy."""

from .engine import LLMEngine

__all__ = ["LLMEngine"]
