"""What the engine hands back: ``RequestOutput`` with one ``CompletionOutput``."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""  # filled in once the request has finished (with a tokenizer)
    finish_reason: str | None = None  # "stop", "length", "abort", "error", or None while running


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the engine ended it, when its finish reason is "error"
