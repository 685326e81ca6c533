"""Request size limit: a body over `--max-request-bytes` is refused with 413 before it is
parsed (by its Content-Length, or as it arrives when chunked), in the OpenAI error shape; and
a client's X-Request-Id echoed on the answer.

Pure ASGI middleware: it counts the bytes the app reads, so nothing is buffered twice.
"""
from __future__ import annotations

from starlette.requests import Request

from server.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 8 << 20     # a 128K-token prompt as JSON is ~1-2 MB


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} "
                    "bytes, --max-request-bytes).", type="invalid_request_error",
                    code="request_too_large")


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, int(max_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large(self.max_bytes).response(Request(scope))(scope, receive, send)
        seen, over, answered = 0, False, False

        async def counted():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise too_large(self.max_bytes)     # stops the app reading
            return message

        async def guarded(message):
            # the app turns a failed body read into its own error: answer 413 instead
            nonlocal answered
            if not over:
                return await send(message)
            if message["type"] == "http.response.start" and not answered:
                answered = True
                await too_large(self.max_bytes).response(Request(scope))(scope, receive, send)

        await self.app(scope, counted, guarded)


class EchoRequestId:
    """A client's X-Request-Id comes back on the answer's headers (vLLM's
    --enable-request-id-headers, here whenever one is sent), errors included; the answer's id
    carries it too (server/serving.py `request_ids`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        given = dict(scope.get("headers") or ()).get(b"x-request-id") \
            if scope["type"] == "http" else None
        if not given:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", given)]}
            await send(message)
        await self.app(scope, receive, send_with_id)
