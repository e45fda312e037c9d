"""Server-sent events over ASGI, and waiting on a request while watching for the client leaving.

Both make sure a request whose client is gone stops: the coroutine or async iterator that
drives it is cancelled or closed, which aborts the request in the engine.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE_EVENT = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def sse_event(payload: dict) -> bytes:
    """``data: <json>`` and the blank line that ends an event. The JSON is ASCII: text such as
    U+2028 or U+0085, which many clients' line splitters break lines at, stays escaped."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client has gone (the body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Awaitable, receive: Receive):
    """Await ``work``; if the client disconnects first, cancel it and raise
    ``ClientDisconnected``."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        watcher.cancel()
    if not work_task.done() or work_task.cancelled():
        await asyncio.gather(work_task, return_exceptions=True)
        raise ClientDisconnected()
    return work_task.result()


class EventStreamResponse(Response):
    """Streams ``events`` (encoded SSE events) as ``text/event-stream``.

    While streaming it also listens for the client disconnecting; either way the iterator is
    closed at the end, so what produces the events learns that nobody listens any more.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]):
        # Like starlette's StreamingResponse: no body, hence no content-length header.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sender, watcher):
                task.cancel()
            await asyncio.gather(sender, watcher, return_exceptions=True)
            await self.events.aclose()
        if sender.done() and not sender.cancelled() and sender.exception() is not None:
            error = sender.exception()
            if not isinstance(error, OSError):  # OSError: the client went away mid-send
                raise error

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
