"""Reading and decoding a request body within the server's limits.

A body is read chunk by chunk as the client sends it, so a body over the size limit is refused
with 413 once the limit is crossed (or at once, from its ``Content-Length``) without being held
in memory, and a client that stops sending before the body is complete is answered 408 when
the read deadline passes.

Whenever a response is ready before its request's body was read to its end (413, 408, a 401
from ``ApiKeyMiddleware``, an unknown route), ``UnreadBodyMiddleware`` first reads and throws
away the rest of the body within bounds, then sends the response and closes the connection:
closing a connection with received bytes unread resets it, and the reset can destroy the
response before a client that is still sending its body reads it; left alone, the HTTP server
would read and drop such a body for as long as the client sends it.

Decoding refuses what Python's ``json`` accepts but no string or value of a request can use:
lone UTF-16 surrogates (``"\\ud800"`` decodes to a ``str`` that cannot be encoded as UTF-8, so
the tokenizer, the engine or the response would fail on it) and nesting deeper than the
decoder's recursion limit.
"""

import asyncio
import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import ProtocolError
from .streaming import ClientDisconnected

# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF); bodies without one cannot decode to a
# string holding a lone surrogate (strict UTF-8 decoding refuses encoded surrogates).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# At most this much of an unread body is read and thrown away before its connection closes:
# it costs the event loop one receive per chunk and no memory; a client sending more than this
# (or for longer than the body read timeout) has its connection closed with the bytes unread.
MAX_DISCARDED_BYTES = 64 * 2**20


def declared_length(headers) -> int | None:
    """The ``Content-Length`` of a request (the HTTP parser has checked its syntax)."""
    value = headers.get("content-length")
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


async def read_body(receive: Receive, declared: int | None, max_bytes: int,
                    timeout_seconds: float) -> bytes:
    """The whole body, read from the ASGI ``receive`` within ``max_bytes`` and
    ``timeout_seconds``.

    Raises ``ProtocolError`` 413 when the declared or received length exceeds ``max_bytes``,
    408 when the body is not complete ``timeout_seconds`` after the read started, and
    ``ClientDisconnected`` when the client leaves first.
    """
    if declared is not None and declared > max_bytes:
        raise _too_large(f"its Content-Length is {declared}", max_bytes)
    chunks: list[bytes] = []
    try:
        await asyncio.wait_for(_read_chunks(receive, chunks, max_bytes), timeout_seconds)
    except asyncio.TimeoutError:
        raise ProtocolError(f"the request body was not complete within {timeout_seconds:g} s "
                            f"(the server's body read timeout; {sum(map(len, chunks))} bytes "
                            f"arrived)", status=408) from None
    return b"".join(chunks)


async def _read_chunks(receive: Receive, chunks: list[bytes], max_bytes: int) -> None:
    """Append the body's chunks to ``chunks`` until its end."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(f"{size} bytes arrived before its end", max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return


def _too_large(detail: str, max_bytes: int) -> ProtocolError:
    return ProtocolError(f"the request body exceeds the limit of {max_bytes} bytes (the "
                         f"server's max_request_body_bytes): {detail}", status=413)


class UnreadBodyMiddleware:
    """ASGI middleware for responses sent before their request's body was read to its end:
    it holds the response back, reads and throws away the rest of the body (up to
    ``MAX_DISCARDED_BYTES``, until ``timeout_seconds`` after the request arrived), then sends
    the response with ``Connection: close``. (Sending first and discarding after would leave
    the HTTP server mid-response while it parses the client's body; uvicorn fails with a
    traceback when that body turns out malformed.) A client waiting for ``100 Continue`` has
    sent no body: nothing is read from it (reading would invite it)."""

    def __init__(self, app: ASGIApp, timeout_seconds: float):
        self.app = app
        self.timeout_seconds = timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {name.lower(): value for name, value in scope.get("headers", [])}
        if scope["type"] != "http" or (headers.get(b"content-length", b"0") == b"0"
                                       and b"transfer-encoding" not in headers):
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_seconds
        discard = headers.get(b"expect", b"").lower() != b"100-continue"
        body_read = False
        held: list[Message] = []  # the response, while the body is unread

        async def tracking_receive() -> Message:
            nonlocal body_read
            message = await receive()
            body_read = message["type"] == "http.disconnect" or not message.get("more_body")
            return message

        async def guarding_send(message: Message) -> None:
            if body_read and not held:
                await send(message)
                return
            if message["type"] == "http.response.start":
                kept = [(name, value) for name, value in message.get("headers", [])
                        if name.lower() != b"connection"]
                message = message | {"headers": kept + [(b"connection", b"close")]}
            held.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                if discard and not body_read:
                    try:
                        await asyncio.wait_for(_discard_body(tracking_receive),
                                               deadline - asyncio.get_running_loop().time())
                    except asyncio.TimeoutError:
                        pass
                for held_message in held:
                    await send(held_message)

        await self.app(scope, tracking_receive, guarding_send)


async def _discard_body(receive: Receive) -> None:
    discarded = 0
    while discarded <= MAX_DISCARDED_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body"):
            return
        discarded += len(message.get("body", b""))


def decode_json(body: bytes) -> object:
    """The decoded body; raises a 400 ``ProtocolError`` for invalid JSON (syntax, anything but
    strict UTF-8, integers beyond Python's digit limit, nesting past the recursion limit) and
    for a string holding a lone surrogate, naming its field. (``json.loads`` of bytes would
    also take UTF-16 and UTF-32, and UTF-8-encoded surrogates.)"""
    try:
        value = json.loads(body.decode())
    except RecursionError:
        raise ProtocolError("the request body is not valid JSON: it nests arrays or objects "
                            "deeper than the server decodes") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise ProtocolError(f"the request body is not valid JSON: {error}") from None
    if SURROGATE_ESCAPE.search(body):
        _refuse_lone_surrogates(value)
    return value


def _refuse_lone_surrogates(value: object) -> None:
    """Raise a 400 ``ProtocolError`` naming the first field (``messages.0.content``) whose
    string or key holds a lone surrogate. Walks without recursion (the value may nest as deep
    as the decoder allowed)."""
    pending = [((), value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path + (key,))
                pending.append((path + (key,), child))
        elif isinstance(item, list):
            pending.extend((path + (index,), child) for index, child in enumerate(item))


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode()
    except UnicodeEncodeError as error:
        field = ".".join(str(part).encode(errors="backslashreplace").decode() for part in path)
        code_unit = f"\\u{ord(text[error.start]):04x}"
        raise ProtocolError(f"field '{field}' is not valid Unicode text: it holds a lone UTF-16 "
                            f"surrogate ({code_unit}) at character {error.start}",
                            field or None) from None
