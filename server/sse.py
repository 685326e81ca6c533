"""Server-sent events for streamed answers: ``data: <json>`` ... ``data: [DONE]`` (chat and
completions), or named ``event: <type>`` events (the Responses API), each ending in a blank
line."""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else _dumps(payload)
    return f"data: {body}\n\n"


def _dumps(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that always runs ``on_close`` when it ends, however it
    ends (finished, client gone before or during the stream, server shutdown)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                # NOTE: a generator that never started does not run its `finally` on aclose().
                await self.body_iterator.aclose()
                await self._on_close()


def sse_named_event(kind: str, payload: dict) -> str:
    """An event with its name (the Responses API's ``event: response.created``)."""
    return f"event: {kind}\ndata: {_dumps(payload)}\n\n"
