"""End-to-end: bad input is a 4xx for its own request only, and the server says the truth
about what can never be admitted (a server of its own: --max-waiting 4, a small body limit)."""
from __future__ import annotations

import os
import threading
import time

import httpx
import openai
import pytest

from tests.server_helpers import MODEL, REQUEST_TIMEOUT_S, openai_client, running_server

pytestmark = pytest.mark.slow

MAX_BYTES = 2_000_000
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server():
    with running_server("--max-waiting", "4", "--max-request-bytes", str(MAX_BYTES)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def post(server, body: bytes | dict, path: str = "/v1/chat/completions",
         **kw) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(server.url + path, json=body, timeout=REQUEST_TIMEOUT_S, **kw)
    return httpx.post(server.url + "/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=REQUEST_TIMEOUT_S,
                      **kw)


def test_more_choices_than_the_queue_holds_is_400_not_429(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, n=5)
    assert info.value.body["code"] == "too_many_choices"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=1, n=2)
    ok = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, n=4)
    assert len(ok.choices) == 4


def test_a_priority_without_the_priority_policy_is_400(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                       extra_body={"priority": 3})
    assert info.value.body["code"] == "priority_not_enabled"
    assert info.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", max_tokens=1,
                                  extra_body={"priority": -1})
    ok = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                        extra_body={"priority": 0})
    assert ok.choices[0].finish_reason == "length"


def test_a_requests_own_chat_template_needs_the_servers_trust(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1,
                                       extra_body={"chat_template": "{{ messages }}"})
    assert info.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in info.value.body["message"]


def test_fill_in_the_middle_needs_a_model_with_fim_tokens(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="def f(", suffix=")", max_tokens=2)
    assert info.value.body["param"] == "suffix"
    r = post(server, {"input_prefix": "def f(", "input_suffix": ")"}, path="/infill")
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_prefix"


def test_seed_outside_64_bits_is_400_and_harms_no_one(server, client):
    for seed in (2 ** 64, 10 ** 30, -2 ** 63 - 1):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, seed=seed)
        assert info.value.body["param"] == "seed"
    edge = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=2,
                                          seed=2 ** 63 - 1)
    assert all(c.finish_reason == "length" for c in edge.choices)


def test_body_over_the_limit_is_413_before_it_is_read(server):
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * MAX_BYTES + b'"}]}'
    response = post(server, big)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks():                                        # no Content-Length: counted as read
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    response = httpx.post(server.url + "/v1/chat/completions", content=chunks(),
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413, response.text


def test_a_prompt_far_over_the_context_is_refused_at_once_and_health_stays_fast(server):
    # ~1.5 MB, under the body limit: above the context's 8192 tokens x the longest token's
    # 81 bytes, refused without tokenizing (a 10 MB prompt took 24-36 s and stalled /health)
    text = "lorem ipsum dolor sit amet " * 56_000
    latencies = []

    def probe():
        for _ in range(10):
            t0 = time.monotonic()
            httpx.get(server.url + "/health", timeout=30).raise_for_status()
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    t0 = time.monotonic()
    response = post(server, {"model": MODEL, "messages": [{"role": "user", "content": text}]})
    elapsed = time.monotonic() - t0
    prober.join()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    # loose bounds (a shared CI machine): a stall would be tens of seconds
    assert elapsed < 15, elapsed
    assert max(latencies) < 5.0, latencies


@pytest.mark.parametrize("raw", [
    b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
    b'{"model": "m\\udfff", "messages": [{"role": "user", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "2"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}',
    b"",
])
def test_bad_values_are_400_in_the_openai_shape(server, raw):
    response = post(server, raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "None" not in error["message"]


def test_a_vanishing_temperature_is_greedy(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0].message.content
    tiny = client.chat.completions.create(temperature=1e-300, **kw).choices[0].message.content
    assert tiny == greedy


def test_a_second_server_on_a_held_disk_path_refuses_to_start(tmp_path):
    import torch

    from kvstore.tiers.base import PageShape
    from kvstore.tiers.disk_layout import DiskLayout
    root = tmp_path / "kv"
    root.mkdir()
    fd = DiskLayout(root, PageShape(16, 2, 8, torch.float32), 1).lock()   # "server A"
    try:
        with running_server("--kv-disk-gb", "0.05", "--kv-disk-path", str(root),
                            wait=False) as b:
            assert b.proc.wait(timeout=600) != 0
            assert "in use by another Strata server" in b.log_tail(20_000)
    finally:
        os.close(fd)
