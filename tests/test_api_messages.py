"""The Anthropic Messages API (/v1/messages) through the official anthropic SDK against a real
server: the chat completion it means, the stream the SDK accumulates, stop sequences, tool use
and results, structured output, token counts, the prefix cache as cache reads, and errors in
Anthropic's shape."""
from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from tests.server_helpers import MODEL, fresh_salt, openai_client

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}           # (the SDK no longer has the argument: the body has it)
ASK = [{"role": "user", "content": "Name three planets."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    # NOTE: float32 activations: with bf16 (--dtype auto on a CPU with AVX512_BF16) the
    # bundled model stands at near ties these answers cross (docs/perf-notes.md, 2026-11-29)
    from tests.server_helpers import running_server
    with running_server("--dtype", "fp32") as proc:
        yield proc


@pytest.fixture(scope="module")
def anth(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0,
                               timeout=300)


def create(anth, **kw):
    return anth.messages.create(model=MODEL, extra_body=GREEDY, **kw)


def test_a_message_is_the_chat_completion_it_means(anth, server_url):
    # (each computed whole: tests/server_helpers.fresh_salt)
    m = anth.messages.create(model=MODEL, max_tokens=30, system="Answer briefly.",
                             messages=ASK, extra_body={**GREEDY, **fresh_salt()})
    chat = openai_client(server_url).chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0.0, extra_body=fresh_salt(),
        messages=[{"role": "system", "content": "Answer briefly."}, *ASK])
    (block,) = m.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length"
                             else "end_turn") and m.stop_sequence is None
    usage = chat.usage
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert m.usage.output_tokens == usage.completion_tokens
    count = anth.messages.count_tokens(model=MODEL, system="Answer briefly.", messages=ASK)
    assert count.input_tokens == usage.prompt_tokens


def test_the_stream_builds_the_same_message(anth):
    kw = dict(max_tokens=200, messages=[{"role": "user", "content": "Say hello."}])
    whole = anth.messages.create(model=MODEL, extra_body={**GREEDY, **fresh_salt()}, **kw)
    with anth.messages.stream(model=MODEL, extra_body={**GREEDY, **fresh_salt()},
                              **kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text and final.content[0].text
    assert final.stop_reason == whole.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_max_tokens_past_the_context_is_what_the_context_leaves(anth):
    # Claude Code asks for 32000 output tokens whatever the server's context
    m = create(anth, max_tokens=32000, messages=[{"role": "user", "content": "Hi."}])
    assert m.stop_reason in ("end_turn", "max_tokens") and m.content


def test_a_stop_sequence_ends_it_and_is_named(anth):
    m = create(anth, max_tokens=60, stop_sequences=["Venus"],
               messages=[{"role": "user", "content": "List the planets in order."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Venus"
    assert "Venus" not in m.content[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_and_its_result_round_trip(anth, stream):
    kw = dict(max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        with anth.messages.stream(model=MODEL, extra_body=GREEDY, **kw) as s:
            partial = "".join(e.delta.partial_json for e in s if e.type == "content_block_delta"
                              and e.delta.type == "input_json_delta")
            m = s.get_final_message()
        assert json.loads(partial) == m.content[0].input
    else:
        m = create(anth, **kw)
    (use,) = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answer = create(anth, max_tokens=30, tools=[WEATHER], messages=[
        *kw["messages"], {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 degrees, sunny"}]}])
    assert answer.content and all(b.type == "text" for b in answer.content)


def test_any_tool_without_parallel_use_is_one_call(anth):
    m = create(anth, max_tokens=80, tools=[WEATHER],
               tool_choice={"type": "any", "disable_parallel_tool_use": True},
               messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"


class Planet(BaseModel):
    # NOTE: the SDK drops maxLength from the schema it sends (and checks it itself): only
    # closed choices keep a small model's answer short
    name: Literal["Mercury", "Venus", "Earth", "Mars", "Jupiter"]
    rocky: bool


def test_an_output_format_constrains_the_answer(anth):
    m = anth.messages.parse(model=MODEL, max_tokens=60, output_format=Planet,
                            messages=[{"role": "user", "content": "Describe a planet."}])
    assert isinstance(m.parsed_output, Planet) and m.stop_reason == "end_turn"


def test_a_resent_prompt_is_read_from_the_cache(anth):
    system = "You are a helpful assistant. " * 40          # several full pages
    first = create(anth, max_tokens=4, system=system, messages=ASK)
    again = create(anth, max_tokens=4, system=system, messages=ASK)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == \
        first.usage.input_tokens + first.usage.cache_read_input_tokens
    salted = anth.messages.create(model=MODEL, max_tokens=4, system=system, messages=ASK,
                                  extra_body={**GREEDY, **fresh_salt()})   # vLLM's cache_salt
    assert salted.usage.cache_read_input_tokens == 0


@pytest.mark.parametrize("body, status, kind", [
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, 400, "invalid_request_error"),
    ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error"),       # no max_tokens
    ({"model": "claude-none", "max_tokens": 5, "messages": ASK}, 404, "not_found_error"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK,
      "tool_choice": {"type": "tool"}}, 400, "invalid_request_error"),
])
def test_errors_come_in_anthropics_shape(server_url, body, status, kind):
    r = httpx.post(f"{server_url}/v1/messages", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert r.json()["error"]["message"]
