"""End-to-end tests that need a server of their own: 503 while loading, 401 API key, 429 queue."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.server_helpers import MODEL, REQUEST_TIMEOUT_S, openai_client, read_metric, running_server

pytestmark = pytest.mark.slow

API_KEY = "sk-strata-test"
HELLO = [{"role": "user", "content": "Count from one to one thousand."}]
CHAT = {"model": MODEL, "messages": HELLO, "max_tokens": 4}


@pytest.fixture(scope="module")
def keyed_server():
    """A server with --api-key; what it answered before the model had loaded is kept."""
    with running_server("--api-key", API_KEY, wait=False) as server:
        first_health = server.first_response("/health")
        early = {
            "v1_with_key": httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                                      headers={"Authorization": f"Bearer {API_KEY}"}),
            "v1_without_key": httpx.post(server.url + "/v1/chat/completions", json=CHAT),
            "health": httpx.get(server.url + "/health"),
        }
        server.wait_ready()
        yield server, first_health, early


def test_health_is_503_while_loading_then_200(keyed_server):
    server, first_health, early = keyed_server
    assert first_health.status_code == 503
    assert first_health.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(server.url + "/health").status_code == 200


def test_v1_routes_are_503_while_loading(keyed_server):
    _, _, early = keyed_server
    if early["health"].status_code != 503:
        pytest.skip("the model loaded before the probe")
    response = early["v1_with_key"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "model_loading"


def test_api_key_is_checked_before_readiness(keyed_server):
    _, _, early = keyed_server
    assert early["v1_without_key"].status_code == 401


def test_missing_or_wrong_api_key_is_401(keyed_server):
    server, _, _ = keyed_server
    with pytest.raises(openai.AuthenticationError) as info:
        openai_client(server.url, api_key="wrong-key").chat.completions.create(**CHAT)
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert info.value.body["type"] == "authentication_error"
    for headers in ({}, {"Authorization": API_KEY}, {"Authorization": "Basic abc"}):
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 401, headers
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_anthropic_clients_send_their_key_as_x_api_key(keyed_server):
    import anthropic
    server, _, _ = keyed_server
    kw = dict(model=MODEL, max_tokens=4, messages=HELLO)
    served = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    assert served.messages.create(**kw).content
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.url, api_key="wrong-key",
                            max_retries=0).messages.create(**kw)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_right_api_key_is_served_and_health_metrics_stay_open(keyed_server):
    server, _, _ = keyed_server
    response = openai_client(server.url, api_key=API_KEY).chat.completions.create(**CHAT)
    assert response.choices[0].message.content is not None
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


# ------------------------------------------------------------------ 429
async def _hold_stream(client: httpx.AsyncClient, started: asyncio.Event) -> None:
    body = {**CHAT, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for _ in response.aiter_lines():
            started.set()


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    return read_metric((await client.get("/metrics")).text, name)


async def _wait_for(predicate, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def _queue_full_scenario(url: str) -> httpx.Response:
    """One running request, one waiting (the limits are 1 and 1), then a third one."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        running_started = asyncio.Event()
        fillers = [asyncio.create_task(_hold_stream(client, running_started))]
        try:
            await asyncio.wait_for(running_started.wait(), REQUEST_TIMEOUT_S)
            fillers.append(asyncio.create_task(_hold_stream(client, asyncio.Event())))

            async def one_waiting():
                return await _metric(client, "strata_requests_waiting") >= 1

            await _wait_for(one_waiting)
            return await client.post("/v1/chat/completions", json=CHAT)
        finally:
            for task in fillers:
                task.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)


def test_full_queue_is_429_with_retry_after_and_recovers():
    with running_server("--max-num-seqs", "1", "--max-waiting", "1") as server:
        response = asyncio.run(_queue_full_scenario(server.url))
        assert response.status_code == 429, response.text
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["code"] == "queue_full"
        assert server.metric("strata_admission_rejections_total", 'reason="queue_full"') >= 1
        deadline = time.monotonic() + 60
        while server.metric("strata_requests_running") or server.metric("strata_requests_waiting"):
            assert time.monotonic() < deadline, "cancelled requests were not aborted"
            time.sleep(0.2)
        assert openai_client(server.url).chat.completions.create(**CHAT).choices


async def _other_client_scenario(url: str) -> tuple[httpx.Response, httpx.Response]:
    """The anonymous client holds the running slot and its one waiting slot; its next request
    is 429, another client's (`user`) is queued all the same and served."""
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        running_started = asyncio.Event()
        fillers = [asyncio.create_task(_hold_stream(client, running_started))]
        other = None
        try:
            await asyncio.wait_for(running_started.wait(), REQUEST_TIMEOUT_S)
            fillers.append(asyncio.create_task(_hold_stream(client, asyncio.Event())))

            async def waiting(n: int):
                return await _metric(client, "strata_requests_waiting") >= n

            await _wait_for(lambda: waiting(1))
            refused = await client.post("/v1/chat/completions", json=CHAT)
            other = asyncio.create_task(client.post("/v1/chat/completions",
                                                    json={**CHAT, "user": "someone-else"}))
            await _wait_for(lambda: waiting(2))        # queued beside the full client's
        finally:
            for task in fillers:
                task.cancel()
            await asyncio.gather(*fillers, return_exceptions=True)
        return refused, await other


def test_one_clients_full_queue_leaves_room_for_another():
    with running_server("--max-num-seqs", "1", "--max-waiting", "1") as server:
        refused, served = asyncio.run(_other_client_scenario(server.url))
        assert refused.status_code == 429, refused.text
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["content"] is not None
