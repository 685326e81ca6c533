"""POST /v1/tokenize and /v1/detokenize (also at /tokenize and /detokenize, where vLLM has
them): the server's own tokenizer and chat template, so that clients count tokens exactly.
And vLLM's render endpoints, POST /v1/chat/completions/render and /v1/completions/render: a
generation request's prompt token ids without generating (what vllm-router's cache-aware
policy asks every replica for, to route requests that share a prefix to the same one:
docs/scale-out.md)."""
from __future__ import annotations

from typing import Annotated

import anyio
from pydantic import Field, StrictBool

from server.context import ServerContext
from server.errors import invalid_request
from server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                             ContinueFinalMessage, RequestTemplate, TemplateKwargs, Text,
                             TokenId)
from server.protocol_tools import ChatTool, _Request, _Wire
from server.sampling import check_token_ids
from server.serving_completion import prompt_token_ids
from server.tokenizer import TemplateError
from server.serving_chat import chat_render


class TokenizeRequest(_Request):
    """Either `prompt` (text) or `messages` (rendered through the chat template first)."""
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage] | None, Field(min_length=1)] = None
    tools: list[ChatTool] | None = None
    add_special_tokens: StrictBool | None = None     # default: True for a prompt, False for chat
    return_token_strs: StrictBool = False
    # the chat template's switches, as on /v1/chat/completions
    add_generation_prompt: StrictBool | None = True
    continue_final_message: ContinueFinalMessage = False
    chat_template_kwargs: TemplateKwargs = None
    chat_template: RequestTemplate = None


class TokenizeResponse(_Wire):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(_Wire):
    prompt: str


class RenderResponse(_Wire):
    model: str
    token_ids: list[int]                 # the (first) prompt's token ids


class TokenServing:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        if (request.prompt is None) == (request.messages is None):
            raise invalid_request("Give either 'prompt' or 'messages'.", param="prompt")
        if request.prompt is not None:
            add = True if request.add_special_tokens is None else request.add_special_tokens
            tokens = await anyio.to_thread.run_sync(tokenizer.encode, request.prompt, add)
        else:
            messages, tools, options = chat_render(self.ctx, request, tokenizer)
            try:
                text = await anyio.to_thread.run_sync(
                    lambda: tokenizer.apply_chat_template(messages, tools, **options))
            except TemplateError as exc:
                raise invalid_request(str(exc), param="messages") from None
            tokens = await anyio.to_thread.run_sync(tokenizer.encode, text,
                                                    bool(request.add_special_tokens))
        strs = [tokenizer.token_text(t) for t in tokens] if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.ctx.max_model_len,
                                tokens=tokens, token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        check_token_ids(request.tokens, tokenizer.vocab_size, "tokens")
        text = await anyio.to_thread.run_sync(tokenizer.decode, request.tokens, False)
        return DetokenizeResponse(prompt=text)

    async def render_chat(self, request: ChatCompletionRequest) -> RenderResponse:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        messages, tools, options = chat_render(self.ctx, request, tokenizer)
        try:
            ids = await anyio.to_thread.run_sync(
                lambda: tokenizer.encode_chat(messages, tools, **options))
        except TemplateError as exc:
            raise invalid_request(str(exc), param="messages") from None
        return RenderResponse(model=self.ctx.served_model_name, token_ids=ids)

    async def render_completion(self, request: CompletionRequest) -> RenderResponse:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        prompts = await anyio.to_thread.run_sync(prompt_token_ids, request.prompt, tokenizer)
        return RenderResponse(model=self.ctx.served_model_name, token_ids=prompts[0])
