"""InfillServing: llama.cpp's POST /infill, the code completion editors ask for (llama.vscode,
llama.vim): the text between `input_prefix` (+ `prompt`, the cursor line's start) and
`input_suffix`, with `input_extra` files as repo context (server/fim.py), answered in llama.cpp's
own shape (`content`, `stop`, `stop_type`, token counts), streamed as `data:` chunks whose last
has `stop: true`.

The request is a text completion underneath (server/protocol.py's CompletionRequest: the same
sampling fields, llama.cpp's samplers among them, and checks); `n_predict` is its max_tokens
(-1 or absent: until the model ends the middle or the context is full). llama.cpp's fields
that tune its own slots and timing (`cache_prompt`, `id_slot`, `samplers`, `t_max_prompt_ms`,
`t_max_predict_ms`, `n_indent`, `n_probs`, `response_fields`) are accepted and ignored
(docs/api.md).
"""
from __future__ import annotations

import uuid
from typing import Annotated, AsyncIterator

import anyio
from fastapi import Request
from pydantic import Field, StrictInt, model_validator
from starlette.responses import Response

from server.errors import invalid_request
from server.fim import fim_prompt_ids, require_fim
from server.generation import ChoiceResult, Generation
from server.protocol import CompletionRequest, MaxTokens, Text
from server.protocol_tools import Unsupported, _Request, _Wire
from server.serving import OpenAIServing
from server.structured import check_constrained, grammar_for

MAX_EXTRA = 256                 # input_extra chunks


class ExtraChunk(_Request):
    filename: Text = ""
    text: Text = ""


class InfillRequest(CompletionRequest):
    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA)] = []
    prompt: Text = ""                     # the cursor line's start, after input_prefix
    n_predict: Annotated[StrictInt | None, Field(ge=-1)] = None
    max_tokens: MaxTokens = None          # llama.cpp's alias of n_predict
    suffix: Unsupported = None            # input_suffix is /infill's
    echo: Unsupported = None              # neither is in llama.cpp's answer (n_probs is
    logprobs: Unsupported = None          # accepted and ignored)

    @model_validator(mode="after")
    def _n_predict_is_max_tokens(self):
        if self.n_predict is not None and self.n_predict > 0:
            self.max_tokens = self.n_predict
        elif self.n_predict is not None:
            self.max_tokens = None        # 0 / -1: until the middle ends or the context is full
        return self


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


class InfillServing(OpenAIServing):
    done_marker = False                   # llama.cpp's stream ends with its stop: true chunk

    async def create(self, request: InfillRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        if (request.n or 1) != 1:
            raise invalid_request("/infill writes one completion (n 1).", param="n")
        prefix = request.input_prefix + request.prompt
        extra = [(c.filename, c.text) for c in request.input_extra]
        self.check_prompt_text([prefix + request.input_suffix + "".join(t for _, t in extra)],
                               "input_prefix")
        fim = require_fim(tokenizer, "input_prefix")
        grammar = await anyio.to_thread.run_sync(grammar_for, request)
        check_constrained(grammar, request)
        ids = await anyio.to_thread.run_sync(fim_prompt_ids, tokenizer, fim, prefix,
                                             request.input_suffix, extra)
        request = request.model_copy(update={
            "stop_token_ids": [*(request.stop_token_ids or ()), *fim.ends]})
        generation = self.generation(request, [ids], f"infill-{uuid.uuid4().hex}",
                                     "input_prefix", grammar)
        model = self.ctx.model_name(request.model)
        return await self.respond(
            raw, generation, stream=bool(request.stream),
            events=lambda: self._chunks(generation, model),
            build=lambda results: _answer(generation, model, results[0]))

    async def _chunks(self, generation: Generation, model: str) -> AsyncIterator[dict]:
        last = ChoiceResult(index=0)
        async for delta in generation.deltas():
            if delta.text:
                yield {"index": 0, "content": delta.text, "stop": False}
            last.finish_reason = delta.finish_reason or last.finish_reason
            last.stop_string = delta.stop_string or last.stop_string
        yield _answer(generation, model, last).model_dump()


def _answer(generation: Generation, model: str, result: ChoiceResult) -> InfillResponse:
    usage = generation.usage()
    kind = {"stop": "word" if result.stop_string else "eos", "length": "limit"}
    return InfillResponse(
        content=result.text, stop=True, model=model,
        tokens_predicted=usage.completion_tokens, tokens_evaluated=usage.prompt_tokens,
        tokens_cached=usage.prompt_tokens_details.cached_tokens,
        stop_type=kind.get(result.finish_reason, "none"),
        stopping_word=result.stop_string or "")
