"""``StopRule``: why a request ends after a sampled token (the scheduler asks it in ``update``)."""

from neo.incremental_text import IncrementalText
from neo.request import Request


class StopRule:
    """End-of-sequence tokens (unless ``ignore_eos``), the request's stop token ids and stop
    strings, its ``max_tokens``, and the model's context length.

    Before ``min_tokens`` tokens are generated only the length limits end a request (as in
    vLLM): end-of-sequence and stop tokens do not, and the sampler keeps them from being sampled
    (``stop_ids_before_min_tokens``); stop strings count only in text added after the
    ``min_tokens``-th token (the search window still moves along with every token, so a stop
    string wholly inside the first ``min_tokens`` tokens' text is never found later).

    Stop strings are searched for incrementally: the request keeps an ``IncrementalText`` of its
    output, and each token's search covers only the text it added plus the characters before it
    that a stop string could still end past (one fewer than the longest stop string has). A
    stop string that ends in the older text would have stopped the request at an earlier token,
    so this finds what searching the whole text finds: the request stops at the first token
    whose text holds a stop string, and its text is cut where the first one starts.
    """

    def __init__(self, eos_token_ids: frozenset[int], tokenizer, max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # Decoding skips special tokens, so the incremental text leaves them out.
        self.special_token_ids = frozenset() if tokenizer is None else frozenset(
            token_id for token_id, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special)

    def stop_ids_before_min_tokens(self, request: Request) -> frozenset[int]:
        """The token ids that would end ``request``: kept from being sampled before its
        ``min_tokens`` (empty when it has none)."""
        if request.sampling_params.min_tokens == 0:
            return frozenset()
        eos = frozenset() if request.sampling_params.ignore_eos else self.eos_token_ids
        return eos | request.stop_token_ids

    def __call__(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in request.stop_token_ids:
                return "stop"
        if (params.stop and self.tokenizer is not None
                and self._cut_at_stop_string(request, counts=request.num_output_tokens > params.min_tokens)):
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _cut_at_stop_string(self, request: Request, counts: bool) -> bool:
        """Search the text the newest token added; a stop string found there ends the request
        only when it ``counts``."""
        stops = request.sampling_params.stop
        if request.incremental_text is None:
            longest = max(len(stop) for stop in stops)
            request.incremental_text = IncrementalText(self.tokenizer, longest - 1, self.special_token_ids)
        text = request.incremental_text
        start, recent = text.update(request.output_token_ids)
        positions = [recent.find(stop) for stop in stops]
        found = [position for position in positions if position >= 0]
        if not found or not counts:
            return False
        request.output_text = text.text[:start + min(found)]
        return True
