"""The formats models write tool calls in (`--tool-call-parser`, vLLM's flag and names): how
a call looks, how calls are read back out of an answer (server/tool_parser.py), and the
grammar that makes a model write them (tool_choice required).

  hermes       each call a JSON object {"name", "arguments"} between <tool_call> and
               </tool_call> (Qwen2/2.5/3, Hermes, SmolLM3; Strata's default for templates
               that do not render tools, server/tools.py)
  mistral      [TOOL_CALLS] then a JSON array of {"name", "arguments"} to the end of the
               answer (Mistral 7B v0.3's template)
  llama3_json  the answer is the call, {"name", "parameters"} (several joined by "; "),
               maybe after <|python_tag|> (Llama 3.1 / 3.2's JSON tool calling)
  phi4_mini_json  functools then a JSON array of {"name", "arguments"} to the end of the
               answer (Phi-4-mini's)

`auto` reads the chat template: <|tool|> means phi4_mini_json (Phi-4-mini's template lists
tools from a system message's own field, not the request's, so Strata's instructions show
them, written in that format); a template that does not render the `tools` variable gets
Strata's Hermes instructions, so hermes; else [TOOL_CALLS] means mistral, <|python_tag|>
llama3_json, and anything else hermes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from server.tokenizer import reads_variable

FORMATS = ("hermes", "mistral", "llama3_json", "phi4_mini_json")
PARSERS = ("auto", *FORMATS)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
PHI4_TOOL_TAG = "<|tool|>"
# the formats whose calls are one JSON array after a marker, and what opens the array
LIST_MARKS = {"mistral": (MISTRAL_MARK, " ["), "phi4_mini_json": ("functools", "[")}
# what starts the calls in streamed text: phi4's marker is a plain word ("functools.partial"
# is prose), so its bracket too
CALLS_START = {"mistral": MISTRAL_MARK, "phi4_mini_json": "functools["}


def resolve_format(name: str, template: str | None) -> str:
    """The format a server with --tool-call-parser `name` reads, for this chat template."""
    if name != "auto":
        return name
    if template and PHI4_TOOL_TAG in template:
        return "phi4_mini_json"
    if not template or not reads_variable(template, "tools"):
        return "hermes"
    if MISTRAL_MARK in template:
        return "mistral"
    if PYTHON_TAG in template:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class Call:
    """A call as JSON values (the arguments an object)."""
    name: str
    arguments: dict


def read_calls(fmt: str, body: str) -> list[Call] | None:
    """The calls in `body`, the text after a trailing format's marker (mistral: the array;
    llama3_json: the whole answer), or None when it is not calls."""
    text = body.strip()
    if fmt == "llama3_json" and text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    try:
        if fmt in LIST_MARKS:
            objects = json.loads(text)
            if not isinstance(objects, list):
                return None
        else:
            objects = _joined_objects(text)
    except ValueError:
        return None
    calls = [call_of(obj) for obj in objects]
    return None if not calls or None in calls else calls


def call_of(obj) -> Call | None:
    """{"name", "arguments" or "parameters"} (arguments maybe as JSON text) as a Call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):            # some models send the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return Call(obj["name"], arguments) if isinstance(arguments, dict) else None


def _joined_objects(text: str) -> list:
    """JSON objects joined by ";" (and whitespace): Llama 3's parallel calls."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while at < len(text):
        obj, at = decoder.raw_decode(text, at)
        objects.append(obj)
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    if not objects:
        raise ValueError("no JSON object")
    return objects


def calls_grammar(fmt: str, schemas: dict[str, dict], parallel: bool) -> str:
    """Lark for an answer of one call (or several, with `parallel`) in `fmt`, each call's
    arguments following its function's parameter schema."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    body = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, key: schema},
                       "required": ["name", key], "additionalProperties": False}
                      for name, schema in schemas.items()]}
    if fmt == "hermes":
        tags = json.dumps(HERMES_OPEN + "\n"), json.dumps("\n" + HERMES_CLOSE)
        call = f"call: {tags[0]} body {tags[1]}"
        more = '("\\n" call)*'
    else:
        call, more = "call: body", '("; " call)*' if fmt == "llama3_json" else '(", " call)*'
    calls = f"call {more}" if parallel else "call"
    start = (f"start: {json.dumps(''.join(LIST_MARKS[fmt]))} {calls} \"]\""
             if fmt in LIST_MARKS else f"start: {calls}")
    return f"{start}\n{call}\nbody: %json {json.dumps(body)}"


def format_call(fmt: str, name: str, arguments) -> str:
    """One call as the model writes it (Hermes: how Strata's default renders history)."""
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    if fmt in LIST_MARKS:
        return f"{''.join(LIST_MARKS[fmt])}{call}]"
    return f"{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}"
