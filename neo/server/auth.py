"""``ApiKeyMiddleware``: requests to the API need ``Authorization: Bearer <api key>``.

Only ``/health`` and ``/metrics`` stay open (probes and scrapers carry no key); every other
path, unknown ones included, answers 401 in OpenAI's error shape without a valid key, before
the request's body is read. The key is compared in constant time.
"""

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .responses import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyMiddleware:
    """ASGI middleware in front of ``app`` that lets through only requests carrying
    ``api_key``."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body("a valid API key is required: send the header 'Authorization: Bearer "
                       "<api key>'", "invalid_request_error", code="invalid_api_key"),
            status_code=401, headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        values = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected)
