"""``TokenLogprobs``: the log-probabilities of a batch's sampled tokens and of the most likely
tokens, for the requests that ask (``SamplingParams.logprobs``).

They are taken, on the logits' device, from the model's raw distribution: log_softmax of the
logits before penalties, temperature, top-k and top-p (vLLM's default). A token's rank is the
number of tokens at least as likely as it (1 = the most likely); the top tokens are ranked by
their place in the top-k.
"""

from dataclasses import dataclass

import torch

from neo.outputs import Logprob
from neo.request import Request


@dataclass
class TokenLogprobs:
    """For the ``R`` rows of a batch whose requests ask, on the logits' device until ``record``:
    ``rows`` int64 ``[R]`` (their rows in the batch), ``token_ids`` int64 ``[R, 1 + k]`` (the
    sampled token, then the top ``k``, k = the largest ``logprobs`` asked), ``logprobs`` float32
    ``[R, 1 + k]``, ``sampled_ranks`` int64 ``[R]``."""

    rows: list[int]
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    sampled_ranks: torch.Tensor

    @classmethod
    def compute(cls, logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request]) -> "TokenLogprobs | None":
        """``logits`` float32 ``[N, vocab]`` (raw), ``tokens`` int64 ``[N]`` sampled from them ->
        the log-probabilities the requests ask for; None when none asks (nothing is computed)."""
        rows = [row for row, request in enumerate(requests) if request.sampling_params.logprobs is not None]
        if not rows:
            return None
        top = max(requests[row].sampling_params.logprobs for row in rows)
        index = torch.tensor(rows).to(logits.device, non_blocking=True)
        logprobs = logits[index].float().log_softmax(dim=-1)
        sampled = tokens[index].unsqueeze(1)
        sampled_logprobs = logprobs.gather(1, sampled)
        sampled_ranks = (logprobs >= sampled_logprobs).sum(dim=-1)
        top_logprobs, top_ids = logprobs.topk(top, dim=-1)
        return cls(rows, torch.cat([sampled, top_ids], dim=1), torch.cat([sampled_logprobs, top_logprobs], dim=1),
                   sampled_ranks)

    def record(self, requests: list[Request]) -> None:
        """Append each asking request's entry for its newest token (``Request.add_logprobs``);
        ``requests``: the batch's, in row order. Waits for the device."""
        token_ids, logprobs, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.sampled_ranks.tolist()
        for position, row in enumerate(self.rows):
            request = requests[row]
            count = request.sampling_params.logprobs
            ids, values = token_ids[position], logprobs[position]
            entry = {ids[0]: Logprob(values[0], ranks[position])}
            for rank in range(1, count + 1):
                entry[ids[rank]] = Logprob(values[rank], rank)
            request.add_logprobs(entry, values[0])
