"""InfillServing: llama.cpp's POST /infill, the code completion editors ask for (llama.vscode,
llama.vim): the text between `input_prefix` (+ `prompt`, the cursor line's start) and
`input_suffix`, with `input_extra` files as repo context (server/fim.py), answered in llama.cpp's
own shape (server/llamacpp_native.py: its fields, stops for editors, `timings`, `n_probs`). A
prompt over the context is cut as llama.cpp cuts it (server/fim.py `FimFit`: the prefix's end,
the suffix's start, the repo context's end), `truncated` true in the answer.
"""
from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import Request
from pydantic import Field
from starlette.responses import Response

from server.errors import invalid_request
from server.fim import FimFit, fim_prompt_ids, require_fim
from server.llamacpp_native import NativeRequest
from server.protocol import Text
from server.protocol_tools import Unsupported, _Request
from server.serving_native import NativeServing
from server.structured import check_constrained, grammar_for

MAX_EXTRA = 256                 # input_extra chunks


class ExtraChunk(_Request):
    filename: Text = "tmp"                # llama.cpp's name for a chunk without one
    text: Text = ""


class InfillRequest(NativeRequest):
    input_prefix: Text = ""
    input_suffix: Text = ""
    input_extra: Annotated[list[ExtraChunk], Field(max_length=MAX_EXTRA)] = []
    prompt: Text = ""                     # the cursor line's start, after input_prefix
    suffix: Unsupported = None            # input_suffix is /infill's


class InfillServing(NativeServing):
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
        return await self.native(raw, request, generation, self.ctx.model_name(request.model),
                                 truncated)
