"""Structured outputs, tool calls, logit_bias, echo and tokenize through the official openai
SDK against a real server; unsupported and invalid fields are 400s in the OpenAI shape."""
from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: str = Field(max_length=20)
    age: int = Field(ge=0, le=30)
    # NOTE: every string bounded: sampled at temperature 0.7, an unbounded toy's name could
    # outrun max_tokens (it did once in 1,100 runs), which tests the model, not parse()
    toys: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet, max_tokens=200, temperature=0.7, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert 0 <= choice.message.parsed.age <= 30


NESTED = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 30},
    "rating": {"type": "number", "minimum": 0, "maximum": 5},
    "genre": {"enum": ["drama", "comedy", "horror"]},
    "cast": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "lead": {"type": "boolean"}},
        "required": ["name", "lead"], "additionalProperties": False}},
    "sequel": {"type": ["string", "null"], "maxLength": 20}},
    "required": ["title", "rating", "genre", "cast"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_with_nesting_arrays_enums_numbers(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a film."}],
              response_format={"type": "json_schema", "json_schema": {
                  "name": "film", "schema": NESTED, "strict": True}},
              max_tokens=150, temperature=0.7, seed=5)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(**kw)
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), NESTED)


def test_json_object_mode_and_guided_fields(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A JSON object about cats."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0.7, seed=2)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, temperature=1.0,
                                       extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = client.completions.create(model=MODEL, prompt="Order number:", max_tokens=10,
                                  extra_body={"guided_regex": "[0-9]{4}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()


def test_vllm_structured_outputs(client):
    """vLLM's structured_outputs (what replaced guided_* in its v0.12): choice, regex, a JSON
    schema closed by disable_additional_properties, json_object; on both routes."""
    def chat(so, **kw):
        r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=4,
                                           extra_body={"structured_outputs": so},
                                           **{"max_tokens": 40, **kw})
        return r.choices[0]

    assert chat({"choice": ["sunny", "rainy"]}, max_tokens=10).message.content in ("sunny",
                                                                                 "rainy")
    r = client.completions.create(model=MODEL, prompt="Order number:", max_tokens=10,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    closed = dict(schema, additionalProperties=False)
    choice = chat({"json": schema, "disable_additional_properties": True}, max_tokens=60)
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), closed)
    choice = chat({"json_object": True, "disable_any_whitespace": True}, max_tokens=60)
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)


def _call_round_trip(client, stream: bool):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
              parallel_tool_calls=False, max_tokens=80, temperature=0.0)
    if stream:
        calls = {}
        reason = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            for d in delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert reason == "tool_calls" and len(calls) == 1
        call = calls[0]
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        assert len(r.choices[0].message.tool_calls) == 1
        c = r.choices[0].message.tool_calls[0]
        assert c.type == "function"
        call = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
    assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
    schema = (WEATHER if call["name"] == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(json.loads(call["arguments"]), schema)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call["id"], "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                            tool_choice="none", max_tokens=30, temperature=0.0)
    assert answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(client, stream):
    _call_round_trip(client, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_constrains_the_arguments(client, stream):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0.0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:
        pieces = [d for chunk in client.chat.completions.create(stream=True, **kw)
                  if chunk.choices for d in chunk.choices[0].delta.tool_calls or ()]
        assert pieces[0].function.name == "get_time" and pieces[0].id
        arguments = "".join(p.function.arguments or "" for p in pieces)
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and r.choices[0].message.content is None
        arguments = call.function.arguments
    jsonschema.validate(json.loads(arguments), TIME["function"]["parameters"])


def test_logit_bias_minus_100_bans_a_token(client, http):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0.0)
    free = client.completions.create(**kw).choices[0].text
    first = http.post("/v1/tokenize", json={"prompt": free, "add_special_tokens": False}).json()
    banned = first["tokens"][0]
    r = client.completions.create(logit_bias={str(banned): -100}, **kw)
    again = http.post("/v1/tokenize", json={"prompt": r.choices[0].text,
                                            "add_special_tokens": False}).json()["tokens"]
    assert r.choices[0].text != free and banned not in again


def test_tokenize_detokenize_and_echo(client, http):
    t = http.post("/v1/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": ASK}).json()
    render = http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": ASK})
    assert render.json()["token_ids"] == chat["tokens"]
    render = http.post("/v1/completions/render", json={"prompt": "Hello world"}).json()
    assert render["token_ids"] == t["tokens"]
    usage = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                  echo=True, temperature=0.0)
    assert r.choices[0].text.startswith("Once upon a time") and len(r.choices[0].text) > 16


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"properties": {"a": {"$ref": "#/$defs/nope"}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "[a-z"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "strnig"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
])
def test_invalid_or_unsupported_fields_are_400s(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"] or "").startswith(param), error


def test_completions_refuse_what_they_cannot_honour(http):
    for body, param in (({"suffix": "end"}, "suffix"), ({"best_of": 3}, None)):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_repetition_penalty_and_min_p_change_the_output(client):
    kw = dict(model=MODEL, prompt="one, two, one, two, one, two,", max_tokens=12,
              temperature=0.0)
    free = client.completions.create(**kw).choices[0].text
    penalized = client.completions.create(extra_body={"repetition_penalty": 3.0}, **kw)
    assert penalized.choices[0].text != free
    r = client.completions.create(extra_body={"min_p": 1.0}, **{**kw, "temperature": 1.0})
    assert r.choices[0].text == free          # min_p 1: only the top token is left


def test_harmless_unknown_fields_are_ignored(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                       metadata={"team": "a"}, store=False,
                                       extra_body={"some_vendor_field": 1})
    assert r.choices[0].message.content is not None


def test_sdk_errors_are_bad_requests(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": 5}}})
