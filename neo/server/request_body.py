"""Reading and decoding a request body within the server's limits.

A body is read chunk by chunk as the client sends it, so a body over the size limit is refused
once the limit is crossed (or at once, from its ``Content-Length``) without being held in
memory, and a client that stops sending before the body is complete is answered 408 when the
read deadline passes. Both answers close the connection. After a 413 the rest of the body is
first read and thrown away, within bounds (``BodyDiscardingResponse``): closing a connection
with received bytes unread resets it, and the reset can destroy the response before a client
that is still sending its body reads it.

Decoding refuses what Python's ``json`` accepts but no string or value of a request can use:
lone UTF-16 surrogates (``"\\ud800"`` decodes to a ``str`` that cannot be encoded as UTF-8, so
the tokenizer, the engine or the response would fail on it) and nesting deeper than the
decoder's recursion limit.
"""

import asyncio
import json
import re

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .protocol import ProtocolError
from .streaming import ClientDisconnected

# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF); bodies without one cannot decode to a
# string holding a lone surrogate (strict UTF-8 decoding refuses encoded surrogates).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# At most this much of the rest of a body over the limit is read and thrown away after the
# 413 (the time is bounded by the body read timeout): thrown-away bytes cost the event loop a
# few microseconds per 64 KiB, and a client sending more than this gets its connection closed.
MAX_DISCARDED_BYTES = 64 * 2**20


class BodyTooLarge(ProtocolError):
    """A 413: the request body exceeds the server's limit."""

    def __init__(self, message: str):
        super().__init__(message, status=413, close_connection=True)


def declared_length(headers) -> int | None:
    """The ``Content-Length`` of a request (the HTTP parser has checked its syntax)."""
    value = headers.get("content-length")
    return int(value) if value is not None and value.isdigit() else None


async def read_body(receive: Receive, declared: int | None, max_bytes: int,
                    timeout_seconds: float) -> bytes:
    """The whole body, read from the ASGI ``receive`` within ``max_bytes`` and
    ``timeout_seconds``.

    Raises ``ProtocolError`` 413 when the declared or received length exceeds ``max_bytes``,
    408 when the body is not complete ``timeout_seconds`` after the read started (both close
    the connection), and ``ClientDisconnected`` when the client leaves first.
    """
    if declared is not None and declared > max_bytes:
        raise _too_large(f"its Content-Length is {declared}", max_bytes)
    chunks: list[bytes] = []
    try:
        await asyncio.wait_for(_read_chunks(receive, chunks, max_bytes), timeout_seconds)
    except asyncio.TimeoutError:
        raise ProtocolError(f"the request body was not complete within {timeout_seconds:g} s "
                            f"(the server's body read timeout; {sum(map(len, chunks))} bytes "
                            f"arrived)", status=408, close_connection=True) from None
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


def _too_large(detail: str, max_bytes: int) -> BodyTooLarge:
    return BodyTooLarge(f"the request body exceeds the limit of {max_bytes} bytes (the "
                        f"server's max_request_body_bytes): {detail}")


class BodyDiscardingResponse:
    """Sends ``response`` (which must close the connection) at once, then reads and throws
    away the rest of the request body, up to ``MAX_DISCARDED_BYTES`` and for at most
    ``timeout_seconds``, before ending the response; the connection closes then. A client
    waiting for ``100 Continue`` has sent no body: nothing is read (reading would invite it)."""

    def __init__(self, response: Response, timeout_seconds: float):
        self.response = response
        self.timeout_seconds = timeout_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.response.status_code,
                    "headers": self.response.raw_headers})
        await send({"type": "http.response.body", "body": self.response.body,
                    "more_body": True})
        if (b"expect", b"100-continue") not in _lowered(scope["headers"]):
            try:
                await asyncio.wait_for(_discard_body(receive), self.timeout_seconds)
            except asyncio.TimeoutError:
                pass
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _lowered(headers: list[tuple[bytes, bytes]]) -> set[tuple[bytes, bytes]]:
    return {(name.lower(), value.lower()) for name, value in headers}


async def _discard_body(receive: Receive) -> None:
    discarded = 0
    while discarded <= MAX_DISCARDED_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
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
