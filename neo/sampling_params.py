"""``SamplingParams``: how one request's tokens are chosen and when it stops.

Every value is checked here, when the request is made: the sampler turns a batch's values into
tensors and the request's generator is seeded from ``seed``, so a value that could fail or give
NaN there would end every request of its iteration instead of being refused alone.
"""

import numbers
import reprlib
from dataclasses import dataclass, field

# The smallest sampling temperature above 0 (0 is greedy). Logits divided by it stay finite in
# float32 for any logit below 3.4e36 in magnitude, so softmax is well defined; a distribution
# sharper than this one is greedy in all but near-ties, and temperature 0 asks for greedy.
MIN_TEMPERATURE = 1e-2
# The largest float32: temperatures and top_p become float32 tensors in the sampler.
FLOAT32_MAX = 3.4028234663852886e38
# torch.Generator.manual_seed takes any seed in [-2**63, 2**64 - 1]; a negative seed stands for
# its two's complement (seed + 2**64), so -1 and 2**64 - 1 draw the same numbers.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# top_k and stop token ids must fit in int64.
INT64_MAX = 2**63 - 1
# Stop strings are searched for after every token, over the text the token added plus the
# previous (longest stop string - 1) characters: the work per token grows with the number of
# stop strings times the longest one, so both are bounded. OpenAI takes at most 4 stop strings;
# 64 covers any chat template's end markers with room to spare, and 256 characters any marker
# or sentence a client stops on.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LENGTH = 256
# Stop token ids are looked up in a set, so their number costs memory and admission time only;
# 1024 is four times the 256 special tokens Llama 3 reserves.
MAX_STOP_TOKEN_IDS = 1024
# Completions per prompt: each is a request of its own in the engine, so ``n`` multiplies the
# work of one call; 128 is the most OpenAI's API takes.
MAX_N = 128
# Top log-probabilities returned per token: OpenAI's ``top_logprobs`` takes at most 20, as does
# vLLM by default.
MAX_LOGPROBS = 20
# repetition_penalty divides positive logits and multiplies negative ones, before the
# temperature divides them again: within [1/100, 100] a logit below 3.4e34 in magnitude stays
# finite in float32 through both (the same reasoning as ``MIN_TEMPERATURE``).
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
# presence_penalty and frequency_penalty: OpenAI's range.
MAX_ABS_PRESENCE_FREQUENCY_PENALTY = 2.0

# Shows a value in an error message, long numbers, strings and lists shortened.
_shown = reprlib.Repr()
_shown.maxlong = _shown.maxstring = _shown.maxother = 60


@dataclass
class SamplingParams:
    """Sampling settings, validated on creation (a bad value raises ``ValueError`` naming the
    field, its bound and the value; ``bool`` is not accepted where a number is expected).

    - ``max_tokens``: an integer >= 1; generation also ends at the model's length limit.
    - ``temperature``: 0 means greedy; otherwise at least ``MIN_TEMPERATURE`` (0.01) and at most
      the largest float32. Integers are taken as floats.
    - ``top_k``: -1 or 0 disables top-k; otherwise an integer in [1, 2**63 - 1], and any value
      at or above the vocabulary size keeps every token.
    - ``top_p``: in (0, 1]; 1 disables nucleus sampling. The most likely token is always kept,
      so a top_p too small for float32 (which rounds it to 0) samples greedily.
    - ``seed``: None, or an integer in [``MIN_SEED``, ``MAX_SEED``] = [-2**63, 2**64 - 1], the
      range ``torch.Generator.manual_seed`` takes. It makes one request's sampling reproducible
      whatever else is batched with it.
    - ``stop_token_ids``: at most ``MAX_STOP_TOKEN_IDS`` (1024) ids, each in [0, 2**63 - 1].
    - ``stop``: a string or at most ``MAX_STOP_STRINGS`` (64) non-empty strings of at most
      ``MAX_STOP_STRING_LENGTH`` (256) characters. Generation stops when the text holds one
      (needs a tokenizer); the text is cut where the first one starts.
    - ``ignore_eos``: keep going past end-of-sequence tokens.
    - ``n``: completions of the prompt, an integer in [1, ``MAX_N``] (128); each is sampled
      independently (with a seed, completion ``i`` uses ``seed + i``) and all come back in
      one ``RequestOutput``.
    - ``logprobs``: None, or an integer in [0, ``MAX_LOGPROBS``] (20): each generated token
      comes with its own log-probability and those of the ``logprobs`` most likely tokens,
      taken from the model's raw distribution (log_softmax of the logits before penalties,
      temperature, top-k and top-p).
    - ``min_tokens``: an integer in [0, ``max_tokens``]; before that many tokens are generated,
      end-of-sequence tokens and ``stop_token_ids`` are never sampled and stop strings are not
      searched for.
    - ``repetition_penalty``: in [``MIN_REPETITION_PENALTY``, ``MAX_REPETITION_PENALTY``] =
      [0.01, 100], 1 disables it. The logit of each token in the prompt or the output so far is
      divided by it where positive and multiplied by it where negative.
    - ``presence_penalty``, ``frequency_penalty``: in [-2, 2], 0 disables them. Each token
      generated so far has its logit lowered by ``presence_penalty`` once and by
      ``frequency_penalty`` per time it was generated.

    The penalties act on the logits before the temperature, top-k, top-p and greedy choice.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        self.max_tokens = _checked_max_tokens(self.max_tokens)
        self.temperature = _checked_temperature(self.temperature)
        self.top_k = _checked_top_k(self.top_k)
        self.top_p = _checked_top_p(self.top_p)
        self.seed = _checked_seed(self.seed)
        self.stop_token_ids = _checked_stop_token_ids(self.stop_token_ids)
        self.stop = _checked_stop(self.stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {_shown.repr(self.ignore_eos)}")
        self.n = _checked_n(self.n)
        self.logprobs = _checked_logprobs(self.logprobs)
        self.min_tokens = _checked_min_tokens(self.min_tokens, self.max_tokens)
        self.repetition_penalty = _checked_repetition_penalty(self.repetition_penalty)
        self.presence_penalty = _checked_presence_frequency("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _checked_presence_frequency("frequency_penalty", self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    @property
    def uses_top_p(self) -> bool:
        return self.top_p < 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _checked_max_tokens(max_tokens) -> int:
    if not _is_integer(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {_shown.repr(max_tokens)}")
    return int(max_tokens)


def _checked_temperature(temperature) -> float:
    if not _is_real(temperature) or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= FLOAT32_MAX):
        raise ValueError(f"temperature must be >= 0: 0 for greedy, otherwise a number in "
                         f"[{MIN_TEMPERATURE}, {FLOAT32_MAX}] (finite in float32), got "
                         f"{_shown.repr(temperature)}")
    return float(temperature)


def _checked_top_k(top_k) -> int:
    if not _is_integer(top_k) or not -1 <= top_k <= INT64_MAX:
        raise ValueError(f"top_k must be -1, 0 (disabled) or an integer in [1, 2**63 - 1] (a top_k "
                         f"at or above the vocabulary size keeps every token), got {_shown.repr(top_k)}")
    return int(top_k)


def _checked_top_p(top_p) -> float:
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {_shown.repr(top_p)}")
    return float(top_p)


def _checked_seed(seed) -> int | None:
    if seed is not None and (not _is_integer(seed) or not MIN_SEED <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1] (the range "
                         f"torch.Generator.manual_seed takes) or None, got {_shown.repr(seed)}")
    return None if seed is None else int(seed)


def _checked_stop_token_ids(token_ids) -> list[int]:
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"stop_token_ids must be a list of integers, got {_shown.repr(token_ids)}")
    if len(token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids holds {len(token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                         f"are allowed")
    bad = next((token for token in token_ids if not _is_integer(token) or not 0 <= token <= INT64_MAX), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids must be non-negative integers below 2**63, got {_shown.repr(bad)}")
    return [int(token) for token in token_ids]


def _checked_stop(stop) -> list[str]:
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {_shown.repr(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    bad = next((text for text in stop if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_STRING_LENGTH),
               None)
    if bad is not None:
        length = f" (of {len(bad)} characters)" if isinstance(bad, str) and bad else ""
        raise ValueError(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_LENGTH} "
                         f"characters, got {_shown.repr(bad)}{length}")
    return list(stop)


def _checked_n(n) -> int:
    if not _is_integer(n) or not 1 <= n <= MAX_N:
        raise ValueError(f"n must be an integer in [1, {MAX_N}], got {_shown.repr(n)}")
    return int(n)


def _checked_logprobs(logprobs) -> int | None:
    if logprobs is not None and (not _is_integer(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
                         f"{_shown.repr(logprobs)}")
    return None if logprobs is None else int(logprobs)


def _checked_min_tokens(min_tokens, max_tokens: int) -> int:
    if not _is_integer(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise ValueError(f"min_tokens must be an integer in [0, max_tokens={max_tokens}], got "
                         f"{_shown.repr(min_tokens)}")
    return int(min_tokens)


def _checked_repetition_penalty(penalty) -> float:
    if not _is_real(penalty) or not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:
        raise ValueError(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, "
                         f"{MAX_REPETITION_PENALTY}] (1 disables it), got {_shown.repr(penalty)}")
    return float(penalty)


def _checked_presence_frequency(name: str, penalty) -> float:
    bound = MAX_ABS_PRESENCE_FREQUENCY_PENALTY
    if not _is_real(penalty) or not -bound <= penalty <= bound:
        raise ValueError(f"{name} must be a number in [{-bound}, {bound}] (0 disables it), got "
                         f"{_shown.repr(penalty)}")
    return float(penalty)
