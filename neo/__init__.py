"""neo: an LLM serving engine that offloads part of the decode attention and its KV cache to
the host CPU so a memory-bound GPU can run larger batches."""

from . import ops  # noqa: F401  (declares torch.ops.neo)
