"""Race a non-streaming request's work against the client going away."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

import anyio
from starlette.requests import Request

T = TypeVar("T")
POLL_INTERVAL_S = 0.25


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def run_until_disconnected(request: Request, work: Awaitable[T],
                                 poll_interval_s: float = POLL_INTERVAL_S) -> T:
    """Await ``work``; if the client disconnects first, cancel it (its ``finally`` aborts the
    engine requests) and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_interval_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
