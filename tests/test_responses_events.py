"""The Responses API's output items and stream events without a model (server/responses_events.py),
its input translation (server/responses_protocol.py) and its store (server/response_store.py)."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.outputs import TokenLogprob
from server.choice_stream import ChoiceDelta
from server.protocol import ChatCompletionRequest
from server.response_store import MissingResponse, ResponseStore, StoredResponse
from server.responses_events import ResponseEvents
from server.responses_protocol import ResponsesRequest, chat_messages_of, item_records
from server.responses_wire import LogprobEntry, ResponseObject, ResponseUsage
from server.tools import format_call, plan_tools

USAGE = ResponseUsage(input_tokens=3, input_tokens_details={"cached_tokens": 0},
                      output_tokens=2, total_tokens=5)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def plan_for(**fields):
    return plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                            tools=[WEATHER, TIME], **fields))


def run(texts, plan=None, reason="stop", logprobs=None, token_logprobs=()):
    """Every event, and the final response, of an answer streamed as `texts`."""
    built = ResponseEvents(ResponseObject(id="resp_1", created_at=0, model="m"), plan, logprobs)
    events = built.start()
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        events += built.push(ChoiceDelta(0, text, token_logprobs[i] if token_logprobs else (),
                                         reason if last else None))
    events += built.finish(reason, USAGE)
    return events, built.response


def shape(response):
    """The output items without their generated ids."""
    return [{k: v for k, v in item.model_dump().items() if k not in ("id", "call_id")}
            for item in response.output]


def test_text_events_come_in_the_sdk_order_and_build_one_message():
    events, response = run(["Hel", "lo", ""])
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:8])
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"
    assert events[6]["text"] == "Hello" and events[8]["item"]["status"] == "completed"
    assert response.status == "completed" and response.output_text() == "Hello"
    assert events[-1]["response"]["usage"]["total_tokens"] == 5
    assert events[0]["response"]["status"] == "in_progress" and not events[0]["response"]["output"]


def test_the_length_limit_makes_the_response_and_its_message_incomplete():
    events, response = run(["a", "b"], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_an_empty_answer_is_an_empty_message_without_tools():
    _, response = run([""])
    assert shape(response) == [{"type": "message", "role": "assistant", "status": "completed",
                                "content": [{"type": "output_text", "text": "",
                                             "annotations": [], "logprobs": None}]}]


ANSWER = ("Let me check. " + format_call("get_weather", {"city": "Paris"}) + "\n"
          + format_call("get_time", {}) + "\n")


@pytest.mark.parametrize("size", [1, 3, 7, len(ANSWER)])
def test_calls_and_text_are_items_the_same_streamed_or_whole(size):
    chunks = [ANSWER[i:i + size] for i in range(0, len(ANSWER), size)]
    events, response = run(chunks, plan_for())
    assert shape(response) == [
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": [],
                      "logprobs": None}]},
        {"type": "function_call", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "status": "completed"},
        {"type": "function_call", "name": "get_time", "arguments": "{}",
         "status": "completed"}]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == [0, 1, 2]
    assert [e["item"]["id"] for e in added] == [e["item"]["id"] for e in done]
    assert response.output[1].call_id != response.output[2].call_id
    assert response.output[1].call_id.startswith("call_")


def test_whitespace_around_calls_is_no_text():
    text = format_call("get_time", {}) + "\n  \n" + format_call("get_time", {}) + "\n  Done."
    _, response = run([text[:30], text[30:]], plan_for())
    assert [i.type for i in response.output] == ["function_call", "function_call", "message"]
    assert response.output[2].content[0].text == "Done."


def test_a_named_function_streams_its_arguments():
    plan = plan_for(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    events, response = run(['{"ci', 'ty": ', '"Oslo"}'], plan)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"ci', 'ty": ', '"Oslo"}']
    (call,) = response.output
    assert call.name == "get_weather" and call.arguments == '{"city": "Oslo"}'
    assert [e for e in events if e["type"] == "response.function_call_arguments.done"][0][
        "arguments"] == '{"city": "Oslo"}'


def _token(i: int) -> tuple:
    return ((TokenLogprob(i, -0.5), (TokenLogprob(i, -0.5), TokenLogprob(i + 1, -1.0))),)


def test_logprobs_go_with_the_text_they_wrote_not_with_calls():
    def fmt(entries):
        return [LogprobEntry(token=str(s.token_id), logprob=s.logprob, bytes=[],
                             top_logprobs=[]) for s, _ in entries]
    call = format_call("get_time", {})
    texts = ["Hi", " there", call, "\nbye"]
    events, response = run(texts, plan_for(), logprobs=fmt,
                           token_logprobs=[_token(i) for i in range(4)])
    tokens = [[e["token"] for e in ev["logprobs"]] for ev in events
              if ev["type"] == "response.output_text.delta"]
    assert tokens == [["0"], ["1"], ["3"]]
    assert [p.token for p in response.output[0].content[0].logprobs] == ["0", "1"]
    assert [p.token for p in response.output[2].content[0].logprobs] == ["3"]


def test_a_failure_ends_the_stream_with_response_failed():
    built = ResponseEvents(ResponseObject(id="resp_1", created_at=0, model="m"), None)
    built.start()
    (event,) = built.fail("disk error")
    assert event["type"] == "response.failed"
    assert event["response"]["error"] == {"code": "server_error", "message": "disk error"}


# ----------------------------------------------------------------------------- input items

def test_items_become_chat_messages_calls_joining_their_turn():
    request = ResponsesRequest(input=[
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": []},
        {"role": "developer", "content": [{"type": "input_text", "text": "be brief"}]}])
    messages = chat_messages_of(request.input_items())
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "developer"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]
    assert messages[1]["content"] == "Checking." and messages[2]["tool_call_id"] == "c1"
    ChatCompletionRequest(messages=messages)            # what the chat path accepts
    records = item_records(request.input_items())
    assert [r["type"] for r in records] == ["message", "message", "function_call",
                                            "function_call", "function_call_output", "message"]
    assert all(r["id"] and r["status"] == "completed" for r in records)
    # records read back as the same items (the store keeps records)
    assert chat_messages_of(ResponsesRequest(input=records).input_items()) == messages


@pytest.mark.parametrize("body", [
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    {"input": [{"type": "item_reference", "id": "x"}]},
    {"input": "hi", "reasoning": {"effort": "high"}},
    {"input": "hi", "conversation": "conv_1"},
    {"input": "hi", "background": "yes"},
    {"input": "hi", "tools": [{"type": "web_search"}]},
    {"input": "hi", "top_logprobs": 21},
])
def test_what_a_text_model_cannot_honour_is_refused(body):
    with pytest.raises(ValidationError):
        ResponsesRequest(**body)


def test_the_chat_fields_of_a_request():
    r = ResponsesRequest(input="hi", max_output_tokens=5, tools=[
        {"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"}, include=[
            "message.output_text.logprobs"], top_logprobs=2,
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                 **r.chat_fields())
    assert chat.max_tokens == 5 and chat.logprobs and chat.top_logprobs == 2
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


# ----------------------------------------------------------------------------- the store

def entry(rid: str, previous: str | None = None, text: str = "x") -> StoredResponse:
    out = {"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": f"answer {rid}", "annotations": []}]}
    return StoredResponse({"id": rid, "output": [out]},
                          [{"id": f"in_{rid}", "type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": text}]}], previous)


def test_a_conversation_is_its_turns_oldest_first():
    store = ResponseStore(1 << 20)
    store.put(entry("a"))
    store.put(entry("b", "a"))
    store.put(entry("c", "b"))
    items = store.conversation("c")
    assert [i["id"] for i in items] == ["in_a", "msg_a", "in_b", "msg_b", "in_c", "msg_c"]
    assert store.delete("b") and not store.delete("b")
    with pytest.raises(MissingResponse) as missing:
        store.conversation("c")
    assert missing.value.response_id == "b"


def test_the_store_keeps_its_byte_budget_least_recently_used_first():
    one = len(json.dumps([entry("a").response, entry("a").input_items]))
    store = ResponseStore(3 * one + 10)
    for rid in "abc":
        store.put(entry(rid))
    store.get("a")                          # used: "b" is now the oldest
    store.put(entry("d"))
    assert len(store) == 3 and store.bytes <= store.max_bytes
    with pytest.raises(MissingResponse):
        store.get("b")
    assert not store.put(entry("e", text="y" * (4 * one)))      # alone over the budget
    assert not ResponseStore(0).enabled and not ResponseStore(0).put(entry("f"))
