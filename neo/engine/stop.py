"""``StopRule``: why a request ends after a sampled token (the scheduler asks it in ``update``)."""

from neo.request import Request


class StopRule:
    """End-of-sequence tokens (unless ``ignore_eos``), the request's stop token ids and stop
    strings, its ``max_tokens``, and the model's context length."""

    def __init__(self, eos_token_ids: frozenset[int], tokenizer, max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def __call__(self, request: Request, token: int) -> str | None:
        params = request.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self.tokenizer is not None and self._cut_at_stop_string(request):
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _cut_at_stop_string(self, request: Request) -> bool:
        text = self.tokenizer.decode(request.output_token_ids)
        positions = [text.find(stop) for stop in request.sampling_params.stop]
        found = [position for position in positions if position >= 0]
        if not found:
            return False
        request.output_text = text[:min(found)]
        return True
