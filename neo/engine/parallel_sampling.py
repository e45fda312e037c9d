"""Parallel sampling (``SamplingParams.n > 1``): one request fanned out into ``n`` child
requests, their outputs gathered under the parent's id (after vLLM v1's ``ParentRequest``).

The engine queues ``n`` independent requests of the same prompt; child ``i`` has id
``"{i}_{parent id}"``, ``n = 1`` and, when the parent has a seed, seed ``seed + i`` (modulo
2**64, which ``torch.Generator.manual_seed`` reads as the same seed), so completions differ and
each is reproducible. Callers see the parent only: ``LLMEngine.step`` returns one
``RequestOutput`` per parent that got tokens, holding the latest state of every child as
``outputs[i]`` (``CompletionOutput.index = i``), finished once all children are; aborting the
parent aborts its children. When a child's work fails, its siblings are aborted and the parent
finishes with that child's error (``RequestOutput.error``; the child's finish reason "error").
"""

import dataclasses

from neo.outputs import CompletionOutput, RequestMetrics, RequestOutput
from neo.request import Request
from neo.sampling_params import SamplingParams

SEED_MODULUS = 2**64


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of child ``index``: one completion, its own seed."""
    seed = None if params.seed is None else (params.seed + index) % SEED_MODULUS
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """The ``n`` children of one request and the latest output of each."""

    def __init__(self, request_id: str, children: list[Request]):
        self.request_id = request_id
        self.children = children
        first = children[0]
        self.prompt = first.prompt
        self.prompt_token_ids = first.prompt_token_ids
        logprobs = first.sampling_params.logprobs is not None
        self.completions = [CompletionOutput(index, [], logprobs=[] if logprobs else None,
                                             cumulative_logprob=0.0 if logprobs else None)
                            for index in range(len(children))]
        self.error: str | None = None

    @property
    def finished(self) -> bool:
        return all(child.is_finished for child in self.children)

    def update(self, index: int, output: RequestOutput) -> None:
        """Take child ``index``'s newest output (and its error, the first one only)."""
        completion = output.outputs[0]
        completion.index = index
        self.completions[index] = completion
        if output.error is not None and self.error is None:
            self.error = output.error

    def output(self) -> RequestOutput:
        """The parent's state: every child's latest completion, in index order; metrics once
        all children have finished (first token: the earliest child's; finish: the last's)."""
        finished = self.finished
        output = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, list(self.completions),
                               finished, error=self.error)
        if finished:
            first_tokens = [child.first_token_time for child in self.children if child.first_token_time is not None]
            finish_times = [child.finish_time for child in self.children if child.finish_time is not None]
            output.metrics = RequestMetrics(self.children[0].arrival_time, min(first_tokens, default=None),
                                            max(finish_times, default=None),
                                            sum(child.num_preemptions for child in self.children))
        return output
