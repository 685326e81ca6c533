"""The FastAPI app: OpenAI routes under /v1 (and vLLM's /v1/tokenize, /v1/detokenize, also at
/tokenize and /detokenize), plus /health and /metrics.

``build_app`` takes any :class:`EngineClient`; the tokenizer may be given directly or as a loader
called once the engine is ready. With an API key, every /v1 route needs
``Authorization: Bearer <key>`` (401); /health and /metrics stay open. While the engine is not
ready, /v1 routes answer 503 (after the key check, before body validation). A body over
``max_request_bytes`` is refused with 413 before it is parsed (server/limits.py).
"""
from __future__ import annotations

import asyncio
import contextlib

from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.openapi.utils import get_openapi
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response

from engine.protocol import EngineClient
from server import lora_admin
from server.context import ServerContext, TokenizerSource
from server.embeddings import EmbeddingRequest, EmbeddingResponse, EmbeddingServing
from server.errors import APIError, install_error_handlers
from server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, EchoRequestId
from server.messages_protocol import CountTokensRequest, MessagesRequest
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.protocol_responses import (AnthropicErrorResponse, ChatCompletionResponse,
                                       CompletionResponse, ErrorResponse, ModelCard, ModelList)
from server.response_store import DEFAULT_RESPONSES_STORE_MB, ResponseStore
from server.responses_protocol import ResponsesRequest
from server.responses_wire import DeletedResponse, InputItemList, ResponseObject
from server.scoring import (RerankRequest, RerankResponse, ScoreRequest, ScoreResponse,
                            ScoreServing)
from server.serving import json_response
from server.serving_chat import ChatServing
from server.serving_completion import CompletionServing
from server.llamacpp_native import NativeRequest, NativeResponse
from server.serving_infill import InfillRequest, InfillServing
from server.serving_native import NativeCompletionServing
from server.serving_messages import MessageBody, MessagesServing, TokenCount
from server.serving_responses import MAX_LISTED_ITEMS, ResponsesServing
from server.serving_tokens import (DetokenizeRequest, DetokenizeResponse, RenderResponse,
                                   TokenizeRequest, TokenizeResponse, TokenServing)
from server.stats_log import StatsLogger

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# what the OpenAPI document declares: the statuses each route can answer, in the OpenAI error
# shape (never FastAPI's 422: validation errors are 400s here)
_ERROR = {"model": ErrorResponse}
_V1_ERRORS = {401: {**_ERROR, "description": "Missing or wrong API key"},
              503: {**_ERROR, "description": "The model is loading, or the engine stopped"}}
_GENERATE_ERRORS = {**_V1_ERRORS,
                    400: {**_ERROR, "description": "Invalid request, or it can never fit"},
                    404: {**_ERROR, "description": "Unknown model"},
                    413: {**_ERROR, "description": "Request body over --max-request-bytes"},
                    429: {**_ERROR, "description": "Queue full: retry after Retry-After"},
                    500: {**_ERROR, "description": "The request failed in the engine"}}
# each server-sent event: its `data` line (a JSON text, or [DONE]) and, on routes with named
# events (Responses, Messages), its `event` name
_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}}}}}
# the routes that answer no generation (tokens, counts, adapters)
_ERRORS = {**_V1_ERRORS, 400: _GENERATE_ERRORS[400], 404: _GENERATE_ERRORS[404]}


def _generate_doc(body: type, errors: dict | None = None) -> dict:
    """A generation route's 200: the JSON body, or server-sent events with `stream`."""
    return {200: {"model": body, "content": _STREAM,
                  "description": "The completion (JSON), or its chunks as server-sent events"},
            **(errors or _GENERATE_ERRORS)}


def _anthropic(errors: dict) -> dict:
    """`errors` in the Messages API's error shape."""
    return {status: {**doc, "model": AnthropicErrorResponse} for status, doc in errors.items()}


def _openapi_without_422(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                             routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(engine: EngineClient, tokenizer: TokenizerSource, *, served_model_name: str,
              api_key: str | None = None, model_aliases: tuple[str, ...] = (),
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              responses_store_mb: float = DEFAULT_RESPONSES_STORE_MB,
              reasoning_parser: str = "auto", tool_call_parser: str = "auto",
              embedding_pooling: str = "last",
              lora_modules: dict[str, str] | None = None,
              allow_runtime_lora: bool = False, cors: dict | None = None,
              trust_request_chat_template: bool = False, log_stats: bool = False,
              log_requests: bool = False) -> FastAPI:
    """The app; `cors`: CORSMiddleware's keywords (ServerSettings.cors), None: no CORS
    headers; `log_stats`, `log_requests`: server/stats_log.py's lines."""
    ctx = ServerContext(engine, tokenizer, served_model_name=served_model_name,
                        model_aliases=model_aliases, api_key=api_key,
                        reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                        lora_modules=lora_modules)
    ctx.trust_request_chat_template = trust_request_chat_template
    ctx.metrics.log_requests = log_requests

    def authorize(authorization: str | None = Header(default=None),
                  x_api_key: str | None = Header(default=None)) -> None:
        ctx.check_api_key(authorization, x_api_key)

    def ready() -> None:
        ctx.require_ready()

    guarded = [Depends(authorize), Depends(ready)]
    v1, root = APIRouter(prefix="/v1", dependencies=guarded), APIRouter(dependencies=guarded)
    _generation_routes(v1, root, ctx, embedding_pooling)
    _responses_routes(v1, ResponsesServing(ctx, ResponseStore(int(responses_store_mb
                                                                  * 2 ** 20))))
    _model_routes(v1, ctx)
    _token_routes(v1, root, TokenServing(ctx))
    if allow_runtime_lora:          # vLLM's routes: folders on this server's disk, so opt-in
        lora_admin.add_routes(v1, ctx, _ERRORS)

    app = FastAPI(title="Strata", summary="OpenAI-compatible inference server",
                  lifespan=_stats_lifespan(ctx) if log_stats else None)
    app.openapi = lambda: _openapi_without_422(app)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(EchoRequestId)
    if cors is not None:    # added last, so outermost: a 413 or 401 carries its headers too
        app.add_middleware(CORSMiddleware, **cors)
    app.include_router(v1)
    app.include_router(root)
    _open_routes(app, ctx)
    return app


def _generation_routes(v1: APIRouter, root: APIRouter, ctx: ServerContext,
                       embedding_pooling: str) -> None:
    """Chat, completions, messages, embeddings, vLLM's score and rerank (also at the root,
    rerank under /v2 too: Cohere's path), and llama.cpp's /infill and /completion."""
    chat, completions, infill = ChatServing(ctx), CompletionServing(ctx), InfillServing(ctx)
    native = NativeCompletionServing(ctx)
    messages = MessagesServing(ctx)
    embeddings = EmbeddingServing(ctx, embedding_pooling)
    scoring = ScoreServing(embeddings)

    @v1.post("/chat/completions", responses=_generate_doc(ChatCompletionResponse))
    async def create_chat_completion(request: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(request, raw)

    @v1.post("/completions", responses=_generate_doc(CompletionResponse))
    async def create_completion(request: CompletionRequest, raw: Request) -> Response:
        return await completions.create(request, raw)

    @root.post("/infill", responses=_generate_doc(NativeResponse))
    async def create_infill(request: InfillRequest, raw: Request) -> Response:
        return await infill.create(request, raw)

    async def create_native_completion(request: NativeRequest, raw: Request) -> Response:
        return await native.create(request, raw)

    for path in ("/completion", "/completions"):         # llama.cpp's route and its alias
        root.add_api_route(path, create_native_completion, methods=["POST"],
                           responses=_generate_doc(NativeResponse | list[NativeResponse]),
                           operation_id=f"create_native_{path.strip('/')}")

    @v1.post("/messages", responses=_generate_doc(MessageBody, _anthropic(_GENERATE_ERRORS)))
    async def create_message(request: MessagesRequest, raw: Request) -> Response:
        return await messages.create(request, raw)

    @v1.post("/messages/count_tokens", response_model=TokenCount,
             responses=_anthropic({**_ERRORS, 413: _GENERATE_ERRORS[413]}))
    async def count_message_tokens(request: CountTokensRequest) -> Response:
        return await messages.count_tokens(request)

    @v1.post("/embeddings", response_model=EmbeddingResponse, responses=_GENERATE_ERRORS)
    async def create_embedding(request: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create(request, raw)

    async def create_score(request: ScoreRequest, raw: Request) -> Response:
        return await scoring.score(request, raw)

    async def create_rerank(request: RerankRequest, raw: Request) -> Response:
        return await scoring.rerank(request, raw)

    for router, path in ((v1, "/score"), (root, "/score")):
        router.add_api_route(path, create_score, methods=["POST"],
                             response_model=ScoreResponse, responses=_GENERATE_ERRORS)
    for router, path in ((v1, "/rerank"), (root, "/rerank"), (root, "/v2/rerank")):
        router.add_api_route(path, create_rerank, methods=["POST"],
                             response_model=RerankResponse, responses=_GENERATE_ERRORS)


def _responses_routes(v1: APIRouter, responses: ResponsesServing) -> None:
    """The Responses API: create, retrieve (a background response's events too), cancel,
    delete, and a stored response's input items."""
    stored = {**_V1_ERRORS, 404: {**_ERROR, "description": "No stored response has this id"}}
    streamed = {200: {"model": ResponseObject, "content": _STREAM, "description":
                      "The response (JSON), or a background response's events (stream)"},
                **stored, 400: _GENERATE_ERRORS[400]}

    @v1.post("/responses", responses=_generate_doc(ResponseObject))
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        return await responses.create(request, raw)

    @v1.get("/responses/{response_id}", responses=streamed)
    async def get_response(response_id: str, stream: bool = False,
                           starting_after: int | None = Query(None, ge=-1)) -> Response:
        return responses.retrieve(response_id, stream, starting_after)

    @v1.post("/responses/{response_id}/cancel", response_model=ResponseObject,
             responses={**stored, 400: _GENERATE_ERRORS[400]})
    async def cancel_response(response_id: str) -> Response:
        return await responses.cancel(response_id)

    @v1.delete("/responses/{response_id}", response_model=DeletedResponse, responses=stored)
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @v1.get("/responses/{response_id}/input_items", response_model=InputItemList,
            responses={**stored, 400: _GENERATE_ERRORS[400]})
    async def list_input_items(response_id: str,
                               limit: int = Query(20, ge=1, le=MAX_LISTED_ITEMS),
                               order: Literal["asc", "desc"] = "desc",
                               after: str | None = None) -> Response:
        return responses.input_items(response_id, limit, order, after)


def _model_routes(v1: APIRouter, ctx: ServerContext) -> None:
    """The served model and its LoRA adapters (parent: the base model, root: the folder)."""
    base = ctx.served_model_name

    @v1.get("/models", response_model=ModelList, responses=_V1_ERRORS)
    async def list_models() -> Response:
        card = ModelCard(id=base, max_model_len=ctx.max_model_len)
        adapters = [ModelCard(id=name, max_model_len=ctx.max_model_len, root=str(path),
                              parent=base)
                    for name, path in ctx.lora_modules.items()]
        return json_response(ModelList(data=[card, *adapters]))

    @v1.get("/models/{model:path}", response_model=ModelCard,
            responses={**_V1_ERRORS, 404: _GENERATE_ERRORS[404]})
    async def get_model(model: str) -> Response:
        ctx.check_model(model)          # the served name, an alias or an adapter (else 404)
        lora = ctx.lora_of(model)
        return json_response(ModelCard(
            id=model, max_model_len=ctx.max_model_len,
            root=None if lora is None else str(ctx.lora_modules[lora]),
            parent=None if lora is None else base))


def _token_routes(v1: APIRouter, root: APIRouter, tokens: TokenServing) -> None:
    """vLLM's tokenize and detokenize (at the root as well) and its prompt renders."""
    @v1.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: TokenizeRequest) -> Response:
        return json_response(await tokens.tokenize(request))

    @v1.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest) -> Response:
        return json_response(await tokens.detokenize(request))

    @v1.post("/chat/completions/render", response_model=RenderResponse, responses=_ERRORS)
    async def render_chat(request: ChatCompletionRequest) -> Response:
        return json_response(await tokens.render_chat(request))

    @v1.post("/completions/render", response_model=RenderResponse, responses=_ERRORS)
    async def render_completion(request: CompletionRequest) -> Response:
        return json_response(await tokens.render_completion(request))

    root.add_api_route("/tokenize", tokenize, methods=["POST"], response_model=TokenizeResponse,
                       responses=_ERRORS)
    root.add_api_route("/detokenize", detokenize, methods=["POST"],
                       response_model=DetokenizeResponse, responses=_ERRORS)


def _open_routes(app: FastAPI, ctx: ServerContext) -> None:
    """/health (and vLLM's /ping, SageMaker's), /version and /metrics: no API key, answered
    while the engine loads."""
    @app.get("/version", responses={200: {"content": {"application/json": {"schema": {
        "type": "object", "properties": {"version": {"type": "string"}}}}}}})
    async def version() -> Response:
        return JSONResponse({"version": server_version()})

    ping = {200: {"description": "Ready"}, 503: {**_ERROR, "description": "Not ready"}}

    @app.get("/ping", responses=ping)       # two routes: one OpenAPI operation id each
    async def ping_get() -> Response:
        return await health()

    @app.post("/ping", responses=ping)
    async def ping_post() -> Response:
        return await health()

    @app.get("/health", responses={200: {"content": {"application/json": {"schema": {
        "type": "object", "properties": {"status": {"type": "string"}}}}}},
        503: {**_ERROR, "description": "The engine is not ready"}})
    async def health() -> Response:
        if ctx.draining:
            error = APIError(503, "The server is stopping (draining).",
                             type="service_unavailable", code="draining")
            return error.response()
        if ctx.is_ready:
            return JSONResponse({"status": "ok"})
        error = APIError(503, "The engine is not ready (loading, or stopped).",
                         type="service_unavailable", code="not_ready")
        return error.response()

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "content": {METRICS_CONTENT_TYPE: {"schema": {"type": "string"}}},
        "description": "Prometheus text exposition"}})
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _stats_lifespan(ctx: ServerContext):
    """The app's life: the periodic stats line (server/stats_log.py) logged while it serves."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(StatsLogger(ctx.metrics, ctx.engine).run())
        try:
            yield
        finally:
            task.cancel()
    return lifespan


def server_version() -> str:
    """This package's version (pyproject.toml's, as installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("strata")
    except PackageNotFoundError:
        return "unknown"
