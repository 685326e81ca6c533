"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the HTTP edge can report is an :class:`APIError`; engine errors are mapped with
:func:`from_engine_error`; handlers installed by :func:`install_error_handlers` make sure that
pydantic validation errors, unknown routes and unexpected exceptions use the same shape and that
no traceback ever reaches a client.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.protocol import (EngineDeadError, EngineError, EngineNotReadyError, QueueFullError,
                             RequestTooLargeError, TooManyChoicesError,
                             PriorityNotEnabledError)
from server.protocol_responses import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 500
# NOTE: pydantic puts union member names into error locations; they are not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


# the Messages API's routes answer errors in Anthropic's shape, typed by status
ANTHROPIC_PATHS = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class APIError(Exception):
    """An error with its HTTP status, in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self, request: Request | None = None) -> JSONResponse:
        """The error as its route's clients read it: Anthropic's shape on the Messages API's
        routes, OpenAI's everywhere else."""
        body = self.anthropic_body() if request is not None and request.url.path.startswith(
            ANTHROPIC_PATHS) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500
                                   else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def context_length_exceeded(max_model_len: int, prompt_tokens: int | str,
                            max_tokens: int | None, param: str = "messages") -> APIError:
    """prompt_tokens: a count, or a bound such as "at least 327680" (a prompt too long to be
    worth tokenizing); param: "messages" (chat) or "prompt" (completions)."""
    if max_tokens is None or not isinstance(prompt_tokens, int):
        message = (f"This model's maximum context length is {max_model_len} tokens. However, your "
                   f"{param} resulted in {prompt_tokens} tokens. Please reduce the length of the "
                   f"{param}.")
    else:
        message = (f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                   f"{param}, {max_tokens} in the completion). Please reduce the length of the "
                   f"{param} or completion.")
    return invalid_request(message, param=param, code="context_length_exceeded")


def invalid_api_key() -> APIError:
    return APIError(401, "Incorrect API key provided.", type="authentication_error",
                    code="invalid_api_key")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", type="invalid_request_error",
                    param="model", code="model_not_found")


def internal_error() -> APIError:
    return APIError(500, "Internal server error.", type="server_error", code="internal_error")


@dataclass(frozen=True)
class Answer:
    """The HTTP answer to one kind of engine refusal."""
    status: int
    type: str
    code: str
    reason: str                         # strata_admission_rejections_total{reason}
    prefix: str = ""                    # before the engine's message
    message: str | None = None          # instead of the engine's message
    param: str | None = None
    retry_after_s: int | None = None    # Retry-After (QueueFullError carries its own)


# each engine error (engine/admission.py's vocabulary) -> one HTTP answer
ANSWERS: dict[type[EngineError], Answer] = {
    QueueFullError: Answer(429, "rate_limit_error", "queue_full", "queue_full",
                           prefix="Server is busy: ", retry_after_s=1),
    RequestTooLargeError: Answer(400, "invalid_request_error", "request_too_large", "too_large"),
    PriorityNotEnabledError: Answer(400, "invalid_request_error", "priority_not_enabled",
                                    "priority_not_enabled", param="priority"),
    TooManyChoicesError: Answer(400, "invalid_request_error", "too_many_choices", "too_large",
                                param="n"),
    EngineNotReadyError: Answer(503, "service_unavailable", "model_loading", "not_ready",
                                message="The model is still loading; retry shortly.",
                                retry_after_s=5),
    EngineDeadError: Answer(503, "service_unavailable", "engine_dead", "engine_dead",
                            prefix="The engine is not running: "),
}
_FAILED = Answer(500, "server_error", "engine_error", "engine_error",
                 prefix="The request failed in the engine: ")


def answer_for(exc: EngineError) -> Answer:
    return next((a for kind, a in ANSWERS.items() if isinstance(exc, kind)), _FAILED)


def from_engine_error(exc: EngineError) -> APIError:
    a = answer_for(exc)
    message = a.message or a.prefix + one_line(str(exc))
    retry = getattr(exc, "retry_after_s", None) or a.retry_after_s
    headers = {"Retry-After": str(max(1, retry))} if retry else None
    return APIError(a.status, message, type=a.type, param=a.param, code=a.code, headers=headers)


def not_ready() -> APIError:
    return from_engine_error(EngineNotReadyError("loading"))


def request_failed(message: str | None) -> APIError:
    """A request the engine accepted and then failed (e.g. an I/O error in a KV tier)."""
    return from_engine_error(EngineError(message or ""))


def one_line(message: str | None) -> str:
    """The first line of a message, bounded (engine messages must not carry tracebacks)."""
    lines = (message or "").strip().splitlines()
    return (lines[0] if lines else "unknown error")[:MAX_MESSAGE_CHARS]


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return invalid_request("Invalid request.")
    # NOTE: a union reports one error per member; "wrong type" ones are the least telling.
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = _param_name(loc)
    if first.get("type") == "json_invalid":
        return invalid_request("The request body is not valid JSON.")
    if first.get("type") == "missing":
        if param is None:
            return invalid_request("The request body is missing: send a JSON object.")
        return invalid_request(f"Missing required parameter: '{param}'.", param=param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = f" for '{param}'" if param else ""
    return invalid_request(f"Invalid value{where}: {msg}.", param=param)


def _param_name(loc: list) -> str | None:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif "[" in part or part in _TYPE_TAGS or part.startswith("function-"):
            break
        else:
            name += f".{part}" if name else part
    return name or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(request)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return from_engine_error(exc).response(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind,
                        headers=dict(exc.headers or {})).response(request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return internal_error().response(request)
