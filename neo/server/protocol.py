"""The OpenAI-compatible request bodies, and the JSON bodies of responses and errors.

Request fields are typed strictly and unknown fields are rejected; value checks are left to
``SamplingParams`` so each rule has one home. Extensions to OpenAI's API: ``top_k``,
``ignore_eos``, ``stop_token_ids`` and ``return_token_ids`` (each choice and stream chunk then
carries the new token ids as ``token_ids``, useful for models without a tokenizer).
"""

import time

from pydantic import BaseModel, ConfigDict, ValidationError

from neo.sampling_params import SamplingParams


class ProtocolError(ValueError):
    """A request the server cannot serve: ``status`` (a 4xx), ``param`` (the offending field)
    and ``code`` go into the error response."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None
    # Accepted only with the value that turns them off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def _unsupported(self) -> dict[str, object]:
        """Fields that must keep their "off" value: ``{name: off value}``."""
        return {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None}

    def check(self) -> None:
        """Reject what this server does not do, with the field named."""
        for name, off in self._unsupported().items():
            value = getattr(self, name)
            if value != off and not (off is None and not value):
                raise ProtocolError(f"'{name}' is not supported by this server (got {value!r})", name)
        if self.n != 1:
            raise ProtocolError(f"n must be 1: this server returns one completion per request "
                                f"(got {self.n})", "n")
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true",
                                "stream_options")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's settings; raises ``ProtocolError`` with ``SamplingParams``' message and
        the field it refuses."""
        max_tokens = self.requested_max_tokens()
        values = dict(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                      temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                      seed=self.seed, stop_token_ids=list(self.stop_token_ids or []),
                      stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                      ignore_eos=self.ignore_eos)
        try:
            return SamplingParams(**values)
        except ValueError as error:
            raise ProtocolError(str(error), self._refused_field(values)) from None

    def _refused_field(self, values: dict) -> str | None:
        """The request field of the first value ``SamplingParams`` refuses on its own (None
        when only a combination is refused)."""
        for name, value in values.items():
            try:
                SamplingParams(**{name: value})
            except ValueError:
                return self.max_tokens_field() if name == "max_tokens" else name
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The name of the field that set ``requested_max_tokens``."""
        return "max_tokens"

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list holding
    exactly one of those."""

    prompt: str | list
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def _unsupported(self) -> dict[str, object]:
        return super()._unsupported() | {"echo": False, "suffix": None, "logprobs": None}

    def check(self) -> None:
        super().check()
        if self.best_of not in (None, 1):
            raise ProtocolError(f"best_of must be 1 (got {self.best_of})", "best_of")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids (the engine checks the ids' range)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ProtocolError(f"a request holds one prompt; got a batch of {len(prompt)}: "
                                    f"send one request per prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ProtocolError("the prompt is empty", "prompt")
            return prompt
        if not all(isinstance(token, int) and not isinstance(token, bool) for token in prompt):
            raise ProtocolError("prompt must be a string, a list of integer token ids, or a list "
                                "holding one of those", "prompt")
        return prompt


class TextPart(_Strict):
    type: str
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        """``{"role", "content"}`` for the chat template; text parts are joined."""
        content = self.content
        if isinstance(content, list):
            kinds = sorted({part.type for part in content} - {"text"})
            if kinds:
                raise ProtocolError(f"only text message content is supported (got "
                                    f"{', '.join(kinds)})", "messages")
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def _unsupported(self) -> dict[str, object]:
        return super()._unsupported() | {"logprobs": None, "top_logprobs": None}

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise ProtocolError("messages must hold at least one message", "messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ProtocolError("give max_tokens or max_completion_tokens, not both",
                                "max_completion_tokens")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_tokens is None else "max_tokens"


def parse_request(model: type[_SamplingFields], body: object) -> _SamplingFields:
    """Validate a decoded JSON body; raises ``ProtocolError`` naming the fields."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        problems = []
        fields = []
        for problem in error.errors():
            field = _field_path(body, problem["loc"], missing=problem["type"] == "missing")
            fields.append(field)
            if problem["type"] == "extra_forbidden":
                problems.append(f"unknown field '{field}'")
            elif problem["type"] == "missing":
                problems.append(f"missing field '{field}'")
            else:
                problems.append(f"field '{field}': {problem['msg']}")
        raise ProtocolError("; ".join(dict.fromkeys(problems)), fields[0]) from None
    request.check()
    return request


def _field_path(body: dict, location: tuple, missing: bool) -> str:
    """The dotted path of the field a validation error is about (``messages.0.content``):
    pydantic's location with the names of union members it tried (``str``, ``list[int]``)
    left out, found by following the location through the body (``missing``: the last part
    names a field the body lacks)."""
    parts = []
    value = body
    for index, part in enumerate(location):
        if isinstance(value, dict) and (part in value or missing and index == len(location) - 1):
            parts.append(part)
            value = value.get(part)
        elif isinstance(value, list) and isinstance(part, int) and part < len(value):
            parts.append(str(part))
            value = value[part]
    return ".".join(parts)


# -- responses -----------------------------------------------------------------------------------


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
    """Builds the JSON bodies of one completion or chat completion.

    chat: chat completion shapes (``message``/``delta``) instead of ``text``.
    return_token_ids: add ``token_ids`` to each choice.
    """

    def __init__(self, request_id: str, model: str, chat: bool, return_token_ids: bool):
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.return_token_ids = return_token_ids
        self.created = int(time.time())

    def _envelope(self, kind: str) -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}

    def response(self, text: str, token_ids: list[int], finish_reason: str | None,
                 usage_counts: dict) -> dict:
        """The body of a non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return body | {"choices": [choice], "usage": usage_counts}

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None,
              include_usage: bool, first: bool = False) -> dict:
        """One stream chunk carrying new text/tokens; ``first`` adds the chat role."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_counts: dict) -> dict:
        """The last chunk when the client asked for usage: no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(kind) | {"choices": [], "usage": usage_counts}
