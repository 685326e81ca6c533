"""BackgroundRuns: the Responses API's background responses (`background: true`), run as tasks
on the server's event loop, independent of the HTTP request that created them.

A run records its stream events as the generation makes them, so any number of clients can
follow it from any point (`GET /v1/responses/{id}?stream=true&starting_after=N`, or the
creating request with `stream: true`); a client leaving does not stop it, `POST
/v1/responses/{id}/cancel` does. Until it ends, GET answers its response as built so far
(`snapshot`); when it ends, the response is in the response store like any other. The events
of the last `KEEP_ENDED` ended runs are kept for late followers.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, AsyncIterator, Awaitable, Callable

logger = logging.getLogger(__name__)

KEEP_ENDED = 64

Event = dict[str, Any]


class BackgroundRun:
    """One background response: its events so far, its task, and its response as built."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.events: list[Event] = []
        self.ended = False
        self.task: asyncio.Task | None = None
        self._snapshot = snapshot
        self._wake = asyncio.Event()

    def snapshot(self) -> dict[str, Any]:
        """The response as built so far."""
        return self._snapshot()

    def add(self, event: Event) -> None:
        self.events.append(event)
        self._notify()

    def end(self) -> None:
        self.ended = True
        self._notify()

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def follow(self, starting_after: int | None = None) -> AsyncIterator[Event]:
        """The events whose sequence_number is past `starting_after` (None: all), as they
        come, until the run ends."""
        at = 0 if starting_after is None else sum(
            1 for e in self.events if e["sequence_number"] <= starting_after)
        while True:
            wake = self._wake
            while at < len(self.events):
                event = self.events[at]
                at += 1
                if starting_after is None or event["sequence_number"] > starting_after:
                    yield event
            if self.ended:
                return
            await wake.wait()


class BackgroundRuns:
    """The running background responses, and the events of the last ended ones."""

    def __init__(self, keep_ended: int = KEEP_ENDED):
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()
        self.keep_ended = keep_ended

    def start(self, response_id: str, snapshot: Callable[[], dict[str, Any]],
              work: Callable[[BackgroundRun], Awaitable[None]]) -> BackgroundRun:
        """Run `work(run)` as a task; it adds the events, and the run ends when it returns."""
        run = BackgroundRun(snapshot)
        self._runs[response_id] = run

        async def main() -> None:
            try:
                await work(run)
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the work stores its own failure
                logger.exception("background response %s failed", response_id)
            finally:
                run.end()
                self._forget_ended()

        run.task = asyncio.ensure_future(main())
        return run

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    async def cancel(self, response_id: str) -> bool:
        """Stop the run if it is still going, and wait for it to end (its work stores the
        response as cancelled). False when there is no such run."""
        run = self._runs.get(response_id)
        if run is None:
            return False
        if run.task is not None and not run.task.done():
            run.task.cancel()
            await asyncio.wait([run.task])
        return True

    def running(self) -> int:
        return sum(1 for r in self._runs.values() if not r.ended)

    def _forget_ended(self) -> None:
        ended = [rid for rid, r in self._runs.items() if r.ended]
        for rid in ended[:max(0, len(ended) - self.keep_ended)]:
            del self._runs[rid]
