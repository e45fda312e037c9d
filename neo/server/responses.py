"""The JSON bodies the server answers with: OpenAI's error shape, usage, model cards, and the
completion and chat completion bodies (whole and streamed).

A response holds one choice per completion the engine returns: a request's prompts in order,
each prompt's completions in the order of their ``CompletionOutput.index``, so choice
``index`` = prompt position * completions per prompt + completion index.
"""

import time


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "neo",
            "max_model_len": max_model_len}


class ResponseShape:
    """Builds the JSON bodies of one completion or chat completion request.

    chat: chat completion shapes (``message``/``delta``) instead of ``text``.
    return_token_ids: add ``token_ids`` to each choice.
    """

    def __init__(self, request_id: str, model: str, chat: bool, return_token_ids: bool):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.return_token_ids = return_token_ids
        self.created = int(time.time())

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, kind: str) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
        """One choice of a whole (non-streamed) response; ``logprobs``: its tokens'
        log-probabilities in the endpoint's shape (``logprobs.py``), or None."""
        if self.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def response(self, choices: list[dict], usage_counts: dict) -> dict:
        """The body of a non-streamed response."""
        return self._envelope(self.kind) | {"choices": choices, "usage": usage_counts}

    def chunk(self, index: int, text: str, token_ids: list[int], finish_reason: str | None,
              include_usage: bool, first: bool = False, logprobs: dict | None = None) -> dict:
        """One stream chunk carrying new text/tokens of choice ``index``; ``first`` (the
        choice's first chunk) adds the chat role; ``logprobs``: the new tokens'
        log-probabilities, or None."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        body = self._envelope(self.chunk_kind) | {"choices": [choice]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_counts: dict) -> dict:
        """The last chunk when the client asked for usage: no choices."""
        return self._envelope(self.chunk_kind) | {"choices": [], "usage": usage_counts}
