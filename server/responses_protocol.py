"""OpenAI Responses API requests (POST /v1/responses): the request model, its input items, and
their translation into the chat messages the chat template renders.

A response's conversation is a list of items: messages (user, system, developer, assistant),
the assistant's function calls and the caller's function call outputs. An output item sent
back as input (`input += response.output`, the SDK's pattern) reads as the same kind of input
item, so one translation serves the request's input and the stored history behind
`previous_response_id` (server/response_store.py). Items that carry nothing a text model can
read back (reasoning) are skipped; content other than text (images, files, audio) is a 400.
Unknown fields are ignored, output-changing ones Strata cannot honour are 400s, as for chat
(server/protocol.py).
"""
from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, Tag, model_validator

from server.protocol import (MAX_CHAT_TOP_LOGPROBS, MAX_TOOLS, CacheSalt, Flag, MaxTokens,
                             Priority, Seed, Temperature, Text, TopK, TopP)
from server.protocol_tools import (FUNCTION_NAME, Unsupported, _only,
                                   _Request)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS = 16
TEXT_PARTS = ("input_text", "output_text")


class ContentPart(_Request):
    """One part of a message's content: text (input_text, or output_text when an earlier
    answer is sent back) or a refusal; anything else is not text, and a 400."""
    type: str
    text: Text | None = None
    refusal: Text | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type in TEXT_PARTS and self.text is None:
            raise ValueError(f"a {self.type} part needs its text")
        if self.type == "refusal" and self.refusal is None:
            raise ValueError("a refusal part needs its refusal text")
        if self.type not in (*TEXT_PARTS, "refusal"):
            raise ValueError(f"content of type '{self.type}' is not supported: this model "
                             "reads text only")
        return self

    def value(self) -> str:
        return self.text if self.type in TEXT_PARTS else self.refusal


def _text_of(content: str | list[ContentPart]) -> str:
    """A string, or text parts joined by newlines (as chat joins its parts)."""
    return content if isinstance(content, str) else "\n".join(p.value() for p in content)


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ContentPart]

    def text(self) -> str:
        return _text_of(self.content)


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: Annotated[Text, Field(min_length=1)]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: Text
    id: Text | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: Annotated[Text, Field(min_length=1)]
    output: Text | list[ContentPart]
    id: Text | None = None

    def text(self) -> str:
        return _text_of(self.output)


class ReasoningItem(_Request):
    """A reasoning model's item sent back: nothing a text model reads (skipped)."""
    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type") or "message"      # EasyInputMessage: a role, no type
    return getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]


class FunctionTool(_Request):
    """A function the model may call (the Responses API's flat shape)."""
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]


class FormatText(_Request):
    type: Literal["text"]


class FormatJsonObject(_Request):
    type: Literal["json_object"]


class FormatJsonSchema(_Request):
    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextConfig(_Request):
    format: Annotated[FormatText | FormatJsonObject | FormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Annotated[Any, _only("medium")] = None


Metadata = Annotated[dict[str, Annotated[str, Field(max_length=512)]] | None,
                     Field(max_length=MAX_METADATA_PAIRS)]


class ResponsesRequest(_Request):
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    max_output_tokens: MaxTokens = None
    temperature: Temperature = None
    top_p: TopP = None
    tools: Annotated[list[FunctionTool] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: Flag = None
    text: TextConfig | None = None
    stream: Flag = False
    store: Flag = True
    metadata: Metadata = None
    user: Text | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: Annotated[list[Text] | None, Field(max_length=16)] = None
    top_logprobs: Annotated[StrictInt | None, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] = None
    background: Flag = False          # run as a task the client polls or follows
    # refused: they would change the output and are not implemented (a text model without
    # reasoning, no server-side conversations or prompt templates)
    reasoning: Unsupported = None
    conversation: Unsupported = None
    prompt: Unsupported = None
    max_tool_calls: Unsupported = None
    # extensions (vLLM's sampling knobs)
    seed: Seed = None
    top_k: TopK = None
    cache_salt: CacheSalt = None
    priority: Priority = None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_items(self) -> list:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request fields (server/protocol.py) that mean the same."""
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                 exclude_none=True)}
                 for t in self.tools or ()]
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        fmt = self.text.format if self.text is not None else None
        if isinstance(fmt, FormatJsonSchema):
            fmt = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None:
            fmt = {"type": fmt.type}
        return dict(model=self.model, max_tokens=self.max_output_tokens,
                    temperature=self.temperature, top_p=self.top_p, tools=tools or None,
                    tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls,
                    response_format=fmt, stream=self.stream, user=self.user,
                    logprobs=self.logprobs,
                    top_logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                    seed=self.seed, top_k=self.top_k, cache_salt=self.cache_salt,
                    priority=self.priority)


def chat_messages_of(items: list) -> list[dict]:
    """Input items as chat messages (server/protocol.ChatMessage fields): an assistant's calls
    join its message (consecutive calls are one turn), each output is a tool message."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
    return messages


def item_records(items: list) -> list[dict]:
    """The input items as the API lists them back (GET .../input_items): each with an id and
    a status, text content as input_text (an assistant's as output_text)."""
    records = []
    for item in items:
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            part = {"type": kind, "text": item.text()}
            if kind == "output_text":
                part["annotations"] = []
            records.append({"id": new_id("msg"), "type": "message", "role": item.role,
                            "status": "completed", "content": [part]})
        elif isinstance(item, FunctionCallItem):
            records.append({"id": item.id or new_id("fc"), "type": "function_call",
                            "call_id": item.call_id, "name": item.name,
                            "arguments": item.arguments, "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            records.append({"id": item.id or new_id("fco"), "type": "function_call_output",
                            "call_id": item.call_id, "output": item.text(),
                            "status": "completed"})
    return records


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
