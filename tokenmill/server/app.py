"""The FastAPI app: OpenAI-compatible /v1 routes, /health and /metrics around one AsyncEngine,
which the app starts and stops with its lifespan."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.auth import APIKeyMiddleware, BodyLimitMiddleware
from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from tokenmill.server.serving import RequestLimits, ServedModel
from tokenmill.server.tokenize import tokenize_routes
from tokenmill.server.webchat import web_chat_routes


def create_app(
    engine: LLMEngine | Callable[[], LLMEngine],
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    max_request_bytes: int = 16 * 2**20,
    limits: RequestLimits | None = None,
) -> FastAPI:
    """An app serving engine (or the engine a function builds, on the engine's step thread:
    see AsyncEngine). app.state holds async_engine, model and metrics (for tests)."""
    async_engine = AsyncEngine(engine, max_queued_requests)
    names = list(served_model_names or [async_engine.engine.config.model])
    metrics = ServerMetrics(names[0])
    async_engine.on_output = metrics.observe
    metrics.watch_engine(lambda: async_engine.stats)
    model = ServedModel(async_engine, names, limits or RequestLimits())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.async_engine, app.state.model, app.state.metrics = async_engine, model, metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:  # added last: runs first
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.include_router(_v1_routes(model))
    app.include_router(tokenize_routes(model))  # /tokenize, /detokenize as vLLM
    app.include_router(web_chat_routes())  # the chat page at /
    app.openapi = lambda: _openapi(app)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, with its 422 validation responses described as what this server
    sends instead: 400 with an OpenAI error body (errors.py)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for op in operations.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = {"description": "Invalid request: an OpenAI error body "
                                                       "naming the problem and its param"}
        schema.get("components", {}).get("schemas", {}).pop("HTTPValidationError", None)
        schema.get("components", {}).get("schemas", {}).pop("ValidationError", None)
        app.openapi_schema = schema
    return app.openapi_schema


def _v1_routes(model: ServedModel) -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, model, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, model, request)

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=n, max_model_len=model.max_model_len)
                               for n in model.names])

    @v1.get("/models/{model_id:path}")
    async def one_model(model_id: str) -> ModelCard:
        model.check_model(model_id)
        return ModelCard(id=model_id, max_model_len=model.max_model_len)

    return v1
