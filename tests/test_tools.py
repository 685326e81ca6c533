"""Tool calls without a model: reading calls out of text (whole and streamed), rendering tools
and the history (the default format and a template's own), and the 400s of plan_tools."""
from __future__ import annotations

import json

import pytest

from server.errors import APIError
from server.protocol import ChatCompletionRequest
from server.tool_parser import ParsedCall, StreamedCalls, ToolCallParser, split_answer
from server.tokenizer import Tokenizer
from server.tool_formats import HERMES_CLOSE as CALL_CLOSE, HERMES_OPEN as CALL_OPEN
from server.tools import chat_messages, format_call, plan_tools

NAMES = frozenset({"get_weather", "get_time"})
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(name: str, arguments: dict) -> str:
    return format_call(name, arguments)


def test_calls_and_content_are_split():
    text = ("Let me check. " + call("get_weather", {"city": "Paris"}) + "\n"
            + call("get_time", {"city": "Oslo"}))
    content, calls = split_answer(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo"})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_what_is_not_a_call_stays_content():
    unknown = call("launch_rockets", {})
    broken = f"{CALL_OPEN}\n{{not json\n{CALL_CLOSE}"
    for text in (unknown, broken, "a < b and <tool but no call"):
        assert split_answer(text, NAMES) == (text, [])


def test_a_call_missing_its_closing_tag_at_the_end_counts():
    text = f'{CALL_OPEN}\n{{"name": "get_time", "arguments": {{"city": "Rome"}}}}'
    content, calls = split_answer(text, NAMES)
    assert content is None and calls[0].name == "get_time"


def test_parallel_false_keeps_the_first_call():
    text = call("get_weather", {"city": "A"}) + call("get_time", {"city": "B"})
    _, calls = split_answer(text, NAMES, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]


def test_streamed_text_gives_the_same_events_as_whole_text():
    text = "Sure. " + call("get_weather", {"city": "Paris"}) + " done"
    whole = ToolCallParser(NAMES)
    expected = whole.push(text) + whole.flush()
    for step in (1, 3, 7):
        parser = ToolCallParser(NAMES)
        events = []
        for i in range(0, len(text), step):
            events += parser.push(text[i:i + step])
        events += parser.flush()
        merged = _merge(events)
        assert [e if isinstance(e, str) else (e.name, e.arguments) for e in merged] == \
            [e if isinstance(e, str) else (e.name, e.arguments) for e in _merge(expected)]


def _merge(events):
    out = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e)
    return out


def test_a_possible_tag_start_is_held_back():
    parser = ToolCallParser(NAMES)
    assert parser.push("Hello <tool") == ["Hello "]
    assert parser.push("box>") == ["<toolbox>"]


def test_streamed_deltas_accumulate_into_calls():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL])
    state = StreamedCalls(plan_tools(request))
    text = call("get_weather", {"city": "Paris"})
    deltas = [d for ch in text for d in state.push(ch)] + state.flush()
    pieces = [t for d in deltas for t in d.tool_calls or ()]
    assert len(pieces) == 1 and pieces[0].index == 0 and pieces[0].function.name == "get_weather"
    assert state.finish_reason("stop") == "tool_calls"
    assert state.finish_reason("length") == "length"


def test_named_choice_streams_the_arguments_as_they_come():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
                                    tool_choice={"type": "function",
                                                 "function": {"name": "get_weather"}})
    plan = plan_tools(request)
    assert plan.mode == "named" and json.loads(plan.grammar.source) == TOOL["function"]["parameters"]
    state = StreamedCalls(plan)
    first, second = state.push('{"city": '), state.push('"Paris"}')
    assert first[0].tool_calls[0].id and first[0].tool_calls[0].function.name == "get_weather"
    assert second[0].tool_calls[0].id is None
    assert second[0].tool_calls[0].function.arguments == '"Paris"}'


@pytest.mark.parametrize("body, param", [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_plan_tools_refuses(body, param):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **body)
    with pytest.raises(APIError) as info:
        plan_tools(request)
    assert info.value.status == 400 and info.value.param == param


HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


def test_default_format_folds_tools_into_plain_messages():
    request = ChatCompletionRequest(messages=HISTORY, tools=[TOOL])
    messages, tools = chat_messages(request, "{{ messages }}")
    assert tools is None
    assert messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == call("get_weather", {"city": "Paris"})
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}


def test_a_template_that_knows_tools_renders_them_itself(smollm2_dir):
    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
                "{{ c.function.arguments.city }}]{% endfor %}{% endfor %}")
    request = ChatCompletionRequest(messages=HISTORY, tools=[TOOL])
    messages, tools = chat_messages(request, template)
    assert tools[0]["function"]["name"] == "get_weather"
    tok = Tokenizer.from_folder(smollm2_dir)
    tok.chat_template = template
    text = tok.apply_chat_template(messages, tools)
    assert text == ("[tool get_weather]<user>Weather in Paris?<assistant>"
                    "[call get_weather Paris]<tool>18 C")
    assert isinstance(ParsedCall("f", "{}").id, str)
