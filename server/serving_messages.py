"""MessagesServing: the Anthropic Messages API (POST /v1/messages and
/v1/messages/count_tokens), for clients that speak it (the anthropic SDK, Claude Code), as
llama.cpp's and vLLM's servers serve it.

A messages request is answered as the chat completion it means (server/messages_protocol.py:
system prompt, turns, tool use and results, tools and tool_choice, stop_sequences, thinking):
the chat path's template, tool plan, grammar and engine run unchanged; the answer is a
`message` of content blocks (server/messages_events.py), streamed as Anthropic's named events.
A max_tokens above what the context leaves after the prompt is cut to it (Anthropic clients
send their own model's output limit). Usage counts the prompt's tokens served from the prefix
cache as cache_read_input_tokens,
the rest as input_tokens (Anthropic's split). Errors on these routes come in Anthropic's shape
({"type": "error", "error": {"type", "message"}}: server/errors.py).
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Literal

import anyio
from fastapi import Request
from starlette.responses import Response

from server.choice_stream import ChoiceDelta
from server.generation import ChoiceResult, Generation
from server.messages_events import MessageEvents
from server.messages_protocol import CountTokensRequest, MessagesRequest
from server.protocol import ChatCompletionRequest
from server.protocol_tools import _Wire
from server.serving import OpenAIServing, json_response, to_api_error
from server.serving_chat import chat_prompt_ids, chat_request, constraints


class MessageBody(_Wire):
    """An Anthropic message (the non-streamed answer)."""
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: dict[str, int]


class TokenCount(_Wire):
    input_tokens: int


class MessagesServing(OpenAIServing):
    named_events = True

    async def create(self, request: MessagesRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        chat, prompt_ids = await self._prompt(request)
        plan, grammar = await anyio.to_thread.run_sync(constraints, chat,
                                                       self.ctx.tool_format)
        message_id, engine_id = self.request_ids(raw, "msg_")
        generation = self.generation(chat, [prompt_ids], engine_id, "messages", grammar,
                                     chat=True)
        base = {"id": message_id, "type": "message", "role": "assistant",
                "model": request.model, "content": [], "stop_reason": None,
                "stop_sequence": None, "usage": {}}
        style = self.ctx.reasoning_style

        def fresh() -> MessageEvents:
            return MessageEvents(dict(base, content=[]), plan, style)

        return await self.respond(
            raw, generation, stream=bool(request.stream),
            events=lambda: self._events(fresh(), generation),
            build=lambda results: self._build(fresh(), generation, results))

    async def count_tokens(self, request: CountTokensRequest) -> Response:
        self.ctx.check_model(request.model)
        _, prompt_ids = await self._prompt(request, max_tokens=False)
        return json_response(TokenCount(input_tokens=len(prompt_ids)))

    async def _prompt(self, request: MessagesRequest, max_tokens: bool = True
                      ) -> tuple[ChatCompletionRequest, list[int]]:
        """The chat request it means and its prompt's token ids."""
        tokenizer = self.ctx.require_ready()
        chat = chat_request(request.chat_fields(max_tokens), "messages", "request")
        ids = await chat_prompt_ids(self, chat, tokenizer)
        room = self.ctx.max_model_len - len(ids)
        if max_tokens and 0 < room < chat.max_tokens:
            # NOTE: Anthropic clients ask for their model's own output limit (Claude Code:
            # 32000); what the context leaves is the most this server can write
            chat = chat.model_copy(update={"max_tokens": room})
        return chat, ids

    async def _events(self, events: MessageEvents,
                      generation: Generation) -> AsyncIterator[dict]:
        events.message["usage"] = _usage(generation)
        for _, payload in events.start():
            yield payload
        reason = stop = None
        try:
            async for delta in generation.deltas():
                for _, payload in events.push(delta):
                    yield payload
                reason, stop = delta.finish_reason or reason, delta.stop_string or stop
        except Exception as exc:                 # mid-stream: an error event ends it
            for _, payload in events.fail(to_api_error(exc).message):
                yield payload
            return
        for _, payload in events.finish(reason, stop, _usage(generation)):
            yield payload

    def _build(self, events: MessageEvents, generation: Generation,
               results: list[ChoiceResult]) -> MessageBody:
        (r,) = results
        events.start()
        events.push(ChoiceDelta(r.index, r.text, (), r.finish_reason, r.stop_string))
        events.finish(r.finish_reason, r.stop_string, _usage(generation))
        return MessageBody(**events.message)


def _usage(generation: Generation) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache."""
    u = generation.usage()
    cached = u.prompt_tokens_details.cached_tokens
    return {"input_tokens": u.prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0, "output_tokens": u.completion_tokens}

