"""Completions and chat completions: from a request body to a JSON or SSE response.

Text prompts are tokenized here, so the engine thread only sees token ids and the server knows
the prompt length for ``usage`` and default ``max_tokens``. Decoding and validating the body,
rendering the chat template and tokenizing run on a small pool of threads, never on the event
loop, and a text too long in bytes to fit the model's context in any tokenization is refused
before it is tokenized. The response waits for the first output before it starts: a rejected
request then still gets its 400, and a client that leaves while its request is queued aborts it.
"""

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jinja2.exceptions import TemplateError
from starlette.responses import JSONResponse, Response

from neo.outputs import RequestOutput
from neo.sampling_params import SamplingParams

from .async_engine import AsyncEngine, EngineStopped, RequestFailed
from .detokenizer import IncrementalDetokenizer
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    ResponseShape,
    error_body,
    parse_request,
    usage,
)
from .request_body import decode_json
from .streaming import (
    DONE_EVENT,
    ClientDisconnected,
    EventStreamResponse,
    sse_event,
    until_disconnect,
)

logger = logging.getLogger(__name__)

# OpenAI's default max_tokens for /v1/completions; chat completions run to the context limit.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# What a response is sent with after the client left (nginx's "client closed request").
CLIENT_CLOSED_STATUS = 499
# Threads that decode, validate and tokenize requests: at most this many requests take CPU
# from the engine thread and the event loop at once; the others wait their turn.
PREPARE_THREADS = 2


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    if status < 500:
        kind = "invalid_request_error"
    else:
        kind = "service_unavailable_error" if status == 503 else "server_error"
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


@dataclass
class PreparedRequest:
    """A request checked and ready for the engine: ``prompt_ids`` and ``params`` are what the
    engine runs, ``shape`` builds the responses."""

    request: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    shape: ResponseShape


class OpenAIServing:
    """Serves ``/v1/completions`` and ``/v1/chat/completions`` over one ``AsyncEngine``.

    Each request body is decoded, validated, rendered and tokenized on a thread of
    ``prepare_pool`` (``_prepare_completion``, ``_prepare_chat``): the event loop only moves
    bytes, so one request's preparation stalls it at most for one call into C (decoding a
    body, which the body limit bounds), never for the sum of the requests that arrive together.

    model_name: the name clients use (the engine's ``config.model``).
    """

    def __init__(self, async_engine: AsyncEngine, model_name: str):
        self.async_engine = async_engine
        self.model_name = model_name
        self.tokenizer = async_engine.engine.tokenizer
        self.max_model_len = async_engine.engine.max_model_len
        # A text of more bytes than this encodes to more tokens than the context holds.
        bytes_per_token = (self.tokenizer.max_text_bytes_per_token
                           if self.tokenizer is not None else None)
        self.max_prompt_text_bytes = (None if bytes_per_token is None
                                      else bytes_per_token * self.max_model_len)
        self.prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="neo-prepare")

    def close(self) -> None:
        """Stop the preparing threads: requests being prepared finish, queued ones are
        dropped."""
        self.prepare_pool.shutdown(wait=False, cancel_futures=True)

    async def completion(self, body: bytes, receive) -> Response:
        """Serve the JSON ``body`` of a ``/v1/completions`` request."""
        return await self._serve(await self._prepared(self._prepare_completion, body), receive)

    async def chat_completion(self, body: bytes, receive) -> Response:
        """Serve the JSON ``body`` of a ``/v1/chat/completions`` request."""
        return await self._serve(await self._prepared(self._prepare_chat, body), receive)

    async def _prepared(self, prepare, body: bytes) -> PreparedRequest:
        return await asyncio.get_running_loop().run_in_executor(self.prepare_pool, prepare, body)

    def _prepare_completion(self, body: bytes) -> PreparedRequest:
        request = parse_request(CompletionRequest, decode_json(body))
        self._check_model(request)
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            prompt_ids = self._encode(prompt, "prompt", add_special_tokens=True)
        else:
            prompt_ids = list(prompt)
        shape = ResponseShape(f"cmpl-{uuid.uuid4().hex}", self.model_name, chat=False,
                              return_token_ids=request.return_token_ids)
        return self._with_params(request, prompt_ids, COMPLETION_DEFAULT_MAX_TOKENS, shape)

    def _prepare_chat(self, body: bytes) -> PreparedRequest:
        request = parse_request(ChatCompletionRequest, decode_json(body))
        self._check_model(request)
        if self.tokenizer is None:
            raise ProtocolError(f"model {self.model_name!r} has no tokenizer, so it has no chat "
                                f"template: use /v1/completions with token id prompts", "messages")
        messages = [message.as_template_message() for message in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except TemplateError as error:
            raise ProtocolError(f"the chat template rejected the messages: {error}",
                                "messages") from None
        prompt_ids = self._encode(text, "messages", add_special_tokens=False)
        shape = ResponseShape(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, chat=True,
                              return_token_ids=request.return_token_ids)
        default_max_tokens = max(1, self.max_model_len - len(prompt_ids))
        return self._with_params(request, prompt_ids, default_max_tokens, shape)

    def _with_params(self, request, prompt_ids: list[int], default_max_tokens: int,
                     shape: ResponseShape) -> PreparedRequest:
        params = request.sampling_params(default_max_tokens)
        if params.stop and self.tokenizer is None:
            raise ProtocolError(f"stop strings need a tokenizer and model {self.model_name!r} "
                                f"has none: use stop_token_ids", "stop")
        return PreparedRequest(request, prompt_ids, params, shape)

    def _check_model(self, request) -> None:
        """Raises a 404 ``ProtocolError`` for a model name this server does not serve."""
        if request.model is not None and request.model != self.model_name:
            raise ProtocolError(f"the model {request.model!r} does not exist: this server serves "
                                f"{self.model_name!r}", "model", status=404, code="model_not_found")

    def _encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a prompt text; ``field`` names it in errors. A text longer in bytes
        than ``max_prompt_text_bytes`` is refused without being tokenized."""
        if self.tokenizer is None:
            raise ProtocolError(f"model {self.model_name!r} has no tokenizer: pass the prompt "
                                f"as a list of token ids", field)
        limit = self.max_prompt_text_bytes
        if limit is not None and (len(text) > limit or len(text.encode()) > limit):
            raise ProtocolError(
                f"the prompt text of {len(text.encode())} bytes can never fit the model's "
                f"context of {self.max_model_len} tokens: no token of this tokenizer stands "
                f"for more than {limit // self.max_model_len} bytes, so at most {limit} bytes "
                f"fit", field)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def _serve(self, prepared: PreparedRequest, receive) -> Response:
        request, prompt_ids, params, shape = (prepared.request, prepared.prompt_ids,
                                              prepared.params, prepared.shape)
        outputs = self.async_engine.generate(prompt_ids, params, shape.request_id)
        try:
            first = await until_disconnect(anext(outputs), receive)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except (ValueError, RequestFailed, EngineStopped) as error:
            return _engine_error_response(error)
        detokenizer = (IncrementalDetokenizer(self.tokenizer, params.stop)
                       if self.tokenizer is not None else None)
        if request.stream:
            events = self._events(first, outputs, shape, detokenizer, len(prompt_ids),
                                  request.include_usage_in_stream)
            return EventStreamResponse(events)
        try:
            final = await until_disconnect(_last(first, outputs), receive)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except (RequestFailed, EngineStopped) as error:
            return _engine_error_response(error)
        completion = final.outputs[0]
        return JSONResponse(shape.response(
            completion.text, completion.token_ids, completion.finish_reason,
            usage(len(prompt_ids), len(completion.token_ids))))

    async def _events(self, first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                      shape: ResponseShape, detokenizer: IncrementalDetokenizer | None,
                      num_prompt_tokens: int, include_usage: bool) -> AsyncIterator[bytes]:
        """One SSE event per batch of new tokens, then usage (if asked) and ``[DONE]``."""
        num_sent = 0
        output = first
        try:
            while True:
                completion = output.outputs[0]
                new_ids = completion.token_ids[num_sent:]
                num_sent = len(completion.token_ids)
                text = ""
                if detokenizer is not None:
                    text = (detokenizer.finish(completion.text) if output.finished
                            else detokenizer.update(completion.token_ids))
                yield sse_event(shape.chunk(text, new_ids, completion.finish_reason,
                                            include_usage, first=output is first))
                if output.finished:
                    break
                output = await anext(outputs)
            if include_usage:
                yield sse_event(shape.usage_chunk(usage(num_prompt_tokens, num_sent)))
        except (RequestFailed, EngineStopped) as error:
            yield sse_event(error_body(str(error), "server_error"))
        finally:
            await outputs.aclose()
        yield DONE_EVENT


async def _last(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = first
    while not final.finished:
        final = await anext(outputs)
    return final


def _engine_error_response(error: Exception) -> JSONResponse:
    if isinstance(error, EngineStopped):
        return error_response(503, str(error))
    if isinstance(error, RequestFailed):
        logger.error("request failed: %s", error)
        return error_response(500, str(error))
    return error_response(400, str(error), "prompt")
