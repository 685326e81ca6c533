"""ChatServing: POST /v1/chat/completions."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

import anyio
from fastapi import Request
from starlette.responses import Response

from server.choice_stream import Logprobs
from server.errors import invalid_request
from server.generation import ChoiceResult, Generation
from server.protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk,
                             ChatCompletionRequest, ChatCompletionResponse,
                             ChatCompletionStreamChoice, ChatResponseMessage, ChatTokenLogprob,
                             DeltaMessage, TopLogprob)
from server.serving import OpenAIServing, clamp_logprob
from server.tokenizer import TemplateError

# NOTE: "developer" is OpenAI's newer name for "system"; chat templates only know the latter.
_TEMPLATE_ROLES = {"developer": "system"}


class ChatServing(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        messages = [{"role": _TEMPLATE_ROLES.get(m.role, m.role), "content": m.text()}
                    for m in request.messages]
        self.check_prompt_text(["".join(m["content"] for m in messages)], "messages")
        try:
            prompt_ids = await anyio.to_thread.run_sync(tokenizer.encode_chat, messages)
        except TemplateError as exc:
            raise invalid_request(str(exc), param="messages") from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation = self.generation(request, [prompt_ids], request_id, "messages")
        return await self.respond(
            raw, generation, stream=bool(request.stream),
            events=lambda: self._chunks(request, generation, request_id, created),
            build=lambda results: self._response(request, generation, results, request_id,
                                                 created))

    def _response(self, request: ChatCompletionRequest, generation: Generation,
                  results: list[ChoiceResult], request_id: str,
                  created: int) -> ChatCompletionResponse:
        choices = [ChatCompletionChoice(index=r.index,
                                        message=ChatResponseMessage(content=r.text),
                                        logprobs=self._logprobs(request, r.logprobs),
                                        finish_reason=r.finish_reason)
                   for r in results]
        return ChatCompletionResponse(id=request_id, created=created,
                                      model=self.ctx.served_model_name, choices=choices,
                                      usage=generation.usage())

    async def _chunks(self, request: ChatCompletionRequest, generation: Generation,
                      request_id: str, created: int) -> AsyncIterator[ChatCompletionChunk]:
        def chunk(choices, usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created,
                                       model=self.ctx.served_model_name, choices=choices,
                                       usage=usage)

        for stream in generation.streams:
            yield chunk([ChatCompletionStreamChoice(
                index=stream.spec.index, delta=DeltaMessage(role="assistant", content=""))])
        async for delta in generation.deltas():
            if delta.text or delta.logprobs:
                yield chunk([ChatCompletionStreamChoice(
                    index=delta.index, delta=DeltaMessage(content=delta.text),
                    logprobs=self._logprobs(request, delta.logprobs))])
            if delta.finish_reason:
                yield chunk([ChatCompletionStreamChoice(
                    index=delta.index, delta=DeltaMessage(), finish_reason=delta.finish_reason)])
        if request.stream_options and request.stream_options.include_usage:
            yield chunk([], usage=generation.usage())

    def _logprobs(self, request: ChatCompletionRequest,
                  entries: Logprobs | list) -> ChatChoiceLogprobs | None:
        """OpenAI chat shape: content[i] = {token, logprob, bytes, top_logprobs[]}."""
        if not request.logprobs:
            return None
        content = [
            ChatTokenLogprob(
                token=self.token_text(sampled), logprob=clamp_logprob(sampled.logprob),
                bytes=self.token_bytes(sampled),
                top_logprobs=[TopLogprob(token=self.token_text(t), logprob=clamp_logprob(t.logprob),
                                         bytes=self.token_bytes(t))
                              for t in top[:request.top_logprobs or 0]])
            for sampled, top in entries]
        return ChatChoiceLogprobs(content=content)
