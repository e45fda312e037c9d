"""``Request``: the only place per-request state lives."""

import enum
import time
from typing import TYPE_CHECKING

import torch

from .outputs import Logprob
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .incremental_text import IncrementalText


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not prefilled yet (or preempted by recomputation)
    RUNNING = "running"  # its KV is in the compute-device pool or the host pool
    SWAPPED = "swapped"  # preempted: its KV waits in the host pool to be swapped back
    FINISHED = "finished"


class KVLocation(enum.Enum):
    GPU = "gpu"  # compute-device pool (the CPU itself when there is no CUDA)
    HOST = "host"  # host pool, decoded by the host CPU


class Request:
    """One generation request: tokens, where its KV lives, its blocks, sampling, status."""

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, prompt: str | None = None,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_tokens = len(self.prompt_token_ids)  # prompt + output, kept by append_token
        self.sampling_params = sampling_params
        self.status = RequestStatus.WAITING
        self.location: KVLocation | None = None
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # tokens whose K/V is in the cache
        self.finish_reason: str | None = None
        self.output_text: str | None = None  # set when a stop string cut the text
        self.error: str | None = None  # why the engine ended it (finish reason "error")
        # The output decoded so far, kept by the stop rule (``neo.engine.stop``) when the
        # request has stop strings: each token decodes and searches only a short window.
        self.incremental_text: IncrementalText | None = None
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)  # one lookup per token
        # The tokens that would end the request, kept from being sampled before
        # ``min_tokens`` (end-of-sequence unless ``ignore_eos``, and ``stop_token_ids``); set
        # at admission by the engine, which knows the model's end-of-sequence tokens.
        self.min_tokens_stop_ids: frozenset[int] = frozenset()
        # Whether the sampler edits this request's logits (penalties, min_tokens): one flag, so
        # a batch where no request does is recognized in one pass.
        self.adjusts_logits = sampling_params.uses_penalties or sampling_params.min_tokens > 0
        # With ``logprobs``: one dict per output token (token id -> Logprob), and their sum.
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        self.last_scheduled_iteration = 0  # the scheduler's fairness clock for host decodes
        # Seeded here, at admission: SamplingParams bounds the seed to what manual_seed takes.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.num_tokens += 1

    def add_logprobs(self, entry: dict[int, Logprob], sampled_logprob: float) -> None:
        """The log-probabilities of the token about to be appended (the runner records them
        when it samples the token)."""
        self.output_logprobs.append(entry)
        self.cumulative_logprob += sampled_logprob

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilled(self) -> bool:
        return self.num_cached_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens="
                f"{self.num_prompt_tokens}+{self.num_output_tokens}, location="
                f"{self.location.value if self.location else None})")
