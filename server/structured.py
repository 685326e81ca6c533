"""Structured outputs: from a request's response_format (or vLLM's structured_outputs and its
older guided_* fields) to the engine's GrammarSpec, checked here so that a bad schema is a 400
before anything runs."""
from __future__ import annotations

import json
from typing import Any

from engine.grammar import GrammarError, check_grammar
from scheduler.sampling_params import GrammarSpec
from server.errors import invalid_request
from server.protocol_tools import (ResponseFormatJsonObject, ResponseFormatJsonSchema,
                                   ResponseFormatText)


def checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec`, or the 400 naming `param` with the grammar library's reason."""
    try:
        check_grammar(spec)
    except GrammarError as exc:
        raise invalid_request(f"Invalid '{param}': {_first_line(str(exc))}", param=param) \
            from None
    return spec


def schema_spec(schema: Any, param: str, closed: bool = False) -> GrammarSpec:
    """A JSON Schema (an object, or JSON text of one) as a checked GrammarSpec; `closed`: its
    objects that leave additionalProperties out get none (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise invalid_request(f"Invalid '{param}': not valid JSON.", param=param) from None
    if not isinstance(schema, dict):
        raise invalid_request(f"Invalid '{param}': a JSON Schema is an object.", param=param)
    try:
        text = json.dumps(_closed(schema) if closed else schema)
    except RecursionError:
        raise invalid_request(f"Invalid '{param}': the schema nests too deep.",
                              param=param) from None
    return checked(GrammarSpec("json_schema", text), param)


def _closed(node: Any) -> Any:
    """The schema with `additionalProperties: false` in every object schema that has
    properties (or patternProperties) and does not say, as vLLM closes them."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if ("properties" in out or "patternProperties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def choice_spec(choices: list[str], param: str) -> GrammarSpec:
    """The output is one of `choices`, as written."""
    # NOTE: JSON string escapes are Lark's: any choice is one literal
    alternatives = " | ".join(json.dumps(choice) for choice in choices)
    return checked(GrammarSpec("lark", f"start: {alternatives}"), param)


def grammar_for(request) -> GrammarSpec | None:
    """The grammar the request's output must follow, or None (free text)."""
    fields = request.guided_fields()
    if isinstance(fields.get("response_format"), ResponseFormatText):
        del fields["response_format"]
    if not fields:
        return None
    if len(fields) > 1:
        names = sorted(fields)
        raise invalid_request(f"Only one of {', '.join(names)} may be given.", param=names[1])
    (name, value), = fields.items()
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    if name == "guided_json":
        return schema_spec(value, name)
    if name == "guided_regex":
        return checked(GrammarSpec("regex", value), name)
    if name == "guided_choice":
        return choice_spec(value, name)
    return checked(GrammarSpec("lark", value), name)


def _structured_outputs(value) -> GrammarSpec:
    """vLLM's structured_outputs (server.protocol.StructuredOutputs: one constraint)."""
    param = "structured_outputs"
    if value.json_schema is not None:
        return schema_spec(value.json_schema, f"{param}.json",
                           closed=bool(value.disable_additional_properties))
    if value.regex is not None:
        return checked(GrammarSpec("regex", value.regex), f"{param}.regex")
    if value.choice is not None:
        return choice_spec(value.choice, f"{param}.choice")
    if value.grammar is not None:
        return checked(GrammarSpec("lark", value.grammar), f"{param}.grammar")
    return GrammarSpec("json_object")


def _response_format(value) -> GrammarSpec:
    if isinstance(value, ResponseFormatJsonObject):
        return GrammarSpec("json_object")
    assert isinstance(value, ResponseFormatJsonSchema)
    schema = value.json_schema.schema_
    if schema is None:                      # a name without a schema: any JSON object
        return GrammarSpec("json_object")
    return schema_spec(schema, "response_format.json_schema.schema")


def check_constrained(grammar: GrammarSpec | None, request) -> None:
    """Fields that cannot go with a grammar: its end is the only end the output may have."""
    if grammar is None:
        return
    if request.ignore_eos:
        raise invalid_request("ignore_eos cannot be combined with structured outputs or "
                              "tool calls: the grammar decides where the output ends.",
                              param="ignore_eos")
    if request.min_tokens:
        raise invalid_request("min_tokens cannot be combined with structured outputs or "
                              "tool calls: the grammar decides where the output ends.",
                              param="min_tokens")


def logit_bias_pairs(request, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs, ids checked against the vocabulary."""
    pairs = []
    for key, bias in (request.logit_bias or {}).items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise invalid_request(f"Invalid 'logit_bias': token id {token} is out of range "
                                  f"[0, {vocab_size}).", param="logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return line[:500]

