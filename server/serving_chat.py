"""ChatServing: POST /v1/chat/completions."""
from __future__ import annotations

import time
from typing import AsyncIterator

import anyio
from fastapi import Request
from pydantic import ValidationError
from starlette.responses import Response

from scheduler.sampling_params import GrammarSpec
from server.choice_stream import Logprobs
from server.errors import invalid_request
from server.generation import ChoiceResult, Generation
from server.protocol import ChatCompletionRequest
from server.protocol_responses import (ChatChoiceLogprobs, ChatCompletionChoice,
                                       ChatCompletionChunk, ChatCompletionResponse,
                                       ChatCompletionStreamChoice, ChatResponseMessage,
                                       ChatTokenLogprob, DeltaMessage, TopLogprob)
from server.protocol_tools import FunctionCall, ToolCall
from server.reasoning import ReasoningSplitter, pieces_of, split_reasoning
from server.serving import OpenAIServing, clamp_logprob
from server.structured import check_constrained, grammar_for
from server.tokenizer import TemplateError
from server.tool_parser import StreamedCalls, new_call_id, split_answer
from server.tools import ToolPlan, chat_messages, plan_tools


class ChatServing(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        if request.stream and request.prompt_logprobs is not None:
            raise invalid_request("prompt_logprobs come in non-streamed chat responses (or "
                                  "streamed /v1/completions).", param="prompt_logprobs")
        # NOTE: compiling a large schema takes milliseconds: not on the event loop
        plan, grammar = await anyio.to_thread.run_sync(constraints, request,
                                                       self.ctx.tool_format)
        prompt_ids = await chat_prompt_ids(self, request, tokenizer,
                                           truncated=request.truncate_prompt_tokens is not None)
        request_id, engine_id = self.request_ids(raw, "chatcmpl-")
        created = int(time.time())
        generation = self.generation(request, [prompt_ids], engine_id, "messages", grammar,
                                     chat=True)
        return await self.respond(
            raw, generation, stream=bool(request.stream),
            events=lambda: self._chunks(request, plan, generation, request_id, created),
            build=lambda results: self._response(request, plan, generation, results,
                                                 request_id, created))

    def _response(self, request: ChatCompletionRequest, plan: ToolPlan | None,
                  generation: Generation, results: list[ChoiceResult], request_id: str,
                  created: int) -> ChatCompletionResponse:
        choices = []
        style = self.ctx.reasoning_style
        for r in results:
            reasoning, text = split_reasoning(style, r.text)
            message = _message(plan, text)
            if request.include_reasoning is not False:
                message.reasoning_content = reasoning
            reason = r.finish_reason
            if message.tool_calls and reason == "stop":
                reason = "tool_calls"
            choices.append(ChatCompletionChoice(index=r.index, message=message,
                                                logprobs=self._logprobs(request, r.logprobs),
                                                finish_reason=reason))
        return ChatCompletionResponse(id=request_id, created=created,
                                      model=self.ctx.model_name(request.model), choices=choices,
                                      usage=generation.usage(),
                                      prompt_logprobs=self.prompt_logprobs(
                                          request, generation.streams[0]))

    async def _chunks(self, request: ChatCompletionRequest, plan: ToolPlan | None,
                      generation: Generation, request_id: str,
                      created: int) -> AsyncIterator[ChatCompletionChunk]:
        live = request.stream_options is not None \
            and request.stream_options.usage_on_every_chunk

        def chunk(choices, usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created,
                                       model=self.ctx.model_name(request.model), choices=choices,
                                       usage=generation.usage() if live else usage)

        calls, thinking = {}, {}
        style = self.ctx.reasoning_style
        include = request.include_reasoning is not False
        for stream in generation.streams:
            calls[stream.spec.index] = StreamedCalls(plan)
            thinking[stream.spec.index] = ReasoningSplitter(style) if style else None
            yield chunk([ChatCompletionStreamChoice(
                index=stream.spec.index, delta=DeltaMessage(role="assistant", content=""))])
        async for delta in generation.deltas():
            state = calls[delta.index]
            pieces = _pieces(state, thinking[delta.index], delta.text,
                             bool(delta.finish_reason), include)
            if delta.logprobs and not pieces:
                pieces = [DeltaMessage()]
            for k, piece in enumerate(pieces):
                yield chunk([ChatCompletionStreamChoice(
                    index=delta.index, delta=piece,
                    logprobs=self._logprobs(request, delta.logprobs) if k == 0 else None)])
            if delta.finish_reason:
                yield chunk([ChatCompletionStreamChoice(
                    index=delta.index, delta=DeltaMessage(),
                    finish_reason=state.finish_reason(delta.finish_reason))])
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


def chat_render(ctx, request, tokenizer) -> tuple[list[dict], list[dict] | None, dict]:
    """A chat request (or a tokenize request's messages) as the chat template takes it: its
    messages, its tools, and the template's switches it sets (Tokenizer.apply_chat_template's
    keywords: the generation prompt, on unless false; continuing the last message; more
    variables; its own template, vLLM's `chat_template`, which only
    --trust-request-chat-template allows: a template is code the server runs)."""
    template = request.chat_template
    if template is not None and not ctx.trust_request_chat_template:
        raise invalid_request("This server renders chats with its own template only: a "
                              "request's chat_template needs --trust-request-chat-template.",
                              param="chat_template")
    messages, tools = chat_messages(request, template or tokenizer.chat_template,
                                    ctx.tool_format)
    return messages, tools, dict(add_generation_prompt=request.add_generation_prompt is not False,
                                 continue_final_message=bool(request.continue_final_message),
                                 template_kwargs=request.chat_template_kwargs,
                                 chat_template=template)


async def chat_prompt_ids(serving: OpenAIServing, request: ChatCompletionRequest, tokenizer,
                          param: str = "messages", truncated: bool = False) -> list[int]:
    """A chat request's prompt as token ids: its messages (and tools) through the chat
    template, on a worker thread, after the text-size check (`truncated`: the request cuts
    its prompt); a template error is a 400 naming `param` (another API's name for its
    messages)."""
    messages, tools, options = chat_render(serving.ctx, request, tokenizer)
    serving.check_prompt_text(["".join(m["content"] for m in messages)], param,
                              truncated=truncated)
    try:
        return await anyio.to_thread.run_sync(
            lambda: tokenizer.encode_chat(messages, tools, **options))
    except TemplateError as exc:
        raise invalid_request(str(exc), param=param) from None


def chat_request(fields: dict, param: str, label: str) -> ChatCompletionRequest:
    """The chat request another API's request means (`fields`: ChatCompletionRequest's); a
    value the chat request refuses is a 400 naming `param` ("Invalid <label>: ...")."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        msg = exc.errors()[0].get("msg", "invalid value")
        raise invalid_request(f"Invalid {label}: {msg}.", param=param) from None


def constraints(request: ChatCompletionRequest, tool_format: str = "hermes"
                ) -> tuple[ToolPlan | None, GrammarSpec | None]:
    """The tool plan (calls in `tool_format`) and the grammar the answer follows (a required /
    named tool_choice's, else response_format's or a guided_* field's), or the 400 that says
    why not."""
    plan = plan_tools(request, tool_format)
    grammar = plan.grammar if plan is not None and plan.grammar else grammar_for(request)
    check_constrained(grammar, request)
    return plan, grammar


def _pieces(calls: StreamedCalls, thinking: ReasoningSplitter | None, text: str, final: bool,
            include_reasoning: bool) -> list[DeltaMessage]:
    """A choice's delta text as chat delta pieces: its reasoning (when asked for), then its
    content and tool calls; `final`: the answer ended, so what the parsers hold comes out."""
    pieces: list[DeltaMessage] = []
    for kind, part in pieces_of(thinking, text, final):
        if kind == "reasoning":
            if include_reasoning:
                pieces.append(DeltaMessage(reasoning_content=part))
        else:
            pieces += calls.push(part)
    if final:
        pieces += calls.flush()
    return pieces


def _message(plan: ToolPlan | None, text: str) -> ChatResponseMessage:
    """The assistant message of one answer: its content, or the tool calls it makes."""
    if plan is None or plan.mode == "none":
        return ChatResponseMessage(content=text)
    if plan.mode == "named":
        call = ToolCall(id=new_call_id(), function=FunctionCall(name=plan.named, arguments=text))
        return ChatResponseMessage(content=None, tool_calls=[call])
    content, calls = split_answer(text, plan.names, plan.parallel, plan.format)
    return ChatResponseMessage(content=content, tool_calls=[
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls] or None)
