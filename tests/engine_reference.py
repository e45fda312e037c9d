"""What the engine tests compare against: neo-tiny in transformers, and small pool sizes.

Greedy continuations come from recomputing transformers' logits over the whole sequence at
every step (no KV cache), which is slow but leaves nothing shared with the engine.
"""

import torch
from transformers import AutoModelForCausalLM

from neo.models.tiny import save_tiny

NEW_TOKENS = 32
BLOCK_BYTES = 2 * 4 * 2 * 16 * 32 * 4  # neo-tiny float32: K+V, 4 layers, 2 KV heads, 16 x 32
PROMPTS = [[257, 72, 101, 108, 108, 111], [257] + list(range(60, 97)), [257], list(range(40, 80)) * 2,
           [257, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48]]


def gib_for_blocks(blocks: int, bytes_per_block: int = BLOCK_BYTES) -> float:
    """A pool size in GiB that holds exactly ``blocks`` neo-tiny blocks of 16 tokens."""
    return blocks * bytes_per_block / 2**30


def transformers_tiny(directory: str):
    save_tiny(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@torch.inference_mode()
def greedy_continuations(model, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    results = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        results.append(tokens[len(prompt):])
    return results
