"""The OpenAI-compatible request bodies.

Each documented OpenAI request field falls in one of three groups:

- served: the fields the engine acts on (``max_tokens``, ``temperature``, ``stop``, ...);
- accepted and ignored: fields that do not change the output (``metadata``, ``store``,
  ``service_tier``, ``user``, ``parallel_tool_calls``, ``prediction``, ...); their types are
  still checked;
- refused unless off: fields that would change the output and that this server does not
  implement (``tools``, a JSON ``response_format``, ``logit_bias``, ``echo``, ``best_of``, ...):
  any value but the one that turns them off is a 400 naming the field (``OFF_VALUES``).

Served beyond the basics: ``n`` (completions per prompt), ``presence_penalty`` and
``frequency_penalty``, and log-probabilities: ``logprobs`` (an integer 0..20) on
``/v1/completions``, ``logprobs: true`` with ``top_logprobs`` (0..20) on
``/v1/chat/completions`` (``top_logprobs`` without ``logprobs: true`` is a 400).

A field this server does not know is ignored, as vLLM does (``unknown_fields`` lists them for
the server's log). Value checks are left to ``SamplingParams`` so each rule has one home.
Extensions to OpenAI's API (as vLLM names them): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``min_tokens``, ``repetition_penalty`` and ``return_token_ids`` (each choice and stream chunk then
carries the new token ids as ``token_ids``, useful for models without a tokenizer).

``/v1/completions`` takes a batch of prompts (a list of strings or of token id lists): each
prompt is its own engine request and its choices follow the prompt's position.
"""

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from neo.sampling_params import SamplingParams

# The most prompts one /v1/completions request may carry.
MAX_BATCH_PROMPTS = 256
# The characters of a refused value shown in its error message.
MAX_SHOWN_VALUE_CHARS = 80


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


def _is_none_or_empty(value) -> bool:
    return value is None or value == {} or value == [] or value == ""


def _is_none_or(*off_values) -> Callable[[object], bool]:
    return lambda value: value is None or any(value == off and type(value) is type(off)
                                              for off in off_values)


def _is_text_format(value) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "text")


def _is_text_only(value) -> bool:
    return value is None or (isinstance(value, list) and all(kind == "text" for kind in value))


# Fields that would change the output, by the test of their "off" value.
OFF_VALUES: dict[str, Callable[[object], bool]] = {
    "min_p": _is_none_or(0.0, 0),
    "logit_bias": _is_none_or_empty,
    "allowed_token_ids": lambda value: value is None,
    "bad_words": _is_none_or_empty,
    "include_stop_str_in_output": _is_none_or(False),
    "skip_special_tokens": _is_none_or(True),
    "guided_json": lambda value: value is None,
    "guided_regex": lambda value: value is None,
    "guided_choice": lambda value: value is None,
    "guided_grammar": lambda value: value is None,
    "structural_tag": lambda value: value is None,
    "logits_processors": _is_none_or_empty,
    "use_beam_search": _is_none_or(False),
    "spaces_between_special_tokens": _is_none_or(True),
    "response_format": _is_text_format,
    "prompt_logprobs": lambda value: value is None,
    "truncate_prompt_tokens": lambda value: value is None,
    # /v1/completions
    "echo": _is_none_or(False),
    "suffix": _is_none_or_empty,
    "best_of": _is_none_or(1),
    # /v1/chat/completions
    "tools": _is_none_or_empty,
    "tool_choice": _is_none_or("none", "auto"),  # "auto" without tools: no tool call
    "functions": _is_none_or_empty,
    "function_call": _is_none_or("none", "auto"),
    "add_generation_prompt": _is_none_or(True),
    "continue_final_message": _is_none_or(False),
    "chat_template": lambda value: value is None,
    "chat_template_kwargs": _is_none_or_empty,
    "documents": _is_none_or_empty,
    "modalities": _is_text_only,
    "audio": lambda value: value is None,
    "web_search_options": lambda value: value is None,
}


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    # Accepted and ignored: they do not change the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    request_id: str | None = None
    priority: int | None = None
    cache_salt: str | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    # Refused unless off (OFF_VALUES).
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    logits_processors: list | None = None
    use_beam_search: bool | None = None
    spaces_between_special_tokens: bool | None = None
    response_format: dict | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None

    def check(self) -> None:
        """Reject what this server does not do, with the field named."""
        for name, is_off in OFF_VALUES.items():
            if name in type(self).model_fields and not is_off(getattr(self, name)):
                shown = repr(getattr(self, name))
                if len(shown) > MAX_SHOWN_VALUE_CHARS:
                    shown = shown[:MAX_SHOWN_VALUE_CHARS] + "..."
                raise ProtocolError(f"'{name}' is not supported by this server (got {shown})",
                                    name)
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true",
                                "stream_options")

    @property
    def unknown_fields(self) -> list[str]:
        """The names of the request's fields this server does not know (and ignores)."""
        return list(self.model_extra or ())

    @property
    def completions_per_prompt(self) -> int:
        """Choices per prompt (``n``; None means 1, and 0 goes on to be refused)."""
        return 1 if self.n is None else self.n

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's settings; raises ``ProtocolError`` with ``SamplingParams``' message and
        the field it refuses."""
        max_tokens = self.requested_max_tokens()
        values = dict(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                      temperature=1.0 if self.temperature is None else self.temperature,
                      top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                      seed=self.seed, stop_token_ids=list(self.stop_token_ids or []),
                      stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                      ignore_eos=self.ignore_eos, n=self.completions_per_prompt,
                      logprobs=self.requested_logprobs(),
                      min_tokens=0 if self.min_tokens is None else self.min_tokens,
                      repetition_penalty=(1.0 if self.repetition_penalty is None
                                          else self.repetition_penalty),
                      presence_penalty=self.presence_penalty or 0.0,
                      frequency_penalty=self.frequency_penalty or 0.0)
        try:
            return SamplingParams(**values)
        except ValueError as error:
            field = self._refused_field(values)
            # Chat's top_logprobs sets SamplingParams.logprobs, which the message names.
            message = f"{field}: {error}" if field == "top_logprobs" else str(error)
            raise ProtocolError(message, field) from None

    def _refused_field(self, values: dict) -> str | None:
        """The request field of the first value ``SamplingParams`` refuses on its own (None
        when only a combination is refused)."""
        for name, value in values.items():
            # min_tokens is bounded by max_tokens, which comes first and so is valid here.
            alone = ({name: value, "max_tokens": values["max_tokens"]} if name == "min_tokens"
                     else {name: value})
            try:
                SamplingParams(**alone)
            except ValueError:
                if name == "max_tokens":
                    return self.max_tokens_field()
                return self.logprobs_field() if name == "logprobs" else name
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: the top log-probabilities per token, None for none."""
        return None

    def logprobs_field(self) -> str:
        """The name of the field that set ``requested_logprobs``."""
        return "logprobs"

    def max_tokens_field(self) -> str:
        """The name of the field that set ``requested_max_tokens``."""
        return "max_tokens"

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _is_token_ids(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(token, int) and not isinstance(token, bool) for token in value)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a batch: a list
    of strings or a list of token id lists."""

    prompt: str | list
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order, each text or token ids (the engine checks the ids' range)."""
        prompt = self.prompt
        if isinstance(prompt, str) or _is_token_ids(prompt) and prompt:
            batch = [prompt]
        elif prompt and (all(isinstance(item, str) for item in prompt)
                         or all(_is_token_ids(item) for item in prompt)):
            batch = prompt
        elif not prompt:
            raise ProtocolError("the prompt is empty", "prompt")
        else:
            raise ProtocolError("prompt must be a string, a list of integer token ids, or a "
                                "batch: a list of strings or a list of token id lists", "prompt")
        if len(batch) > MAX_BATCH_PROMPTS:
            raise ProtocolError(f"prompt holds a batch of {len(batch)} prompts: this server "
                                f"takes at most {MAX_BATCH_PROMPTS} per request", "prompt")
        for position, item in enumerate(batch):
            if not item:
                where = "" if len(batch) == 1 else f" (batch position {position})"
                raise ProtocolError(f"the prompt is empty{where}", "prompt")
        return batch


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
    # Accepted and ignored: they do not change the output (no tools are ever given: see tools).
    parallel_tool_calls: bool | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_retention: str | None = None
    include_reasoning: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Refused unless off (OFF_VALUES).
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    documents: list | None = None

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise ProtocolError("messages must hold at least one message", "messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ProtocolError("give max_tokens or max_completion_tokens, not both",
                                "max_completion_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError(f"top_logprobs (got {self.top_logprobs}) needs logprobs set to "
                                f"true", "top_logprobs")

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return 0 if self.top_logprobs is None else self.top_logprobs

    def logprobs_field(self) -> str:
        return "top_logprobs"

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

