"""OpenAI Responses API wire models (what /v1/responses answers): the response object, its
output items (an assistant message, function calls), usage, and the bodies of the stored
responses' routes. Exactly the fields declared (`_Wire`); the streamed events are built by
server/responses_events.py around these."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from server.protocol_tools import _Wire


class TopLogprobEntry(_Wire):
    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(_Wire):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry] = Field(default_factory=list)


class OutputText(_Wire):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[LogprobEntry] | None = None


class OutputMessage(_Wire):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(_Wire):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


class ReasoningText(_Wire):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningOutput(_Wire):
    """A reasoning model's <think> text (server/reasoning.py), before its message."""
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = OutputMessage | FunctionCallOutput | ReasoningOutput


class InputTokensDetails(_Wire):
    cached_tokens: int = 0              # prompt tokens whose KV came from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(_Wire):
    reasoning_tokens: int = 0


class ResponseUsage(_Wire):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class ResponseErrorInfo(_Wire):
    code: str
    message: str


class IncompleteDetails(_Wire):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Wire):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed",
                    "cancelled"] = "in_progress"
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None

    def output_text(self) -> str:
        """The text of every output message, joined (the SDK's `response.output_text`)."""
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage)
                       for part in item.content)


class DeletedResponse(_Wire):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(_Wire):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
