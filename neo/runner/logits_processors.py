"""Edits of a batch's logits before sampling: repetition, presence and frequency penalties, and
the ``min_tokens`` mask. Each is built only for the rows that ask, so a batch where no request
asks gets its logits back untouched, with no extra work on the device.

The penalties follow Hugging Face / vLLM (repetition, over the prompt and the output) and OpenAI
(presence and frequency, over the output only)::

    logit = logit / repetition_penalty   where the token was seen and logit > 0
    logit = logit * repetition_penalty   where the token was seen and logit <= 0
    logit -= presence_penalty * (count > 0) + frequency_penalty * count

where ``count`` is how many times the token was generated so far. Before ``min_tokens`` tokens
are generated, the tokens that would end the request (``Request.min_tokens_stop_ids``) get
logit -inf, so they cannot be sampled.
"""

import torch
from torch.nn.utils.rnn import pad_sequence

from neo.request import Request


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """float32 ``[N, vocab]`` logits of ``requests`` (one row each) -> the logits to sample from:
    ``logits`` itself when no request uses a penalty or is short of its ``min_tokens``, else a
    new tensor (``logits`` is left as it is: log-probabilities are taken from it)."""
    if not any(request.adjusts_logits for request in requests):
        return logits
    penalized, masked = [], []
    for row, request in enumerate(requests):
        params = request.sampling_params
        if params.uses_penalties:
            penalized.append(row)
        if request.num_output_tokens < params.min_tokens and request.min_tokens_stop_ids:
            masked.append(row)
    if not penalized and not masked:  # every min_tokens reached
        return logits
    logits = logits.clone()
    if penalized:
        rows = torch.tensor(penalized, device=logits.device)
        logits[rows] = apply_penalties(logits[rows], [requests[row] for row in penalized])
    if masked:
        mask_stop_tokens(logits, masked, [requests[row] for row in masked])
    return logits


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """float32 ``[R, vocab]`` logits of ``requests`` -> penalized logits (a new tensor)."""
    device = logits.device
    vocab = logits.shape[1]
    params = [request.sampling_params for request in requests]
    if any(p.repetition_penalty != 1 for p in params):
        seen = token_mask([request.all_token_ids for request in requests], vocab, device)
        penalty = _column([p.repetition_penalty for p in params], device)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
        counts = token_counts([request.output_token_ids for request in requests], vocab, device)
        presence = _column([p.presence_penalty for p in params], device)
        frequency = _column([p.frequency_penalty for p in params], device)
        logits = logits - presence * (counts > 0) - frequency * counts
    return logits


def mask_stop_tokens(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
    """Set ``logits[row, id] = -inf`` (in place) for each of ``rows`` and each id of its
    request's ``min_tokens_stop_ids`` inside the vocabulary."""
    vocab = logits.shape[1]
    row_index, column_index = [], []
    for row, request in zip(rows, requests):
        columns = [token for token in request.min_tokens_stop_ids if token < vocab]
        row_index += [row] * len(columns)
        column_index += columns
    if column_index:
        index = torch.tensor([row_index, column_index]).to(logits.device, non_blocking=True)
        logits[index[0], index[1]] = float("-inf")


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """float32 ``[len(token_lists), vocab]``: how many times each token occurs in each list."""
    padded = _padded(token_lists, vocab, device)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def token_mask(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """bool ``[len(token_lists), vocab]``: whether each token occurs in each list."""
    padded = _padded(token_lists, vocab, device)
    mask = torch.zeros(len(token_lists), vocab + 1, dtype=torch.bool, device=device)
    mask.scatter_(1, padded, True)
    return mask[:, :vocab]


def _padded(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """int64 ``[len(token_lists), longest]`` on ``device``, padded with ``vocab`` (a column past
    the vocabulary, dropped by the callers)."""
    rows = [torch.tensor(tokens, dtype=torch.int64) for tokens in token_lists]
    empty = torch.full((1,), vocab, dtype=torch.int64)  # an empty list still needs a column
    padded = pad_sequence([row if len(row) else empty for row in rows], batch_first=True, padding_value=vocab)
    return padded.to(device, non_blocking=True)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """float32 ``[len(values), 1]`` on ``device``."""
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True).unsqueeze(1)
