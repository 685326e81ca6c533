"""A request's structured-output fields (OpenAI's response_format, vLLM's structured_outputs
and its older guided_* fields) to the grammar the engine follows, without a server."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from scheduler.sampling_params import GrammarSpec
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.structured import grammar_for

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {
    "type": "object", "properties": {"c": {"type": "string"}}}}, "required": ["a"]}


def _grammar(**fields) -> GrammarSpec | None:
    return grammar_for(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                             **fields))


@pytest.mark.parametrize("so, guided", [
    ({"choice": ["yes", "no"]}, {"guided_choice": ["yes", "no"]}),
    ({"regex": "[0-9]{3}"}, {"guided_regex": "[0-9]{3}"}),
    ({"json": SCHEMA}, {"guided_json": SCHEMA}),
    ({"json": json.dumps(SCHEMA)}, {"guided_json": SCHEMA}),
    ({"grammar": 'start: "a"+'}, {"guided_grammar": 'start: "a"+'}),
    ({"json_object": True, "disable_any_whitespace": True, "disable_fallback": True},
     {"response_format": {"type": "json_object"}}),
])
def test_structured_outputs_ask_what_the_guided_fields_ask(so, guided):
    assert _grammar(structured_outputs=so) == _grammar(**guided) is not None


def test_disable_additional_properties_closes_the_open_objects():
    open_ = json.loads(_grammar(structured_outputs={"json": SCHEMA}).source)
    assert "additionalProperties" not in open_
    closed = json.loads(_grammar(structured_outputs={
        "json": dict(SCHEMA, additionalProperties=True),
        "disable_additional_properties": True}).source)
    assert closed["additionalProperties"] is True                   # said: kept
    assert closed["properties"]["b"]["additionalProperties"] is False
    assert closed["properties"]["a"] == {"type": "integer"}         # not an object: as is


def test_disable_additional_properties_closes_pattern_objects_and_refuses_deep_ones():
    patterned = {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}
    closed = json.loads(_grammar(structured_outputs={
        "json": patterned, "disable_additional_properties": True}).source)
    assert closed["additionalProperties"] is False          # as vLLM closes them
    deep: dict = {"type": "integer"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    for fields in ({"structured_outputs": {"json": deep, "disable_additional_properties": True}},
                   {"structured_outputs": {"json": deep}}, {"guided_json": deep}):
        with pytest.raises(APIError, match="nests too deep"):        # a 400, not a 500
            _grammar(**fields)


@pytest.mark.parametrize("so", [{}, {"choice": ["a"], "regex": "a"}, {"json_object": False},
                                {"regex": "a", "structural_tag": "{}"},
                                {"regex": "a", "whitespace_pattern": " "},
                                {"choice": []}])
def test_structured_outputs_takes_exactly_one_constraint_it_honours(so):
    with pytest.raises(ValidationError):
        _grammar(structured_outputs=so)


def test_one_kind_of_constraint_a_request():
    with pytest.raises(APIError, match="Only one of guided_regex, structured_outputs"):
        _grammar(structured_outputs={"regex": "a"}, guided_regex="b")
    req = CompletionRequest(prompt="x", structured_outputs={"regex": "[a-z]"})
    assert grammar_for(req) == GrammarSpec("regex", "[a-z]")
