"""llama.cpp's native text completion: POST /completion (and /completions at the root, its
alias there), in llama.cpp's own request fields and answer shape (server/llamacpp_native.py).

`prompt` is a text, token ids, or a list of either; several prompts are answered as a JSON
array, one answer each (`index` its prompt's), and stream one at a time only (a 400 otherwise).
`NativeServing` is the answer both native routes share (/infill's too): one JSON body, or
`data:` chunks of `content` (with its tokens' `completion_probabilities` where n_probs asks)
whose last has `stop: true`, the counts and `timings`, and no [DONE] (llama.cpp writes none).
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

import anyio
from fastapi import Request
from starlette.responses import Response

from server.disconnect import run_until_disconnected
from server.errors import invalid_request
from server.generation import ChoiceResult, Generation
from server.llamacpp_native import (EditorStops, NativeRequest, TokenProb, TokenProbs,
                                    native_answer, native_deltas)
from server.serving import OpenAIServing, clamp_logprob
from server.serving_completion import prompt_token_ids
from server.structured import check_constrained, grammar_for


class NativeServing(OpenAIServing):
    done_marker = False                   # llama.cpp's stream ends with its stop: true chunk

    def probs(self, entries) -> list[TokenProbs]:
        """llama.cpp's `completion_probabilities` of log-probability entries."""
        def one(t) -> dict:
            return {"id": t.token_id, "token": self.token_text(t), "bytes": self.token_bytes(t),
                    "logprob": clamp_logprob(t.logprob)}
        return [TokenProbs(**one(sampled), top_logprobs=[TokenProb(**one(t)) for t in top])
                for sampled, top in entries]

    async def native(self, raw: Request, request: NativeRequest, generation: Generation,
                     model: str, truncated: bool) -> Response:
        """Generation's one stream answered whole or streamed (request.stream)."""
        if request.stream:
            return await self.respond(
                raw, generation, stream=True, build=None,
                events=lambda: self._chunks(request, generation, model, truncated))
        return await self.answered(run_until_disconnected(raw, self._json(
            self.whole(request, generation, model, truncated))))

    @staticmethod
    async def _json(answer) -> Response:
        body = (await answer).model_dump_json(exclude_none=True)
        return Response(content=body, media_type="application/json")

    async def whole(self, request: NativeRequest, generation: Generation, model: str,
                    truncated: bool, index: int = 0):
        """The answer once the text has ended (its stream started here)."""
        result, entries = ChoiceResult(index=0), []
        try:
            await generation.start()
            async for text, logprobs in native_deltas(generation, self.stops(request), result):
                result.text += text
                entries.extend(logprobs)
        finally:
            await generation.close()            # a text the stops ended: its request too
        return self._last(request, generation, model, result, truncated, entries, index)

    async def _chunks(self, request: NativeRequest, generation: Generation, model: str,
                      truncated: bool) -> AsyncIterator[dict]:
        result, entries = ChoiceResult(index=0), []
        async for text, logprobs in native_deltas(generation, self.stops(request), result):
            entries.extend(logprobs)
            if text or logprobs:
                chunk = {"index": 0, "content": text, "stop": False}
                if request.n_probs:
                    chunk["completion_probabilities"] = [
                        p.model_dump() for p in self.probs(logprobs)]
                yield chunk
        yield self._last(request, generation, model, result, truncated, entries,
                         stream=True).model_dump(exclude_none=True)

    def _last(self, request: NativeRequest, generation: Generation, model: str,
              result: ChoiceResult, truncated: bool, entries: list, index: int = 0,
              stream: bool = False):
        # streamed, each chunk carried its own tokens' probabilities already
        probs = self.probs(entries) if request.n_probs and not stream else None
        tokens = list(generation.streams[0].output_token_ids) if request.return_tokens else []
        return native_answer(generation, model, result, truncated, probs, tokens, index)

    @staticmethod
    def stops(request: NativeRequest) -> EditorStops:
        return EditorStops(request.n_indent, request.t_max_predict_ms)


class NativeCompletionServing(NativeServing):
    async def create(self, request: NativeRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        if (request.n or 1) != 1:
            raise invalid_request("/completion writes one completion a prompt (n 1).",
                                  param="n")
        prompt = request.prompt
        # one text or one id list, else a list of them (prompt_token_ids reads it so)
        batch = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
            else prompt
        if request.stream and len(batch) > 1:
            raise invalid_request("Streaming answers one prompt at a time; send the prompts "
                                  "separately or without stream.", param="prompt")
        self.check_admissible(len(batch))
        if batch and isinstance(batch[0], str):
            self.check_prompt_text(batch, "prompt",
                                   truncated=request.truncate_prompt_tokens is not None)
        grammar = await anyio.to_thread.run_sync(grammar_for, request)
        check_constrained(grammar, request)
        prompts = await anyio.to_thread.run_sync(prompt_token_ids, prompt, tokenizer)
        base = self.request_ids(raw, "cmpl-")[1]
        generations = [self.generation(request, [ids], f"{base}-p{i}", "prompt", grammar)
                       for i, ids in enumerate(prompts)]
        model = self.ctx.model_name(request.model)
        if len(generations) == 1:
            return await self.native(raw, request, generations[0], model,
                                     _cut(generations[0], prompts[0]))
        cuts = [_cut(g, ids) for g, ids in zip(generations, prompts)]
        return await self.answered(run_until_disconnected(raw, self._all(
            request, generations, model, cuts)))

    async def _all(self, request: NativeRequest, generations: list[Generation],
                   model: str, cuts: list[bool]) -> Response:
        """Several prompts at once: a JSON array of their answers, in the prompts' order."""
        tasks = [asyncio.ensure_future(self.whole(request, g, model, cuts[i], i))
                 for i, g in enumerate(generations)]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            # one failed (or the client left): the others end too, each closing its own
            # generation as it unwinds; wait for them before answering
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
        body = json.dumps([a.model_dump(exclude_none=True) for a in answers])
        return Response(content=body, media_type="application/json")


def _cut(generation: Generation, prompt: list[int]) -> bool:
    """Whether truncate_prompt_tokens cut the prompt (llama.cpp's `truncated`)."""
    return len(generation.streams[0].spec.prompt_token_ids) < len(prompt)
