"""OpenAIServing: the request flow shared by chat and completions.

prompt token ids -> context check -> SamplingParams per choice -> Generation -> either an SSE
stream (``EventStreamResponse``) or one JSON body, with client disconnects aborting the engine
requests on both paths. Subclasses only build prompts and format chunks / responses.
"""
from __future__ import annotations

import logging
import math
import uuid
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from engine.admission import check_choices
from engine.outputs import TokenLogprob
from engine.protocol import EngineError, TooManyChoicesError
from scheduler.sampling_params import GrammarSpec
from server.choice_stream import ChoiceSpec, ChoiceStream, RequestFailed
from server.context import ServerContext
from server.disconnect import ClientDisconnected, run_until_disconnected
from server.errors import (APIError, answer_for, context_length_exceeded, from_engine_error,
                           internal_error, invalid_request, request_failed)
from server.generation import ChoiceResult, Generation
from server.protocol_responses import PromptLogprob, PromptLogprobs
from server.sampling import Request as SamplingRequest
from server.sampling import (bad_words_token_ids, build_sampling_params, dry_breaker_ids,
                             resolve_max_tokens, stop_strings, truncate_prompt)
from server.sse import DONE, EventStreamResponse, sse_event, sse_named_event
from server.structured import logit_bias_pairs

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128

MIN_LOGPROB = -9999.0          # JSON has no -inf
TRUNCATE_TEXT_FACTOR = 8       # truncate_prompt_tokens: texts up to 8 contexts are cut
CLIENT_CLOSED_REQUEST = 499    # nginx's status for "client went away" (nobody reads it)


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) else max(value, MIN_LOGPROB)


def to_api_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestFailed):
        return request_failed(str(exc))
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    logger.error("request failed", exc_info=exc)
    return internal_error()


def json_response(body: BaseModel) -> Response:
    return Response(content=body.model_dump_json(), media_type="application/json")


class OpenAIServing:
    named_events = False        # streams as named events (Responses, Messages), no [DONE]
    done_marker = True          # a `data:` stream ends with [DONE] (llama.cpp's /infill: not)

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    def check_prompt_text(self, texts: list[str], param: str, truncated: bool = False) -> None:
        """400 at once, before tokenizing, for a text that cannot fit the context whatever its
        tokens (its bytes over the longest token's); with truncate_prompt_tokens, for a text
        over TRUNCATE_TEXT_FACTOR times that (tokenizing holds the GIL: a body limit's worth
        of text takes seconds)."""
        ctx = self.ctx
        bound = max((ctx.tokenizer.min_tokens(t) for t in texts), default=0)
        if bound >= ctx.max_model_len * (TRUNCATE_TEXT_FACTOR if truncated else 1):
            ctx.metrics.record_rejection("context_length")
            raise context_length_exceeded(ctx.max_model_len, f"at least {bound}", None, param)

    @staticmethod
    def request_ids(raw: Request, prefix: str) -> tuple[str, str]:
        """(the answer's id, the base of its engine requests' ids): `prefix` and the client's
        X-Request-Id (vLLM's: a trace id that shows in the answer and in the log), or a fresh
        id; a client's id gets a nonce in the engine's ids, which must be unique while a
        client may send one id twice at once."""
        given = raw.headers.get(REQUEST_ID_HEADER, "")
        if 0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
            return prefix + given, f"{prefix}{given}-{uuid.uuid4().hex[:8]}"
        fresh = prefix + uuid.uuid4().hex
        return fresh, fresh

    def check_admissible(self, choices: int) -> None:
        """400 for a request that could never be admitted (its choices, each an engine
        request, all wait together): 429 means "not now", this means "never"."""
        try:
            check_choices(choices, self.ctx.max_waiting)
        except TooManyChoicesError as exc:
            self.ctx.metrics.record_rejection(answer_for(exc).reason)
            raise from_engine_error(exc) from None

    def generation(self, request: SamplingRequest, prompts: list[list[int]],
                   request_id: str, prompt_param: str,
                   grammar: GrammarSpec | None = None, chat: bool = False) -> Generation:
        """One engine request per (prompt, choice): ids f"{request_id}-{index}", seed + i;
        `grammar`: what every choice's output must follow (server/structured.py), after a
        reasoning model's thinking where `chat` (a chat answer, which the reasoning parser
        splits)."""
        ctx = self.ctx
        tokenizer = ctx.tokenizer
        request = ctx.with_sampling_defaults(request)
        n = request.n or 1
        self.check_admissible(n * len(prompts))
        stops = stop_strings(request)
        bias = logit_bias_pairs(request, tokenizer.vocab_size)
        words = bad_words_token_ids(request.bad_words or (), tokenizer)
        breakers = dry_breaker_ids(request, tokenizer)
        marks = ctx.reasoning_marks if chat and grammar is not None else None
        streams = []
        for prompt_index, prompt_ids in enumerate(prompts):
            if not prompt_ids:
                raise invalid_request("The prompt must contain at least one token.",
                                      param=prompt_param)
            prompt_ids = truncate_prompt(prompt_ids, request.truncate_prompt_tokens,
                                         ctx.max_model_len, request.requested_max_tokens())
            try:
                max_tokens = resolve_max_tokens(request.requested_max_tokens(), len(prompt_ids),
                                                ctx.max_model_len, prompt_param)
            except APIError:
                ctx.metrics.record_rejection("context_length")
                raise
            if request.requested_max_tokens() is None:      # the model's default, if any
                max_tokens = min(max_tokens, ctx.sampling_defaults.get("max_tokens", max_tokens))
            for i in range(n):
                index = prompt_index * n + i
                params = build_sampling_params(request, max_tokens=max_tokens, seed_offset=i,
                                               vocab_size=tokenizer.vocab_size,
                                               grammar=grammar, logit_bias=bias,
                                               bad_words=words, reasoning=marks,
                                               lora=ctx.lora_of(request.model),
                                               dry_breakers=breakers)
                spec = ChoiceSpec(index=index, prompt_index=prompt_index,
                                  request_id=f"{request_id}-{index}", prompt_token_ids=prompt_ids,
                                  params=params, stop=stops,
                                  include_stop=bool(request.include_stop_str_in_output),
                                  skip_special_tokens=request.skip_special_tokens is not False)
                streams.append(ChoiceStream(ctx.engine, tokenizer, ctx.metrics, spec))
        return Generation(streams, ctx.metrics)

    async def respond(self, raw: Request, generation: Generation, *, stream: bool,
                      events: Callable[[], AsyncIterator[BaseModel]],
                      build: Callable[[list[ChoiceResult]], BaseModel]) -> Response:
        """Stream ``events()`` as SSE, or collect every choice and ``build`` one JSON body.
        Admission errors (429, 503, ...) come back as HTTP statuses on both paths."""
        async def answer() -> Response:
            if stream:
                await run_until_disconnected(raw, generation.start())
                return EventStreamResponse(self._event_stream(generation, events()),
                                           on_close=generation.close)
            return json_response(build(await self.collect(raw, generation)))
        return await self.answered(answer())

    @staticmethod
    async def answered(answer: Awaitable[Response]) -> Response:
        """`answer`'s response, or what a request's end means over HTTP: the client gone, 499
        (nobody reads it); a request that failed in the engine, a 500 in the error shape."""
        try:
            return await answer
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except RequestFailed as exc:
            raise request_failed(str(exc)) from None

    async def collect(self, raw: Request, generation: Generation) -> list[ChoiceResult]:
        """Every choice of `generation` to its end (ClientDisconnected when `raw`'s client
        leaves first; the engine's requests are closed either way)."""
        return await run_until_disconnected(raw, self._run_to_end(generation))

    @staticmethod
    async def _run_to_end(generation: Generation) -> list[ChoiceResult]:
        try:
            await generation.start()
            return await generation.collect()
        finally:
            await generation.close()

    async def _event_stream(self, generation: Generation,
                            events: AsyncIterator[BaseModel | dict]) -> AsyncIterator[str]:
        """`data:` events ending in [DONE]; or, with `named_events`, each event named by its
        type and no [DONE] (the events end the stream themselves, failures included)."""
        try:
            async for event in events:
                yield sse_named_event(event["type"], event) if self.named_events \
                    else sse_event(event)
        except Exception as exc:               # mid-stream: an error event, then [DONE]
            if self.named_events:
                raise
            yield sse_event(to_api_error(exc).body())
        finally:
            await generation.close()
        if not self.named_events and self.done_marker:
            yield DONE

    # ---------------------------------------------------------------- shared formatting
    def prompt_logprobs(self, request: SamplingRequest,
                        stream: ChoiceStream) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs of a choice (None unless asked): per prompt token after the
        first, its own entry and the top k alternatives."""
        if request.prompt_logprobs is None or stream.prompt_logprobs is None:
            return None
        k = request.prompt_logprobs
        body: PromptLogprobs = []
        for entry in stream.prompt_logprobs:
            if entry is None:
                body.append(None)
                continue
            token, top = entry
            found = {str(t.token_id): PromptLogprob(logprob=clamp_logprob(t.logprob),
                                                    rank=t.rank, decoded_token=self.token_text(t))
                     for t in (token, *top[:k])}
            body.append(found)
        return body

    def token_text(self, token: TokenLogprob) -> str:
        return self.ctx.tokenizer.token_text(token.token_id)

    def token_bytes(self, token: TokenLogprob) -> list[int]:
        return self.ctx.tokenizer.token_bytes(token.token_id)
