"""Generation: the engine requests behind one HTTP request (n choices, maybe several prompts).

``start()`` admits every choice (all or none: if one is refused, the others are aborted);
``deltas()`` merges the choices' deltas as they come; ``collect()`` runs them to the end;
``close()`` aborts whatever has not finished and must always be called (``finally``).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio

from engine.protocol import EngineError
from server.choice_stream import ChoiceDelta, ChoiceStream
from server.errors import answer_for
from server.metrics import ServerMetrics
from server.protocol_responses import PromptTokensDetails, UsageInfo

_DONE = object()


def rejection_reason(exc: EngineError) -> str:
    return answer_for(exc).reason


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    logprobs: list = field(default_factory=list)    # (sampled, alternatives) per token
    finish_reason: str | None = None
    stop_string: str | None = None                  # the stop string that ended it


class Generation:
    def __init__(self, streams: list[ChoiceStream], metrics: ServerMetrics):
        self.streams = streams
        self._metrics = metrics
        self._pumps: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            await self._start_all()
        except BaseException as exc:
            if isinstance(exc, EngineError):
                self._metrics.record_rejection(rejection_reason(exc))
            await self.close()
            raise

    async def _start_all(self) -> None:
        if len(self.streams) == 1:
            await self.streams[0].start()
            return
        tasks = [asyncio.ensure_future(s.start()) for s in self.streams]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            await _cancel(tasks)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all choices, interleaved in arrival order."""
        if len(self.streams) == 1:
            async for delta in self.streams[0].deltas():
                yield delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.ensure_future(_pump(s, queue)) for s in self.streams]
        remaining = len(self._pumps)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def collect(self) -> list[ChoiceResult]:
        """Run every choice to its end (non-streaming responses)."""
        results = {s.spec.index: ChoiceResult(s.spec.index) for s in self.streams}
        async for delta in self.deltas():
            result = results[delta.index]
            result.text += delta.text
            result.logprobs.extend(delta.logprobs)
            result.finish_reason = delta.finish_reason or result.finish_reason
            result.stop_string = delta.stop_string or result.stop_string
        return [results[i] for i in sorted(results)]

    def usage(self) -> UsageInfo:
        """Prompt tokens once per prompt (not per choice); completion tokens over all choices."""
        prompts = {s.spec.prompt_index: len(s.spec.prompt_token_ids) for s in self.streams}
        prompt_tokens = sum(prompts.values())
        completion_tokens = sum(s.num_output_tokens for s in self.streams)
        # a prompt's cached tokens: those of its choice that computed the most of it
        cached: dict[int, int] = {}
        for s in self.streams:
            i = s.spec.prompt_index
            cached[i] = min(cached.get(i, s.num_cached_tokens), s.num_cached_tokens)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(
                             cached_tokens=sum(cached.values())))

    async def end(self, reason: str) -> None:
        """End every unfinished choice now as `reason` (ChoiceStream.end)."""
        with anyio.CancelScope(shield=True):
            for stream in self.streams:
                await stream.end(reason)

    async def close(self) -> None:
        """Abort every unfinished engine request; safe to call more than once, even while
        the surrounding task is being cancelled (client disconnect)."""
        with anyio.CancelScope(shield=True):
            await _cancel(self._pumps)
            for stream in self.streams:
                await stream.close()


async def _pump(stream: ChoiceStream, queue: asyncio.Queue) -> None:
    try:
        async for delta in stream.deltas():
            queue.put_nowait(delta)
        queue.put_nowait(_DONE)
    except Exception as exc:                  # handed to the consumer, raised there
        queue.put_nowait(exc)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()
    if tasks:
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)

