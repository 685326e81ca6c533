"""OpenAI API wire models of responses (chat completions and chunks, completions, models,
errors): exactly the fields declared (`_Wire`). The request models and their checks are in
server/protocol.py."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_serializer

from server.protocol_tools import DeltaToolCall, ToolCall, _Wire


class PromptTokensDetails(_Wire):
    cached_tokens: int = 0           # prompt tokens whose KV came from the prefix cache


class UsageInfo(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class TopLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Wire):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Wire):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Wire):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None      # a reasoning model's <think> text (vLLM's)

    @model_serializer(mode="wrap")
    def _drop_reasoning_unset(self, handler) -> dict[str, Any]:
        out = handler(self)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class ChatCompletionChoice(_Wire):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class PromptLogprob(_Wire):
    """vLLM's prompt_logprobs entry of one token."""
    logprob: float
    rank: int | None = None
    decoded_token: str


# per prompt token (None for the first): token id (as a string) -> its entry, the prompt's
# own token and the top-k alternatives
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletionResponse(_Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_Wire):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        # NOTE: OpenAI deltas carry only the keys that changed ({} on the finish chunk).
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(_Wire):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(_Wire):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Wire):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


class ModelCard(_Wire):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "strata"
    max_model_len: int | None = None
    root: str | None = None              # a LoRA adapter's folder (vLLM's)
    parent: str | None = None            # a LoRA adapter's base model


class ModelList(_Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(_Wire):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Wire):
    error: ErrorInfo


class AnthropicErrorInfo(_Wire):
    type: str
    message: str


class AnthropicErrorResponse(_Wire):
    """An error on the Messages API's routes (Anthropic's shape)."""
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
