"""The FastAPI application and ``serve`` (what ``neo serve`` runs).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Every error is returned in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.

Shutdown (SIGINT/SIGTERM): the server stops accepting connections and the engine aborts the
requests in flight, so each open stream ends at once with finish reason "abort"; then the
engine thread stops and the engine is closed.
"""

import contextlib
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from neo.bench import device_name
from neo.config import EngineConfig
from neo.engine import LLMEngine

from . import prometheus
from .async_engine import AsyncEngine
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    model_card,
    parse_request,
)
from .serving import OpenAIServing, error_response

# How long uvicorn waits for open connections at shutdown before cancelling them.
GRACEFUL_SHUTDOWN_SECONDS = 5


def engine_info(engine: LLMEngine) -> dict[str, str]:
    """Labels of ``neo_engine_info``."""
    return {"model": engine.config.model, "policy": engine.config.policy,
            "device": device_name(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
            "max_model_len": str(engine.max_model_len)}


def build_app(async_engine: AsyncEngine) -> FastAPI:
    """The application over ``async_engine``; its lifespan starts and stops the engine thread."""
    engine = async_engine.engine
    model_name = engine.config.model
    serving = OpenAIServing(async_engine, model_name)
    info = engine_info(engine)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.stop()

    app = FastAPI(title="neo", lifespan=lifespan)

    async def read_json(request: Request) -> object:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ProtocolError(f"the request body is not valid JSON: {error}") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await read_json(request))
        serving.check_model(body)
        return await serving.completion(body, request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await read_json(request))
        serving.check_model(body)
        return await serving.chat_completion(body, request.receive)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model_name, created, engine.max_model_len)]}

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
        return error_response(error.status, str(error), error.param, error.code)

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

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine):
        super().__init__(config)
        self.async_engine = async_engine

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.async_engine.stop_accepting_threadsafe()


def serve(engine_config: EngineConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Load the engine, then serve until SIGINT/SIGTERM."""
    async_engine = AsyncEngine(LLMEngine(engine_config))
    config = uvicorn.Config(build_app(async_engine), host=host, port=port, access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    try:
        _Server(config, async_engine).run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once it is done
        pass
