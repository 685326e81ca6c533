"""End-to-end API tests: the real server and engine, driven with the `openai` package and httpx."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.server_helpers import MODEL, REQUEST_TIMEOUT_S, sse_payloads

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The capital of France is"


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", HELLO), **kw)


def stream_events(http, path: str, body: dict) -> tuple[httpx.Headers, list]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        return response.headers, list(sse_payloads(response.iter_lines()))


def max_model_len(client) -> int:
    return client.models.list().data[0].model_extra["max_model_len"]


# ------------------------------------------------------------------ basics
def test_health_is_ok_when_ready(http):
    assert http.get("/health").status_code == 200


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert max_model_len(client) > 0
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.body["code"] == "model_not_found"


def test_chat_completion_returns_text_and_usage(client):
    response = chat(client, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_returns_text_and_usage(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert response.object == "text_completion"
    assert isinstance(response.choices[0].text, str)
    assert 0 < response.usage.completion_tokens <= 6


def test_token_id_prompts_are_accepted(client):
    response = client.completions.create(model=MODEL, prompt=[[504, 3575, 282], [19556, 314]],
                                         max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == 5


def test_max_tokens_finishes_with_length(client):
    response = chat(client, max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 4


def test_unknown_extra_fields_are_ignored(client):
    response = chat(client, max_tokens=3, extra_body={"no_such_field": {"x": 1}, "foo": "bar"})
    assert response.choices[0].message.content is not None


# ------------------------------------------------------------------ streaming
def test_chat_stream_sends_role_content_finish_usage_done(http, client):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 12, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    headers, events = stream_events(http, "/v1/chat/completions", body)
    assert headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    unstreamed = chat(client, max_tokens=12, temperature=0).choices[0].message.content
    assert text == unstreamed


def test_completion_stream_matches_non_streamed_text(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    events = list(client.completions.create(stream=True, **kw))
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] in ("stop", "length")
    assert text == client.completions.create(**kw).choices[0].text


def test_stream_without_include_usage_has_no_usage_chunk(client):
    events = list(chat(client, max_tokens=4, stream=True))
    assert all(e.choices for e in events)
    assert all(e.usage is None for e in events)


# ------------------------------------------------------------------ n, seed, stop
def test_n_two_returns_two_choices_and_counts_prompt_once(client):
    one = chat(client, max_tokens=4, extra_body={"ignore_eos": True})
    two = chat(client, max_tokens=4, n=2, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.prompt_tokens == one.usage.prompt_tokens
    assert two.usage.completion_tokens == 8


def test_n_two_streams_both_choices(client):
    events = list(chat(client, max_tokens=4, n=2, stream=True, extra_body={"ignore_eos": True}))
    finished = {c.index for e in events for c in e.choices if c.finish_reason}
    assert finished == {0, 1}


def test_same_seed_gives_same_text(client):
    kw = dict(max_tokens=16, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    first = chat(client, **kw).choices[0].message.content
    second = chat(client, **kw).choices[0].message.content
    assert first == second


def _greedy_text(client) -> str:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_output_before_it(client, stream):
    full = _greedy_text(client)
    stop = full[8:12]
    assert stop.strip(), f"greedy text too short to pick a stop string: {full!r}"
    expected = full[:full.find(stop)]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "\x00never"],
              extra_body={"ignore_eos": True})
    if stream:
        events = list(client.completions.create(stream=True, **kw))
        text = "".join(e.choices[0].text for e in events if e.choices)
        reason = [e.choices[0].finish_reason for e in events if e.choices][-1]
    else:
        choice = client.completions.create(**kw).choices[0]
        text, reason = choice.text, choice.finish_reason
    assert text == expected and stop not in text
    assert reason == "stop"


def test_chat_stop_string_is_not_included(client):
    full = chat(client, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    content = full.choices[0].message.content
    stop = content[6:9]
    assert stop.strip(), content
    stopped = chat(client, max_tokens=30, temperature=0, stop=stop, extra_body={"ignore_eos": True})
    assert stopped.choices[0].message.content == content[:content.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ logprobs
def test_chat_logprobs_have_openai_shape(client):
    response = chat(client, max_tokens=5, logprobs=True, top_logprobs=3,
                    extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 5
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0.0
        assert isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        assert all(t.logprob <= 0.0 for t in entry.top_logprobs)


def test_completion_logprobs_have_legacy_shape(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2,
                                         extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 4
    assert all(isinstance(d, dict) and 2 <= len(d) <= 3 for d in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("path, change, param", [
    ("/v1/chat/completions", {"temperature": -0.5}, "temperature"),
    ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": []}, "prompt"),
])
def test_invalid_values_are_400_naming_the_param(http, path, change, param):
    base = ({"model": MODEL, "messages": HELLO} if "chat" in path
            else {"model": MODEL, "prompt": PROMPT})
    response = http.post(path, json={**base, "max_tokens": 4, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert "Traceback" not in response.text


def test_missing_messages_is_400(http):
    response = http.post("/v1/chat/completions", json={"model": MODEL})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_context_length_exceeded_names_both_numbers(client):
    limit = max_model_len(client)
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=limit * 2)
    error = info.value.body
    assert info.value.status_code == 400 and error["code"] == "context_length_exceeded"
    assert str(limit) in error["message"] and str(limit * 2) in error["message"]


def test_prompt_alone_longer_than_context_is_400(client):
    limit = max_model_len(client)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[504] * limit, max_tokens=1)
    assert info.value.body["code"] == "context_length_exceeded"
    assert str(limit) in info.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=HELLO, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


# ------------------------------------------------------------------ lifecycle
def _kv_pages_used(server) -> float:
    """Pages requests hold (the prefix cache's own do not count)."""
    return server.metric("strata_kv_pages_used")


def test_client_disconnect_frees_kv_pages(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            contents = 0
            for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    contents += 1
                    if contents == 3:
                        break
            assert _kv_pages_used(server) > 0
    deadline = time.monotonic() + 30
    while _kv_pages_used(server) > 0:
        assert time.monotonic() < deadline, "KV pages were not freed after the client left"
        time.sleep(0.2)
    assert server.metric("strata_requests_running") == 0


def test_short_request_finishes_while_long_stream_runs(server, client):
    long_started, long_finished, stop_reading = (threading.Event(), threading.Event(),
                                                 threading.Event())

    def read_long_stream():
        stream = chat(client, max_tokens=300, stream=True, extra_body={"ignore_eos": True})
        with stream:
            for event in stream:
                if event.choices and event.choices[0].delta.content:
                    long_started.set()
                if event.choices and event.choices[0].finish_reason:
                    long_finished.set()
                if stop_reading.is_set():
                    break

    reader = threading.Thread(target=read_long_stream)
    reader.start()
    try:
        assert long_started.wait(REQUEST_TIMEOUT_S)
        short = chat(client, max_tokens=5, extra_body={"ignore_eos": True})
        assert short.usage.completion_tokens == 5
        assert not long_finished.is_set(), "the short request waited for the long one"
    finally:
        stop_reading.set()
        reader.join(REQUEST_TIMEOUT_S)


def test_metrics_expose_request_histograms_and_counters(server, client):
    chat(client, max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    for name in ("strata_requests_running", "strata_requests_waiting",
                 "strata_time_to_first_token_seconds_count",
                 "strata_inter_token_latency_seconds_count",
                 "strata_e2e_request_latency_seconds_count",
                 "strata_request_queue_time_seconds_count", "strata_prompt_tokens_total",
                 "strata_generation_tokens_total",
                 'strata_request_success_total{finished_reason="length"}',
                 'strata_admission_rejections_total{reason="queue_full"}',
                 'strata_kv_tier_capacity_bytes{tier="device"}'):
        assert name in text, name
    assert server.metric("strata_generation_tokens_total") >= 3
    assert server.metric("strata_kv_tier_capacity_bytes", 'tier="device"') > 0
