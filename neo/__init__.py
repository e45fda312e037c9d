"""neo: an LLM serving engine that offloads part of the decode attention and its KV cache to
the host CPU so a memory-bound GPU can run larger batches."""

from . import ops  # noqa: F401  (declares torch.ops.neo)
from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM, GenerationError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "GenerationError", "EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
           "Logprob"]
