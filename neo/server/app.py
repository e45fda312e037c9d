"""The FastAPI application and ``serve`` (what ``neo serve`` runs).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, and with ``--torch-profiler-dir``
vLLM's ``POST /start_profile`` and ``POST /stop_profile`` (``neo.engine.torch_profiler``; the
stop answers the trace files). The model is served under
``ServerSettings.served_model_name`` (default: the engine's ``config.model``). Every error is
returned in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; a request the
client got wrong is answered 4xx and logged at most at debug level, so hostile clients cannot
flood the log (request fields the server does not know are ignored, each name warned about
once: ``serving.py``).
With an API key set, all routes but ``/health`` and ``/metrics`` need it (``auth.py``).
Request bodies are read within a size limit and a deadline (``request_body.py``).

Start-up (``serve``): the listening socket is bound before the model loads, so a port in use
ends the command at once; a banner is printed once the server listens.

Shutdown (SIGINT/SIGTERM): the server stops accepting connections and the engine aborts the
requests in flight, so each open stream ends at once with finish reason "abort"; then the
engine thread stops and the engine is closed.
"""

import contextlib
import logging
import socket
import time

import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from neo.bench import device_name
from neo.config import EngineConfig
from neo.engine import LLMEngine

from . import prometheus
from .async_engine import AsyncEngine, EngineStopped
from .auth import ApiKeyMiddleware
from .protocol import ProtocolError
from .responses import model_card
from .request_body import UnreadBodyMiddleware, declared_length, read_body
from .serving import CLIENT_CLOSED_STATUS, OpenAIServing, error_response
from .settings import ServerSettings
from .startup import banner, bind_listening_socket, url_of
from .streaming import ClientDisconnected

logger = logging.getLogger(__name__)

# How long uvicorn waits for open connections at shutdown before cancelling them.
GRACEFUL_SHUTDOWN_SECONDS = 5


def engine_info(engine: LLMEngine, served_model_name: str) -> dict[str, str]:
    """Labels of ``neo_engine_info``."""
    return {"model": engine.config.model, "served_model_name": served_model_name,
            "policy": engine.config.policy,
            "device": device_name(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
            "max_model_len": str(engine.max_model_len)}


def build_app(async_engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """The application over ``async_engine``; its lifespan starts and stops the engine thread."""
    settings = settings or ServerSettings()
    engine = async_engine.engine
    model_name = settings.served_model_name or engine.config.model
    serving = OpenAIServing(async_engine, model_name)
    info = engine_info(engine, model_name)
    created = int(time.time())
    max_body_bytes = settings.body_limit(engine.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()
            serving.close()

    app = FastAPI(title="neo", lifespan=lifespan)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    # Added last, so it wraps the key check too: a 401 also settles the unread body.
    app.add_middleware(UnreadBodyMiddleware, timeout_seconds=settings.body_read_timeout_seconds)

    async def read_request_body(request: Request) -> bytes:
        return await read_body(request.receive, declared_length(request.headers),
                               max_body_bytes, settings.body_read_timeout_seconds)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completion(await read_request_body(request), request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completion(await read_request_body(request),
                                             request.receive)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model_name, created, engine.max_model_len)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != model_name:
            return error_response(404, f"the model {model_id!r} does not exist: this server "
                                       f"serves {model_name!r}", "model", "model_not_found")
        return JSONResponse(model_card(model_name, created, engine.max_model_len))

    if engine.config.torch_profiler_dir:  # vLLM's routes, there too only with a profiler directory
        @app.post("/start_profile")
        async def start_profile() -> Response:
            return await profiling(start=True)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            return await profiling(start=False)

    async def profiling(start: bool) -> Response:
        try:
            traces = await async_engine.profile(start)
        except EngineStopped as error:
            return error_response(503, str(error))
        except RuntimeError as error:  # already recording, or not recording
            return error_response(409, str(error))
        return JSONResponse({"status": "recording"} if start else {"status": "written", "traces": traces})

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the engine is not running (shutting down or failed)")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus.render(async_engine.stats, info),
                        media_type=prometheus.CONTENT_TYPE)

    @app.exception_handler(ProtocolError)
    async def protocol_error(_request: Request, error: ProtocolError) -> Response:
        logger.debug("refused a request (%d): %s", error.status, error)
        return error_response(error.status, str(error), error.param, error.code)

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(_request: Request, _error: ClientDisconnected) -> Response:
        logger.debug("the client left before its request body was complete")
        return Response(status_code=CLIENT_CLOSED_STATUS)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, error: HTTPException) -> Response:
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, error: Exception) -> Response:
        return error_response(500, f"internal server error: {type(error).__name__}: {error}")

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, which also tells the engine to abort what is in flight as soon as
    a shutdown signal arrives (uvicorn alone would wait for every stream to finish)."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, ready_message: str):
        super().__init__(config)
        self.async_engine = async_engine
        self.ready_message = ready_message

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_message, flush=True)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.async_engine.stop_accepting_threadsafe()


def uvicorn_config(app: FastAPI, settings: ServerSettings, **options) -> uvicorn.Config:
    """uvicorn's settings for ``app``; ``options`` adds or overrides uvicorn's own."""
    return uvicorn.Config(app, **({"host": settings.host, "port": settings.port,
                                   "access_log": False,
                                   "timeout_keep_alive": settings.keep_alive_timeout_seconds,
                                   "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_SECONDS}
                                  | options))


def serve(engine_config: EngineConfig, settings: ServerSettings | None = None) -> None:
    """Bind the port, load the engine, then serve until SIGINT/SIGTERM. Raises
    ``startup.ListenError`` (a ``ValueError``) before loading anything when the port cannot be
    bound."""
    settings = settings or ServerSettings()
    listener = bind_listening_socket(settings.host, settings.port)
    try:
        async_engine = AsyncEngine(LLMEngine(engine_config))
        config = uvicorn_config(build_app(async_engine, settings), settings)
        ready_message = banner(async_engine.engine,
                               settings.served_model_name or engine_config.model,
                               url_of(settings.host, listener.getsockname()[1]))
        try:
            _Server(config, async_engine, ready_message).run(sockets=[listener])
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once it is done
            pass
    finally:
        listener.close()
