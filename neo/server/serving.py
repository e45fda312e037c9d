"""Completions and chat completions: from a request body to a JSON or SSE response.

Text prompts are tokenized here, so the engine thread only sees token ids and the server knows
the prompt length for ``usage`` and default ``max_tokens``. Decoding and validating the body,
rendering the chat template and tokenizing run on a small pool of threads, never on the event
loop, and a text too long in bytes to fit the model's context in any tokenization is refused
before it is tokenized. The response waits for the first output before it starts: a rejected
request then still gets its 400, and a client that leaves while its request is queued aborts it.

A request with a batch of prompts (``/v1/completions``) runs one engine request per prompt (with
``n`` > 1 a parallel-sampling parent of ``n`` completions); its choices come from each prompt's
``RequestOutput.outputs`` in prompt order, and a stream carries each choice's chunks under its
``index`` as they come, with their tokens' log-probabilities when asked for (``logprobs.py``).
"""

import asyncio
import logging
import threading
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
from .logprobs import LogprobsShape
from .protocol import ChatCompletionRequest, CompletionRequest, ProtocolError, parse_request
from .responses import ResponseShape, error_body, usage
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
# Each unknown request field name is logged as a warning the first time it is seen, for up to
# this many names (later ones at debug level): clients sending ever new names cannot flood
# the log.
MAX_WARNED_UNKNOWN_FIELDS = 1000
# The characters of an unknown field name shown in the log.
MAX_LOGGED_FIELD_NAME_CHARS = 60


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    if status < 500:
        kind = "invalid_request_error"
    else:
        kind = "service_unavailable_error" if status == 503 else "server_error"
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


@dataclass
class PreparedRequest:
    """A request checked and ready for the engine: one engine request per entry of
    ``prompt_ids``, each run with ``params``; ``shape`` builds the responses."""

    request: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[list[int]]
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
        self.warned_unknown_fields: set[str] = set()  # guarded by unknown_fields_lock
        self.unknown_fields_lock = threading.Lock()

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
        self._log_unknown_fields(request)
        prompt_ids = [self._encode(prompt, "prompt", add_special_tokens=True)
                      if isinstance(prompt, str) else list(prompt)
                      for prompt in request.prompts()]
        shape = ResponseShape(f"cmpl-{uuid.uuid4().hex}", self.model_name, chat=False,
                              return_token_ids=request.return_token_ids)
        return self._with_params(request, prompt_ids, COMPLETION_DEFAULT_MAX_TOKENS, shape)

    def _prepare_chat(self, body: bytes) -> PreparedRequest:
        request = parse_request(ChatCompletionRequest, decode_json(body))
        self._check_model(request)
        self._log_unknown_fields(request)
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
        return self._with_params(request, [prompt_ids], default_max_tokens, shape)

    def _with_params(self, request, prompt_ids: list[list[int]], default_max_tokens: int,
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

    def _log_unknown_fields(self, request) -> None:
        """Warn about the request's unknown fields not warned about before (they are ignored,
        as vLLM ignores them)."""
        names = request.unknown_fields
        if not names:
            return
        with self.unknown_fields_lock:
            room = MAX_WARNED_UNKNOWN_FIELDS - len(self.warned_unknown_fields)
            warned = [name for name in names if name not in self.warned_unknown_fields][:room]
            self.warned_unknown_fields.update(warned)
        if warned:
            logger.warning("ignored request fields this server does not know: %s",
                           ", ".join(repr(name[:MAX_LOGGED_FIELD_NAME_CHARS]) for name in warned))
        logger.debug("request fields ignored: %s",
                     ", ".join(repr(name[:MAX_LOGGED_FIELD_NAME_CHARS]) for name in names))

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
        request, params, shape = prepared.request, prepared.params, prepared.shape
        streams = [self.async_engine.generate(prompt_ids, params, f"{shape.request_id}-{position}")
                   for position, prompt_ids in enumerate(prepared.prompt_ids)]
        try:
            firsts = await until_disconnect(_gather_or_cancel(map(anext, streams)), receive)
        except ClientDisconnected:
            await _close_all(streams)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except (ValueError, RequestFailed, EngineStopped) as error:
            await _close_all(streams)
            return _engine_error_response(error)
        num_prompt_tokens = sum(map(len, prepared.prompt_ids))
        if request.stream:
            events = self._events(firsts, streams, request.completions_per_prompt, shape,
                                  params, num_prompt_tokens, request.include_usage_in_stream)
            return EventStreamResponse(events)
        try:
            finals = await until_disconnect(
                _gather_or_cancel(_last(first, stream) for first, stream in zip(firsts, streams)),
                receive)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except (RequestFailed, EngineStopped) as error:
            return _engine_error_response(error)
        finally:
            await _close_all(streams)
        logprobs_shape = self._logprobs_shape(shape, params)
        choices = [shape.choice(choice_index(position, completion.index,
                                             request.completions_per_prompt),
                                completion.text, completion.token_ids, completion.finish_reason,
                                logprobs=None if logprobs_shape is None else logprobs_shape.build(
                                    completion.token_ids, completion.logprobs)[0])
                   for position, final in enumerate(finals) for completion in final.outputs]
        num_completion_tokens = sum(len(completion.token_ids) for final in finals
                                    for completion in final.outputs)
        return JSONResponse(shape.response(choices, usage(num_prompt_tokens,
                                                          num_completion_tokens)))

    async def _events(self, firsts: list[RequestOutput],
                      streams: list[AsyncIterator[RequestOutput]], completions_per_prompt: int,
                      shape: ResponseShape, params: SamplingParams, num_prompt_tokens: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        """One SSE event per choice's batch of new tokens (the choices' events interleave as
        their tokens come; a choice's finish reason comes in its last one), then usage (if
        asked) and ``[DONE]``. Each event carries the log-probabilities of its tokens when
        asked for."""
        num_sent: dict[int, int] = {}  # choice index -> tokens sent
        ended: set[int] = set()  # choices whose finish reason was sent
        text_offsets: dict[int, int] = {}  # choice index -> logprobs text offset
        detokenizers: dict[int, IncrementalDetokenizer] = {}
        logprobs_shape = self._logprobs_shape(shape, params)
        merged = merge_outputs(firsts, streams)
        try:
            async for position, output in merged:
                for completion in output.outputs:
                    index = choice_index(position, completion.index, completions_per_prompt)
                    first = index not in num_sent
                    start = num_sent.get(index, 0)
                    new_ids = completion.token_ids[start:]
                    finished = completion.finish_reason is not None
                    if index in ended or not (first or new_ids or finished):
                        continue
                    num_sent[index] = len(completion.token_ids)
                    if finished:
                        ended.add(index)
                    text = ""
                    if self.tokenizer is not None:
                        detokenizer = detokenizers.setdefault(
                            index, IncrementalDetokenizer(self.tokenizer, params.stop))
                        text = (detokenizer.finish(completion.text) if finished
                                else detokenizer.update(completion.token_ids))
                    logprobs = None
                    if logprobs_shape is not None:
                        logprobs, text_offsets[index] = logprobs_shape.build(
                            new_ids, completion.logprobs[start:], text_offsets.get(index, 0))
                    yield sse_event(shape.chunk(index, text, new_ids, completion.finish_reason,
                                                include_usage, first=first, logprobs=logprobs))
            if include_usage:
                yield sse_event(shape.usage_chunk(usage(num_prompt_tokens,
                                                        sum(num_sent.values()))))
        except (RequestFailed, EngineStopped) as error:
            yield sse_event(error_body(str(error), "server_error"))
        finally:
            await merged.aclose()
            await _close_all(streams)
        yield DONE_EVENT

    def _logprobs_shape(self, shape: ResponseShape, params: SamplingParams
                        ) -> LogprobsShape | None:
        """What builds the choices' ``logprobs`` objects; None when none were asked for."""
        if params.logprobs is None:
            return None
        return LogprobsShape(self.tokenizer, shape.chat, params.logprobs)


def choice_index(position: int, completion_index: int, completions_per_prompt: int) -> int:
    """The response's choice index of completion ``completion_index`` of the prompt at batch
    ``position``."""
    return position * completions_per_prompt + completion_index


async def merge_outputs(firsts: list[RequestOutput], streams: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(position, output)`` of several requests' output streams as the outputs arrive: each
    first output (already read from its stream), then the rest. One read per unfinished
    stream is pending at a time, so each stream still hands over only its newest output when
    the reader falls behind. Raises what a stream raises; closing this iterator cancels the
    pending reads. A single stream is read directly, without a task per read."""
    if len(streams) == 1:
        output = firsts[0]
        yield 0, output
        while not output.finished:
            output = await anext(streams[0])
            yield 0, output
        return
    pending: dict[asyncio.Future, int] = {}
    try:
        for position, first in enumerate(firsts):
            yield position, first
            if not first.finished:
                pending[asyncio.ensure_future(anext(streams[position]))] = position
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=pending.__getitem__):
                position = pending.pop(read)
                output = read.result()
                yield position, output
                if not output.finished:
                    pending[asyncio.ensure_future(anext(streams[position]))] = position
    finally:
        for read in pending:
            read.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _gather_or_cancel(awaitables) -> list:
    """The results of ``awaitables`` run together; when one raises (or this is cancelled), the
    others are cancelled before the error propagates."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close_all(streams: list[AsyncIterator[RequestOutput]]) -> None:
    """Close every stream: an unfinished request is aborted."""
    for stream in streams:
        await stream.aclose()


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
