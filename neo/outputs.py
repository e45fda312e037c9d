"""What the engine hands back: ``RequestOutput`` with one ``CompletionOutput`` per completion
(``SamplingParams.n`` of them), each with its tokens' ``Logprob``s when asked for."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """A token's log-probability under the model's raw distribution (log_softmax of the logits
    before penalties, temperature, top-k and top-p), its rank in that distribution (1 = the most
    likely; tokens as likely as it count as ahead of it) and its text (set once the request has
    finished, with a tokenizer)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion. ``logprobs``: one dict per generated token when ``SamplingParams.logprobs``
    is set, mapping token id -> ``Logprob`` for the sampled token and the ``logprobs`` most likely
    ones (None otherwise); ``cumulative_logprob``: the sum of the sampled tokens' log-probabilities
    (None without ``logprobs``)."""

    index: int  # which of the request's ``n`` completions, from 0
    token_ids: list[int]
    text: str = ""  # filled in once the request has finished (with a tokenizer)
    finish_reason: str | None = None  # "stop", "length", "abort", "error", or None while running
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """A request's state: ``outputs`` holds its completions in index order (one per
    ``SamplingParams.n``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the engine ended it, when its finish reason is "error"
