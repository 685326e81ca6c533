"""InfillServing: llama.cpp's POST /infill, the code completion editors ask for (llama.vscode,
llama.vim): the text between `input_prefix` (+ `prompt`, the cursor line's start) and
`input_suffix`, with `input_extra` files as repo context (server/fim.py), answered in llama.cpp's
own shape (`content`, `stop`, `stop_type`, token counts), streamed as `data:` chunks whose last
has `stop: true` (with llama.cpp's `timings`).

The request is a text completion underneath (server/protocol.py's CompletionRequest: the same
sampling fields, llama.cpp's samplers among them, and checks); `n_predict` is its max_tokens
(-1 or absent: until the model ends the middle or the context is full; 0: one token, as
llama.vim's cache warm-ups ask). llama.cpp's two stops for editors apply as there
(`EditorStops`): `n_indent` ends the middle where a line starts less indented than that (the
line is cut after its indentation), `t_max_predict_ms` at the end of a line once that long
has passed since the first token (`stop_type` "limit" either way). The fields that tune
llama.cpp's own slots and timing (`cache_prompt`, `id_slot`, `samplers`, `t_max_prompt_ms`,
`n_probs`, `response_fields`) are accepted and ignored (docs/api-other.md). A prompt over the
context is cut as llama.cpp cuts it (server/fim.py `FimFit`: the prefix's end, the suffix's
start, the repo context's end), `truncated` true in the answer.
"""
from __future__ import annotations

import time
from typing import Annotated, AsyncIterator, Callable

import anyio
from fastapi import Request
from pydantic import Field, StrictInt, model_validator
from starlette.responses import Response

from server.errors import invalid_request
from server.fim import FimFit, fim_prompt_ids, require_fim
from server.disconnect import run_until_disconnected
from server.generation import ChoiceResult, Generation
from server.protocol import CompletionRequest, MaxTokens, Text
from server.protocol_tools import Unsupported, _Request, _Wire
from server.serving import OpenAIServing, json_response
from server.structured import check_constrained, grammar_for

MAX_EXTRA = 256                 # input_extra chunks


class ExtraChunk(_Request):
    filename: Text = "tmp"                # llama.cpp's name for a chunk without one
    text: Text = ""


class InfillRequest(CompletionRequest):
    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA)] = []
    prompt: Text = ""                     # the cursor line's start, after input_prefix
    n_predict: Annotated[StrictInt | None, Field(ge=-1)] = None
    max_tokens: MaxTokens = None          # llama.cpp's alias of n_predict
    n_indent: Annotated[StrictInt, Field(ge=0)] = 0
    t_max_predict_ms: Annotated[StrictInt, Field(ge=0)] = 0
    suffix: Unsupported = None            # input_suffix is /infill's
    echo: Unsupported = None              # neither is in llama.cpp's answer (n_probs is
    logprobs: Unsupported = None          # accepted and ignored)

    @model_validator(mode="after")
    def _n_predict_is_max_tokens(self):
        if self.n_predict is not None and self.n_predict >= 0:
            # 0 (llama.vim warms its cache so): the prompt and the one token sampled after it
            self.max_tokens = max(self.n_predict, 1)
        elif self.n_predict is not None:
            self.max_tokens = None        # -1: until the middle ends or the context is full
        return self


class InfillTimings(_Wire):
    """llama.cpp's `timings` (llama.vscode shows them): the prompt tokens computed (not
    cached) and the tokens written, their milliseconds and rates."""
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    prompt_per_token_ms: float = 0.0
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    predicted_per_token_ms: float = 0.0
    predicted_per_second: float = 0.0

    @classmethod
    def of(cls, cached: int, prompt: int, predicted: int, seconds: tuple[float, float]
           ) -> InfillTimings:
        (p_ms, g_ms) = (1e3 * s for s in seconds)
        return cls(cache_n=cached, prompt_n=prompt, prompt_ms=p_ms,
                   prompt_per_token_ms=p_ms / prompt if prompt else 0.0,
                   prompt_per_second=1e3 * prompt / p_ms if p_ms else 0.0,
                   predicted_n=predicted, predicted_ms=g_ms,
                   predicted_per_token_ms=g_ms / predicted if predicted else 0.0,
                   predicted_per_second=1e3 * predicted / g_ms if g_ms else 0.0)


class InfillResponse(_Wire):
    """llama.cpp's /completion answer (the fields editors read)."""
    index: int = 0
    content: str
    stop: bool
    model: str
    tokens_predicted: int = 0
    tokens_evaluated: int = 0
    tokens_cached: int = 0
    truncated: bool = False
    stop_type: str = "none"               # eos | word | limit (none: not stopped yet)
    stopping_word: str = ""
    timings: InfillTimings | None = None


class InfillServing(OpenAIServing):
    done_marker = False                   # llama.cpp's stream ends with its stop: true chunk

    async def create(self, request: InfillRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        if (request.n or 1) != 1:
            raise invalid_request("/infill writes one completion (n 1).", param="n")
        extra = [(c.filename, c.text) for c in request.input_extra]
        self.check_prompt_text([request.input_prefix + request.prompt + request.input_suffix
                                + "".join(t for _, t in extra)], "input_prefix", truncated=True)
        fim = require_fim(tokenizer, "input_prefix")
        grammar = await anyio.to_thread.run_sync(grammar_for, request)
        check_constrained(grammar, request)
        fit = FimFit(self.ctx.max_model_len, -1 if request.max_tokens is None
                     else request.max_tokens)
        ids, truncated = await anyio.to_thread.run_sync(
            fim_prompt_ids, tokenizer, fim, request.input_prefix, request.input_suffix, extra,
            fit, request.prompt)
        request = request.model_copy(update={
            "stop_token_ids": [*(request.stop_token_ids or ()), *fim.ends]})
        generation = self.generation(request, [ids], self.request_ids(raw, "infill-")[1],
                                     "input_prefix", grammar)
        model = self.ctx.model_name(request.model)
        stops = lambda: EditorStops(request.n_indent, request.t_max_predict_ms)  # noqa: E731
        if request.stream:
            return await self.respond(
                raw, generation, stream=True, build=None,
                events=lambda: self._chunks(generation, model, stops(), truncated))
        return await self.answered(run_until_disconnected(
            raw, self._whole(generation, model, stops(), truncated)))

    async def _whole(self, generation: Generation, model: str, stops: EditorStops,
                     truncated: bool) -> Response:
        result = ChoiceResult(index=0)
        try:
            await generation.start()
            async for text, _ in _deltas(generation, stops, result):
                result.text += text
        finally:
            await generation.close()            # a middle the stops ended: its request too
        return json_response(_answer(generation, model, result, truncated))

    async def _chunks(self, generation: Generation, model: str, stops: EditorStops,
                      truncated: bool) -> AsyncIterator[dict]:
        result = ChoiceResult(index=0)
        async for text, _ in _deltas(generation, stops, result):
            if text:
                yield {"index": 0, "content": text, "stop": False}
        yield _answer(generation, model, result, truncated).model_dump()


class EditorStops:
    """llama.cpp's n_indent and t_max_predict_ms over a middle's text as it grows: a line
    after the first whose indentation is less than n_indent (a blank one included) ends the
    middle, cut after that indentation; so does a piece of text that ends a line once
    t_max_predict_ms have passed since the first token (never half a line)."""

    def __init__(self, n_indent: int, t_max_predict_ms: int,
                 clock: Callable[[], float] = time.monotonic):
        self._indent, self._max_s, self._clock = n_indent, t_max_predict_ms / 1000, clock
        self._text = ""
        self._line = -1                      # where the last line starts (-1: still the first)
        self._start: float | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """(the part of `text` kept, whether the middle ends here)."""
        if self._start is None:
            self._start = self._clock()
        done = len(self._text)
        self._text += text
        while True:
            if self._indent and self._line >= 0:
                rest = self._text[self._line:]
                indent = len(rest) - len(rest.lstrip(" \t"))
                if indent < len(rest) and indent < self._indent:
                    return self._text[done:self._line + indent], True
            at = self._text.find("\n", max(self._line, 0))
            if at < 0:
                break
            self._line = at + 1
        late = self._max_s and "\n" in text and self._clock() - self._start > self._max_s
        return text, bool(late)


async def _deltas(generation: Generation, stops: EditorStops,
                  result: ChoiceResult) -> AsyncIterator[tuple[str, bool]]:
    """The middle's text as it comes, (text, ended by a stop), recording in `result` how it
    ended; a stop ends the iteration (the caller closes the generation)."""
    async for delta in generation.deltas():
        text, stopped = stops.push(delta.text)
        if stopped:
            result.finish_reason, result.stop_string = "length", None
            await generation.end("length")
            yield text, True
            return
        result.finish_reason = delta.finish_reason or result.finish_reason
        result.stop_string = delta.stop_string or result.stop_string
        yield text, False


def _answer(generation: Generation, model: str, result: ChoiceResult,
            truncated: bool) -> InfillResponse:
    usage = generation.usage()
    kind = {"stop": "word" if result.stop_string else "eos", "length": "limit"}
    cached = usage.prompt_tokens_details.cached_tokens
    timings = InfillTimings.of(cached, usage.prompt_tokens - cached, usage.completion_tokens,
                               generation.streams[0].timings())
    return InfillResponse(
        content=result.text, stop=True, model=model, truncated=truncated, timings=timings,
        tokens_predicted=usage.completion_tokens, tokens_evaluated=usage.prompt_tokens,
        tokens_cached=usage.prompt_tokens_details.cached_tokens,
        stop_type=kind.get(result.finish_reason, "none"),
        stopping_word=result.stop_string or "")
