"""``Sampler``: picks one token per row of logits according to each request's parameters."""

import torch

from neo.sampling_params import SamplingParams


class Sampler:
    """Greedy, temperature, top-k and top-p sampling over a batch.

    ``SamplingParams`` guarantees the ranges that make every row well defined (temperature 0 or
    at least ``MIN_TEMPERATURE`` and finite in float32, top_p in (0, 1], top_k within int64, cut
    to the vocabulary here), so one request's values cannot fail or poison the batch.

    Random rows use the exponential-race form of sampling (``argmax(p / E)`` with
    ``E ~ Exponential(1)``), which equals drawing from ``p``; a request with a seed draws its
    noise from its own generator, so its tokens do not depend on what it is batched with.
    """

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits float32 ``[N, vocab]`` -> int64 ``[N]`` token ids (on the logits' device)."""
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_tokens
        device = logits.device
        temperatures = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                                    dtype=torch.float32).to(device, non_blocking=True)
        scaled = logits / temperatures.unsqueeze(1)
        if any(p.uses_top_k or p.uses_top_p for p in params):
            scaled = self._apply_top_k_top_p(scaled, params)
        probabilities = scaled.softmax(dim=-1)
        noise = self._exponential_noise(probabilities, params, generators)
        sampled = (probabilities / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params]).to(device, non_blocking=True)
        return torch.where(is_greedy, greedy_tokens, sampled)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        vocab = logits.shape[1]
        device = logits.device
        top_k = torch.tensor([min(p.top_k, vocab) if p.uses_top_k else vocab for p in params])
        top_k = top_k.to(device, non_blocking=True)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device, non_blocking=True)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        outside_k = ranks >= top_k.unsqueeze(1)
        sorted_probabilities = sorted_logits.masked_fill(outside_k, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities
        # The top token stays even where float32 rounds a tiny top_p to 0.
        outside_p = (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(outside_k | outside_p, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    @staticmethod
    def _exponential_noise(probabilities: torch.Tensor, params: list[SamplingParams],
                           generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probabilities).exponential_()
        for row, (p, generator) in enumerate(zip(params, generators)):
            if generator is not None and not p.greedy:
                seeded = torch.empty(probabilities.shape[1], dtype=probabilities.dtype)
                noise[row] = seeded.exponential_(generator=generator).to(noise.device, non_blocking=True)
        return noise
