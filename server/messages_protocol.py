"""Anthropic Messages API requests (POST /v1/messages, /v1/messages/count_tokens), as
llama.cpp's and vLLM's servers take them (Claude Code and the anthropic SDK send these), and
their translation into the chat request they mean (server/protocol.py).

Content blocks: text; tool_use (an assistant's call: a chat tool call, its input as JSON
arguments); tool_result (a user turn's answer to a call: a tool message); thinking and
redacted_thinking (an assistant's earlier reasoning: skipped, as chat templates drop it);
images and documents are a 400 (this server's models read text). `thinking` enables or
disables a reasoning model's thinking through its chat template's `enable_thinking`;
`output_config.format` (a JSON Schema) constrains the answer as chat's response_format does.
Sampling knobs the current SDK no longer sends (temperature, top_p, top_k) are still read
from the body, as older clients send them.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, model_validator

from server.protocol import MAX_TOOLS, CacheSalt, Flag, Temperature, Text, TopK, TopP
from server.protocol_tools import FUNCTION_NAME, Unsupported, _Request

MAX_STOP_SEQUENCES = 4


class Block(_Request):
    """A content block; only the kinds a text model reads (and tool use) are accepted."""
    type: str
    text: Text | None = None
    id: Text | None = None                      # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: Text | None = None             # tool_result
    content: Text | list["Block"] | None = None
    is_error: StrictBool | None = None

    @model_validator(mode="after")
    def _kind(self):
        need = {"text": ("text",), "tool_use": ("id", "name", "input"),
                "tool_result": ("tool_use_id",), "thinking": (), "redacted_thinking": ()}
        if self.type not in need:
            raise ValueError(f"content of type '{self.type}' is not supported: this model "
                             "reads text only")
        missing = [f for f in need[self.type] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        return self

    def result_text(self) -> str:
        """A tool_result's content as text (its text blocks joined)."""
        if isinstance(self.content, list):
            return "\n".join(b.text for b in self.content if b.type == "text")
        return self.content or ""


class Message(_Request):
    role: Literal["user", "assistant"]
    content: Text | list[Block]

    def blocks(self) -> list[Block]:
        if isinstance(self.content, str):
            return [Block(type="text", text=self.content)]
        return self.content


class Tool(_Request):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)] | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool choice of type 'tool' (and only that) names the tool")
        return self


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None


class JsonOutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: JsonOutputFormat | None = None
    effort: str | None = None           # a reasoning effort: no knob of ours (ignored)


class Metadata(_Request):
    user_id: Annotated[Text, Field(max_length=256)] | None = None


class MessagesRequest(_Request):
    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[Block] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: Annotated[list[Text] | None, Field(max_length=MAX_STOP_SEQUENCES)] = None
    stream: Flag = False
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    tools: Annotated[list[Tool] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    cache_salt: CacheSalt = None          # extension (vLLM's, as on chat completions)
    # refused: servers-side tools and containers this server does not run
    mcp_servers: Unsupported = None
    container: Unsupported = None

    def chat_fields(self, max_tokens: bool = True) -> dict[str, Any]:
        """The chat completion request (server/protocol.py) this request means."""
        fields: dict[str, Any] = dict(
            model=self.model, messages=chat_messages(self), stop=self.stop_sequences,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            user=self.metadata.user_id if self.metadata else None, stream=self.stream,
            cache_salt=self.cache_salt)
        if max_tokens:
            fields["max_tokens"] = self.max_tokens
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        choice = self.tool_choice
        if choice is not None and self.tools:          # (a choice without tools: none)
            fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                     if choice.type == "tool" else
                                     {"auto": "auto", "any": "required"}.get(choice.type,
                                                                            choice.type))
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}}
        if self.thinking is not None and self.thinking.type != "adaptive":
            fields["chat_template_kwargs"] = {
                "enable_thinking": self.thinking.type == "enabled"}
        return fields


def chat_messages(request: MessagesRequest) -> list[dict]:
    """The system prompt and the turns as chat messages: a user turn's tool results become
    tool messages (before its text), an assistant turn's tool uses its tool calls."""
    out: list[dict] = []
    system = request.system
    if isinstance(system, list):
        system = "\n".join(b.text for b in system if b.type == "text")
    if system:
        out.append({"role": "system", "content": system})
    for message in request.messages:
        blocks = message.blocks()
        text = "\n".join(b.text for b in blocks if b.type == "text")
        if message.role == "user":
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.result_text()}
                    for b in blocks if b.type == "tool_result"]
            if text or not any(b.type == "tool_result" for b in blocks):
                out.append({"role": "user", "content": text})
            continue
        calls = [{"id": b.id, "type": "function", "function": {
            "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in blocks if b.type == "tool_use"]
        out.append({"role": "assistant", "content": text or None, **(
            {"tool_calls": calls} if calls else {})})
    return out


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a messages request without max_tokens."""
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
