"""``SamplingParams``: how one request's tokens are chosen and when it stops."""

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling settings, validated on creation.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1 disables nucleus
    sampling. ``seed`` makes one request's sampling reproducible whatever else is batched with it.
    Generation stops after ``max_tokens`` tokens, at an EOS token (unless ``ignore_eos``), at any
    of ``stop_token_ids``, when the text ends with one of ``stop`` (needs a tokenizer; the stop
    string is cut from the text), or at the model's length limit.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got "
                             f"{self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(token, int) or token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got "
                             f"{self.stop_token_ids!r}")
        if any(not isinstance(text, str) or not text for text in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1
