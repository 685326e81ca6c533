"""OpenAI wire models for structured outputs and tool calls (request and response sides),
and the marker for request fields Strata does not support (a 400 naming the field, never a
silent drop: docs/api.md "Fields")."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, model_serializer

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"     # OpenAI's rule for function names


class _Request(BaseModel):
    """Request bodies: unknown fields are ignored (known output-changing ones are Unsupported)."""
    model_config = ConfigDict(extra="ignore")


class _Wire(BaseModel):
    """Response bodies: exactly the fields declared."""
    model_config = ConfigDict(extra="forbid")


def _unsupported(value: Any) -> Any:
    if value is not None:
        raise ValueError("this field is not supported by this server")
    return value


def _only(*accepted: Any, hint: str = ""):
    """A field whose only supported values are `accepted` (what Strata does anyway); `hint`
    ends the error message (what to use instead)."""
    def check(value: Any) -> Any:
        if value is not None and value not in accepted:
            raise ValueError(f"only {' or '.join(repr(a) for a in accepted)} is supported "
                             "by this server" + (f"; {hint}" if hint else ""))
        return value
    return AfterValidator(check)


def _llamacpp(neutral: float, hint: str = ""):
    """One of llama.cpp's sampler fields that Strata does not implement: only its neutral
    value (what the field does when off) is accepted."""
    return Annotated[Any, _only(neutral, hint=hint or "a llama.cpp sampler this server "
                                "does not implement")]


# a field that would change the output and that Strata cannot honour: 400 when given non-null
Unsupported = Annotated[Any, AfterValidator(_unsupported)]
OnlyTrue = Annotated[Any, _only(True)]
OnlyFalse = Annotated[Any, _only(False)]
OnlyText = Annotated[Any, _only(["text"])]
# llama.cpp's sampler Strata does not implement (its /v1 routes take it): refused when on
LlamaCppOffAtOne = _llamacpp(1.0)           # tfs_z


# ----------------------------------------------------------------------------- requests

class FunctionDefinition(_Request):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None      # a JSON Schema; absent: no arguments
    strict: StrictBool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Request):
    name: str
    arguments: str                                # JSON text, as the API returned it


class MessageToolCall(_Request):
    """A tool call of an earlier assistant turn, sent back in the history."""
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJsonObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject
                           | ResponseFormatJsonSchema, Field(discriminator="type")]


# ----------------------------------------------------------------------------- responses

class FunctionCall(_Wire):
    name: str
    arguments: str


class ToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Wire):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(_Wire):
    """One piece of a streamed tool call: the first names it (id, type, name), the next ones
    append to its arguments."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}
