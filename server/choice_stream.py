"""ChoiceStream: one engine request seen as text deltas (detokenized, stop strings applied).

One OpenAI choice is one engine request. The stream turns each ``RequestOutput`` into a
:class:`ChoiceDelta`, records the request's metrics, aborts the engine request when a stop string
ends it early, and aborts it when closed before the engine finished (client gone).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from engine.outputs import RequestOutput, TokenLogprob
from engine.protocol import EngineClient, EngineError
from scheduler.sampling_params import SamplingParams
from server.detokenizer import Decoder, IncrementalDetokenizer
from server.metrics import ServerMetrics
from server.stats_log import request_line
from server.stop_checker import StopChecker

logger = logging.getLogger(__name__)

Logprobs = tuple[tuple[TokenLogprob, tuple[TokenLogprob, ...]], ...]


class RequestFailed(Exception):
    """The engine accepted the request and then failed it (finish_reason "error")."""


@dataclass(frozen=True)
class ChoiceSpec:
    index: int                      # choice index in the response
    prompt_index: int               # which prompt (completions accept several)
    request_id: str                 # engine request id
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    include_stop: bool = False          # the matched stop string stays in the text (vLLM's)
    skip_special_tokens: bool = True    # special tokens left out of the text


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str
    logprobs: Logprobs = ()         # one entry per new token when logprobs were asked
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")


class ChoiceStream:
    """Drives one engine request: ``await start()`` once, then iterate ``deltas()``."""

    def __init__(self, engine: EngineClient, tokenizer: Decoder, metrics: ServerMetrics,
                 spec: ChoiceSpec):
        self.spec = spec
        self._engine = engine
        self._metrics = metrics
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, spec.prompt_token_ids, skip_special_tokens=spec.skip_special_tokens)
        self._stop = StopChecker(spec.stop, include=spec.include_stop)
        self._outputs: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._arrival = time.monotonic()
        self._last_token_time: float | None = None
        self._first_token_time: float | None = None
        self._prompt_start: float | None = None     # when the engine first scheduled it
        self._prompt_counted = False
        self.started = False
        self.finished = False
        self.num_output_tokens = 0
        self.output_token_ids: list[int] = []   # those counted (llama.cpp's return_tokens)
        self.num_cached_tokens = 0          # prompt tokens the prefix cache held
        self.embedding: tuple[float, ...] | None = None    # an embedding request's
        self.prompt_logprobs: Logprobs | None = None    # with the first output, when asked

    async def start(self) -> None:
        """Submit and wait for the first output, so admission errors surface before any HTTP
        response starts (QueueFullError, EngineNotReadyError, EngineDeadError, ...)."""
        self._outputs = self._engine.generate(self.spec.request_id, self.spec.prompt_token_ids,
                                              self.spec.params)
        self.started = True
        try:
            first = await anext(self._outputs, None)
        except EngineError:
            self.finished = True                 # refused: nothing to abort, nothing to count
            raise
        if first is None:
            raise RequestFailed("the engine returned no output")
        self._first = first
        self.prompt_logprobs = first.prompt_logprobs

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        output, self._first = self._first, None
        while output is not None:
            delta = await self._on_output(output)
            if delta.text or delta.logprobs or delta.finish_reason:
                yield delta
            if self.finished:
                return
            try:
                output = await anext(self._outputs, None)
            except EngineError:                  # e.g. the step loop died mid-request
                self._finish("error", None)
                raise
        self._finish("error", None)
        raise RequestFailed("the engine stream ended before the request finished")

    async def close(self) -> None:
        """Close the engine's iterator; abort the request unless it finished (idempotent)."""
        if not self.started:
            return
        if self.finished:
            await self._close_outputs()
            return
        self._finish("abort", None)
        await self._abort_engine()

    async def end(self, reason: str) -> None:
        """End the request now as `reason` (the server's own stop, e.g. /infill's editor
        stops: counted as that, not as an abort)."""
        if self.started and not self.finished:
            self._finish(reason, None)
            await self._abort_engine()

    async def _on_output(self, out: RequestOutput) -> ChoiceDelta:
        ids = out.new_token_ids
        if out.finish_reason == "stop" and ids and not self.spec.include_stop:
            ids = ids[:-1]      # the EOS or stop_token_id that ended it: counted, not written
        text, kept = self._push_tokens(ids)
        if out.finished and not self._stop.stopped:
            text += self._stop.push(self._detokenizer.flush())
        if self._stop.stopped:
            # (a step of several tokens, a decode's drafts: those after the stop string's
            # last are neither counted nor given logprobs, as one token a step would end)
            self._record_tokens(out, kept)
            self._finish("stop", out)
            if not out.finished:
                await self._abort_engine()
            return ChoiceDelta(self.spec.index, text, out.new_logprobs[:kept], "stop",
                               self._stop.matched)
        self._record_tokens(out, len(out.new_token_ids))
        if not out.finished:
            return ChoiceDelta(self.spec.index, text, out.new_logprobs)
        text += self._stop.flush()
        if out.finish_reason == "error":
            self._finish("error", out)
            raise RequestFailed(out.error or "unknown engine error")
        if out.finish_reason == "abort":
            self._finish("abort", out)
            raise RequestFailed("the request was aborted by the engine")
        reason = out.finish_reason or "stop"
        self._finish(reason, out)
        return ChoiceDelta(self.spec.index, text, out.new_logprobs, reason)

    def _push_tokens(self, ids) -> tuple[str, int]:
        """The text `ids` add, cut at a stop string, and how many of them it took: token by
        token where several arrive at once and a stop string could end them early."""
        if len(ids) < 2 or not self._stop.watching:
            return self._stop.push(self._detokenizer.push(ids)), len(ids)
        pieces = []
        for i, token in enumerate(ids):
            pieces.append(self._stop.push(self._detokenizer.push([token])))
            if self._stop.stopped:
                return "".join(pieces), i + 1
        return "".join(pieces), len(ids)

    def _record_tokens(self, out: RequestOutput, count: int) -> None:
        now = time.monotonic()
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.embedding is not None:
            self.embedding = out.embedding
        if not self._prompt_counted:
            self._prompt_counted = True
            self._metrics.count_prompt(out.num_prompt_tokens or len(self.spec.prompt_token_ids))
        if not count:
            return
        self.output_token_ids.extend(out.new_token_ids[:count])
        if self._last_token_time is None:
            self._first_token_time = now
            self._prompt_start = out.first_scheduled_time or self._arrival_of(out)
            self._metrics.time_to_first_token.observe(max(0.0, now - self._arrival_of(out)))
        else:
            self._metrics.inter_token_latency.observe(now - self._last_token_time)
        self._last_token_time = now
        self.num_output_tokens += count
        self._metrics.count_generated(count)

    def timings(self) -> tuple[float, float]:
        """(seconds from the prompt's first scheduling to the first token, from the first
        token to the last): llama.cpp's prompt and generation times (0 before a token)."""
        if self._first_token_time is None or self._prompt_start is None:
            return 0.0, 0.0
        return (max(0.0, self._first_token_time - self._prompt_start),
                self._last_token_time - self._first_token_time)

    def _arrival_of(self, out: RequestOutput | None) -> float:
        # NOTE: the engine stamps arrival with time.monotonic() in this process, when its
        # thread takes the request; the server saw it earlier. Latencies start at the earlier.
        if out is not None and out.arrival_time:
            return min(self._arrival, out.arrival_time)
        return self._arrival

    def _finish(self, reason: str, out: RequestOutput | None) -> None:
        if self.finished:
            return
        self.finished = True
        queue_s = None
        if out is not None and out.first_scheduled_time is not None and out.arrival_time:
            queue_s = out.first_scheduled_time - out.arrival_time
        now, arrival = time.monotonic(), self._arrival_of(out)
        self._metrics.record_finished(reason, e2e_s=now - arrival, queue_s=queue_s)
        if self._metrics.log_requests:
            logger.info("%s", request_line(
                self.spec.request_id, reason, len(self.spec.prompt_token_ids),
                self.num_cached_tokens, self.num_output_tokens, arrival,
                self._first_token_time, now))

    async def _abort_engine(self) -> None:
        # Closing the engine's iterator aborts the request; the explicit abort makes sure.
        await self._close_outputs()
        try:
            await self._engine.abort(self.spec.request_id)
        except Exception:
            logger.exception("aborting request %s failed", self.spec.request_id)

    async def _close_outputs(self) -> None:
        aclose = getattr(self._outputs, "aclose", None)
        if aclose is None:
            return
        try:
            await aclose()
        except Exception:
            logger.exception("closing the outputs of request %s failed", self.spec.request_id)
