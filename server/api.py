"""The FastAPI app: OpenAI routes under /v1, plus /health and /metrics.

``build_app`` takes any :class:`EngineClient`; the tokenizer may be given directly or as a loader
called once the engine is ready. With an API key, every /v1 route needs
``Authorization: Bearer <key>`` (401); /health and /metrics stay open. While the engine is not
ready, /v1 routes answer 503 (after the key check, before body validation).
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from starlette.responses import JSONResponse, Response

from engine.protocol import EngineClient
from server.context import ServerContext, TokenizerSource
from server.errors import APIError, install_error_handlers
from server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from server.serving import json_response
from server.serving_chat import ChatServing
from server.serving_completion import CompletionServing

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(engine: EngineClient, tokenizer: TokenizerSource, *, served_model_name: str,
              api_key: str | None = None, model_aliases: tuple[str, ...] = ()) -> FastAPI:
    ctx = ServerContext(engine, tokenizer, served_model_name=served_model_name,
                        model_aliases=model_aliases, api_key=api_key)
    chat = ChatServing(ctx)
    completions = CompletionServing(ctx)

    def authorize(authorization: str | None = Header(default=None)) -> None:
        ctx.check_api_key(authorization)

    def ready() -> None:
        ctx.require_ready()

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize), Depends(ready)])

    @v1.post("/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(request, raw)

    @v1.post("/completions")
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await completions.create(request, raw)

    @v1.get("/models")
    async def list_models() -> Response:
        card = ModelCard(id=served_model_name, max_model_len=ctx.max_model_len)
        return json_response(ModelList(data=[card]))

    app = FastAPI(title="Strata", summary="OpenAI-compatible inference server")
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if ctx.is_ready:
            return JSONResponse({"status": "ok"})
        error = APIError(503, "The engine is not ready (loading, or stopped).",
                         type="service_unavailable", code="not_ready")
        return error.response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app
