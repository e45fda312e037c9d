"""``ServerSettings``: what ``neo serve`` listens on and the limits that keep one client's
abuse from costing the others."""

import math
from dataclasses import dataclass

# The default body limit, per token of the model's context: a full context as token ids in
# JSON takes at most 8 bytes a token ("151643, "), and as text about 4 bytes a token, up to 6
# times that when the client escapes non-ASCII text as \uXXXX (Python's json.dumps does by
# default) - 32 bytes a token covers either with room for a chat request's other fields.
BODY_BYTES_PER_CONTEXT_TOKEN = 32
# The default body limit of models with short contexts: room for a chat history of about a
# million characters, which the server decodes in milliseconds.
MIN_DEFAULT_BODY_BYTES = 2**20


def default_max_request_body_bytes(max_model_len: int) -> int:
    """The body limit a server of a ``max_model_len``-token model gets by default."""
    return max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * max_model_len)


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ServerSettings:
    """Settings of the HTTP server (the engine's are ``EngineConfig``).

    served_model_name: the model id clients see in ``/v1/models`` and name in a request's
        ``model`` (None: the engine's ``config.model``).
    api_key: when set, every route but ``/health`` and ``/metrics`` needs the header
        ``Authorization: Bearer <api_key>``.
    max_request_body_bytes: larger request bodies are refused with 413 (None:
        ``default_max_request_body_bytes`` of the model's context length).
    body_read_timeout_seconds: a request body not complete this long after its headers
        arrived is refused with 408 and its connection closed.
    keep_alive_timeout_seconds: an idle keep-alive connection is closed after this long.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int | None = None
    body_read_timeout_seconds: float = 30.0
    keep_alive_timeout_seconds: float = 5.0

    def __post_init__(self):
        if not _is_integer(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        if self.served_model_name is not None and (
                not isinstance(self.served_model_name, str) or not self.served_model_name.strip()
                or not self.served_model_name.isprintable()):
            raise ValueError(f"served_model_name must be a non-empty printable string, got "
                             f"{self.served_model_name!r}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()
                                         or not self.api_key.isascii() or " " in self.api_key):
            raise ValueError("api_key must be a non-empty string of printable ASCII characters "
                             "without spaces")
        if self.max_request_body_bytes is not None and (
                not _is_integer(self.max_request_body_bytes) or self.max_request_body_bytes < 1):
            raise ValueError(f"max_request_body_bytes must be a positive integer or None, got "
                             f"{self.max_request_body_bytes!r}")
        for name in ("body_read_timeout_seconds", "keep_alive_timeout_seconds"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    def body_limit(self, max_model_len: int) -> int:
        """The request body limit in bytes for a model of ``max_model_len`` tokens."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return default_max_request_body_bytes(max_model_len)
