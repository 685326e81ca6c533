"""Tool calls: the prompt that shows a model its tools and the history of earlier calls, and
the grammar that makes it call one when tool_choice says it must.

A chat template that knows tools (it reads a ``tools`` variable, as Qwen's, Hermes' and
Llama 3.1's do) renders them itself. Otherwise (the bundled SmolLM2) the documented default
(docs/api.md "Tool calls") applies: the definitions go into the system message, a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(the Hermes format, which server/tool_parser.py reads back), and a tool's answer is a user turn
wrapped in <tool_response> tags. tool_choice:
  none      the model sees the tools but its answer is text;
  auto      the model chooses; calls in its answer are parsed out (no grammar);
  required  the answer is one or more calls (one if parallel_tool_calls is false), each
            call's arguments constrained to its function's parameter schema;
  a name    the answer is that function's arguments, constrained to its schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from scheduler.sampling_params import GrammarSpec
from server.errors import invalid_request
from server.protocol import ChatCompletionRequest, ChatMessage
from server.protocol_tools import ChatTool, NamedToolChoice
from server.structured import checked
from server.tool_formats import calls_grammar
from server.tool_formats import LIST_MARKS
from server.tool_formats import format_call as format_call_in
from server.tokenizer import reads_variable

ANY_OBJECT = {"type": "object"}
_TEMPLATE_ROLES = {"developer": "system"}    # OpenAI's newer name; templates know "system"

DEFAULT_INSTRUCTIONS = (
    "You can call functions to answer. Their definitions, as JSON Schemas:\n{tools}\n"
    "To call functions, answer with {how} and nothing else:\n{example}")
_HOW = {"hermes": "one block per call", "mistral": "the calls in one list",
        "llama3_json": 'the call (several joined by "; ")',
        "phi4_mini_json": "the calls in one list"}


def _instructions(listing: str, fmt: str) -> str:
    """The default tool instructions, with an example call in `fmt`."""
    example = format_call_in(fmt, "NAME", {"ARGS": 0}).replace(
        '"NAME"', '"<function name>"').replace('{"ARGS": 0}', "<the arguments as a JSON object>")
    return DEFAULT_INSTRUCTIONS.format(tools=listing, how=_HOW[fmt], example=example)


@dataclass(frozen=True)
class ToolPlan:
    """What the request's tools mean for this answer."""
    tools: tuple[ChatTool, ...]
    mode: str                          # none | auto | required | named
    named: str | None = None           # the function, when mode is "named"
    grammar: GrammarSpec | None = None
    parallel: bool = True              # more than one call per answer (parallel_tool_calls)
    format: str = "hermes"             # how the model writes calls (server/tool_formats.py)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools)

    @property
    def parses_calls(self) -> bool:
        return self.mode in ("auto", "required")


def plan_tools(request: ChatCompletionRequest, fmt: str = "hermes") -> ToolPlan | None:
    """None without tools; else the plan, with the grammar for required / named (400s for a
    tool_choice naming no tool, a bad parameter schema, a clash with response_format);
    `fmt`: the format the model writes calls in."""
    tools = tuple(request.tools or ())
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid_request("tool_choice needs tools.", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid_request("Function names must be unique.", param="tools")
    schemas = {t.function.name: _parameters(t, i) for i, t in enumerate(tools)}
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise invalid_request(f"tool_choice names '{name}', which is not in tools.",
                                  param="tool_choice")
        plan = ToolPlan(tools, "named", name, GrammarSpec("json_schema", json.dumps(schemas[name])),
                        format=fmt)
    elif choice == "required":
        grammar = checked(GrammarSpec("lark", calls_grammar(fmt, schemas, parallel)), "tools")
        plan = ToolPlan(tools, "required", None, grammar, parallel, fmt)
    else:
        plan = ToolPlan(tools, choice or "auto", parallel=parallel, format=fmt)
    if plan.grammar is not None and request.guided_fields():
        rf = request.response_format
        if rf is None or rf.type != "text":
            raise invalid_request("A required or named tool_choice cannot be combined with "
                                  "response_format or guided_* fields.", param="tool_choice")
    return plan


def _parameters(tool: ChatTool, index: int) -> dict:
    """The function's parameter schema (any object when it declares none), checked."""
    schema = tool.function.parameters or ANY_OBJECT
    checked(GrammarSpec("json_schema", json.dumps(schema)), f"tools[{index}].function.parameters")
    return schema


# ----------------------------------------------------------------------------- prompts

def template_knows_tools(template: str | None) -> bool:
    return bool(template) and reads_variable(template, "tools")


def chat_messages(request: ChatCompletionRequest, template: str | None, fmt: str = "hermes"
                  ) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, tools for it or None): the template's own tool
    format when it has one, else the default one folded into plain messages (calls written
    in `fmt`, server/tool_formats.py)."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
    if template_knows_tools(template):
        return [_native(m) for m in request.messages], (tools or None)
    messages = [_plain(m, fmt) for m in request.messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = _instructions(listing, fmt)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system",
                           "content": f"{messages[0]['content']}\n\n{instructions}"}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    return messages, None


def _plain(m: ChatMessage, fmt: str) -> dict:
    """One message as the default tool format renders it (roles any template knows)."""
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    content = m.text()
    if m.tool_calls:
        calls = [(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls]
        calls = format_calls(fmt, calls)
        content = f"{content}\n{calls}" if content else calls
    return {"role": _TEMPLATE_ROLES.get(m.role, m.role), "content": content}


def _native(m: ChatMessage) -> dict:
    """One message in the transformers convention that tool-aware templates read."""
    out = {"role": _TEMPLATE_ROLES.get(m.role, m.role), "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def format_call(name: str, arguments) -> str:
    """A call as Strata's default (Hermes) renders it."""
    return format_call_in("hermes", name, arguments)


def format_calls(fmt: str, calls: list[tuple[str, object]]) -> str:
    """An answer's calls, (name, arguments) each, as a model writing `fmt` writes them."""
    if fmt in LIST_MARKS:        # one list
        opening = "".join(LIST_MARKS[fmt])
        body = ", ".join(format_call_in(fmt, n, a)[len(opening):-1] for n, a in calls)
        return f"{opening}{body}]"
    return ("; " if fmt == "llama3_json" else "\n").join(format_call_in(fmt, n, a)
                                                          for n, a in calls)
