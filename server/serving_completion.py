"""CompletionServing: POST /v1/completions (legacy text completions)."""
from __future__ import annotations

import time
from typing import AsyncIterator

import anyio
from fastapi import Request
from starlette.responses import Response

from server.choice_stream import ChoiceStream, Logprobs
from server.errors import invalid_request
from server.fim import fim_prompt_ids, require_fim
from server.generation import ChoiceResult, Generation
from server.protocol import CompletionRequest
from server.protocol_responses import (CompletionChoice, CompletionLogprobs, CompletionResponse,
                                       CompletionStreamResponse)
from server.sampling import check_token_ids
from server.serving import OpenAIServing, clamp_logprob
from server.structured import check_constrained, grammar_for
from server.tokenizer import Tokenizer


def prompt_token_ids(prompt, tokenizer: Tokenizer, param: str = "prompt") -> list[list[int]]:
    """Text, a batch of texts, one token-id list, or a batch of token-id lists (`param`: the
    field's name in errors)."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise invalid_request(f"The {param} must not be empty.", param=param)
    if isinstance(prompt[0], str):
        return [tokenizer.encode(text) for text in prompt]
    batch = [prompt] if isinstance(prompt[0], int) else prompt
    for ids in batch:
        check_token_ids(ids, tokenizer.vocab_size, param)
    return [list(ids) for ids in batch]


def _echoes(request: CompletionRequest, prompts: list[list[int]],
            tokenizer: Tokenizer) -> list[str]:
    """Per prompt, the text that `echo` puts before the completion ("" without echo)."""
    if not request.echo:
        return [""] * len(prompts)
    texts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    if texts and isinstance(texts[0], str):
        return list(texts)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def _infill(request: CompletionRequest, tokenizer: Tokenizer
            ) -> tuple[CompletionRequest, list[list[int]]]:
    """OpenAI's `suffix`: the completion goes between the prompt and it (server/fim.py); the
    request, stopping where the model ends a middle too, and its prompt."""
    fim = require_fim(tokenizer, "suffix")
    if not isinstance(request.prompt, str):
        raise invalid_request("With a suffix the prompt is one text (the code before the "
                              "completion).", param="prompt")
    if request.echo:
        raise invalid_request("echo is not supported with a suffix.", param="echo")
    ids, _ = fim_prompt_ids(tokenizer, fim, request.prompt, request.suffix)
    stops = [*(request.stop_token_ids or ()), *fim.ends]
    return request.model_copy(update={"stop_token_ids": stops}), [ids]


class CompletionServing(OpenAIServing):
    async def create(self, request: CompletionRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        texts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
        if texts and isinstance(texts[0], str):
            self.check_admissible(len(texts) * (request.n or 1))
            self.check_prompt_text(texts, "prompt",
                                   truncated=request.truncate_prompt_tokens is not None)
        if request.suffix is not None:
            self.check_prompt_text([request.suffix], "suffix")
        grammar = await anyio.to_thread.run_sync(grammar_for, request)
        check_constrained(grammar, request)
        if request.suffix is not None:      # fill in the middle: the prompt is the prefix
            request, prompts = await anyio.to_thread.run_sync(_infill, request, tokenizer)
        else:
            prompts = await anyio.to_thread.run_sync(prompt_token_ids, request.prompt,
                                                     tokenizer)
        request_id, engine_id = self.request_ids(raw, "cmpl-")
        created = int(time.time())
        generation = self.generation(request, prompts, engine_id, "prompt", grammar)
        echoes = _echoes(request, prompts, tokenizer)
        return await self.respond(
            raw, generation, stream=bool(request.stream),
            events=lambda: self._chunks(request, generation, request_id, created, echoes),
            build=lambda results: self._response(request, generation, results, request_id,
                                                 created, echoes))

    def _response(self, request: CompletionRequest, generation: Generation,
                  results: list[ChoiceResult], request_id: str,
                  created: int, echoes: list[str]) -> CompletionResponse:
        n = request.n or 1
        streams = {s.spec.index: s for s in generation.streams}
        choices = []
        for r in results:
            echo = echoes[r.index // n]
            # NOTE: after the echoed prompt's entries, with offsets into this choice's text,
            # which starts with the echoed prompt
            logprobs = self._logprobs(request, r.logprobs, len(echo),
                                      self._echo_logprobs(request, streams[r.index]))[0]
            choices.append(CompletionChoice(
                index=r.index, text=echo + r.text, logprobs=logprobs,
                finish_reason=r.finish_reason,
                prompt_logprobs=self.prompt_logprobs(request, streams[r.index])))
        return CompletionResponse(id=request_id, created=created,
                                  model=self.ctx.model_name(request.model), choices=choices,
                                  usage=generation.usage())

    async def _chunks(self, request: CompletionRequest, generation: Generation,
                      request_id: str, created: int,
                      echoes: list[str]) -> AsyncIterator[CompletionStreamResponse]:
        live = request.stream_options is not None \
            and request.stream_options.usage_on_every_chunk

        def chunk(choices, usage=None) -> CompletionStreamResponse:
            return CompletionStreamResponse(id=request_id, created=created,
                                            model=self.ctx.model_name(request.model),
                                            choices=choices,
                                            usage=generation.usage() if live else usage)

        offsets = {s.spec.index: 0 for s in generation.streams}   # text_offset per choice
        for s in generation.streams:
            echo = echoes[s.spec.prompt_index]
            prompt = self.prompt_logprobs(request, s)
            if echo or prompt is not None:
                logprobs = self._echo_logprobs(request, s)
                offsets[s.spec.index] = len(echo)
                yield chunk([CompletionChoice(index=s.spec.index, text=echo,
                                              logprobs=logprobs if echo else None,
                                              prompt_logprobs=prompt)])
        async for delta in generation.deltas():
            if delta.text or delta.logprobs:
                logprobs, offsets[delta.index] = self._logprobs(request, delta.logprobs,
                                                                offsets[delta.index])
                yield chunk([CompletionChoice(index=delta.index, text=delta.text,
                                              logprobs=logprobs)])
            if delta.finish_reason:
                yield chunk([CompletionChoice(index=delta.index, text="",
                                              finish_reason=delta.finish_reason)])
        if request.stream_options and request.stream_options.include_usage:
            yield chunk([], usage=generation.usage())

    def _echo_logprobs(self, request: CompletionRequest, stream: ChoiceStream
                       ) -> CompletionLogprobs | None:
        """The echoed prompt's entries of the legacy logprobs, one per prompt token (the first,
        and any the engine did not score, null); None unless echo with logprobs."""
        prompt = stream.prompt_logprobs
        if not (request.echo and request.logprobs is not None and prompt):
            return None
        out, offset = CompletionLogprobs(), 0
        for token_id, entry in zip(stream.spec.prompt_token_ids, prompt):
            if entry is None:
                text = self.ctx.tokenizer.token_text(token_id)
                out.tokens.append(text)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                out.text_offset.append(offset)
                offset += len(text)
                continue
            offset = self._logprobs(request, [entry], offset, out)[1]
        return out

    def _logprobs(self, request: CompletionRequest, entries: Logprobs | list, offset: int,
                  out: CompletionLogprobs | None = None
                  ) -> tuple[CompletionLogprobs | None, int]:
        """Legacy shape: parallel lists tokens / token_logprobs / top_logprobs / text_offset
        (appended to `out` when given)."""
        if request.logprobs is None:
            return None, offset
        out = CompletionLogprobs() if out is None else out
        for sampled, top in entries:
            text = self.token_text(sampled)
            out.tokens.append(text)
            out.token_logprobs.append(clamp_logprob(sampled.logprob))
            alternatives = {self.token_text(t): clamp_logprob(t.logprob)
                            for t in top[:request.logprobs]}
            alternatives.setdefault(text, clamp_logprob(sampled.logprob))
            out.top_logprobs.append(alternatives)
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset
