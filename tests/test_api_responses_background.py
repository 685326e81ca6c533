"""Background responses (`background: true`) through the official openai SDK against a real
server: answered at once and polled to its answer, streamed and resumed after the client left
(`retrieve(stream=True, starting_after=N)`), cancelled (the engine's requests aborted, the
response stored as cancelled), and the 400s."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server_helpers import openai_client, running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(model=MODEL, temperature=0.0)
# an answer that runs to max_output_tokens: a string of at least 4000 characters
LONG = dict(input="Tell a long story.", max_output_tokens=900, **GREEDY,
            text={"format": {"type": "json_schema", "name": "story", "strict": True,
                             "schema": {"type": "object", "required": ["story"],
                                        "additionalProperties": False, "properties": {
                                            "story": {"type": "string", "minLength": 4000}}}}})


@pytest.fixture(scope="module")
def server():
    with running_server("--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def polled(client, response_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def running(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("strata_requests_running"))


def streamed_text(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_background_response_is_polled_to_its_answer(client):
    # (not compared with a foreground run's text: two generations may differ at a near-tie,
    # the second reading the first's cached prompt pages; test_api_responses checks answers)
    back = client.responses.create(background=True, input="Name three planets.",
                                   max_output_tokens=40, **GREEDY)
    assert back.background and back.status == "queued" and not back.output
    done = polled(client, back.id)
    assert done.status == ("incomplete" if done.usage.output_tokens == 40 else "completed")
    assert done.output_text and done.background
    events = list(client.responses.retrieve(back.id, stream=True))    # what it recorded
    assert events[-1].type == f"response.{done.status}"
    assert streamed_text(events) == done.output_text
    # it is stored: a conversation continues from it as from any other
    nxt = client.responses.create(input="And one more?", previous_response_id=back.id,
                                  max_output_tokens=8, **GREEDY)
    assert nxt.usage.input_tokens > done.usage.input_tokens


def test_a_stream_left_midway_is_resumed_where_it_stopped(client):
    first = []
    stream = client.responses.create(background=True, stream=True, max_output_tokens=60,
                                     input="Write two sentences about disks.", **GREEDY)
    for event in stream:
        first.append(event)
        if event.type == "response.output_text.delta":
            break                       # the client leaves; the response goes on
    stream.close()
    response_id = first[0].response.id
    rest = list(client.responses.retrieve(response_id, stream=True,
                                          starting_after=first[-1].sequence_number))
    seqs = [e.sequence_number for e in first + rest]
    assert seqs == list(range(len(seqs)))
    final = client.responses.retrieve(response_id)
    assert rest[-1].type == f"response.{final.status}"
    assert streamed_text(first + rest) == final.output_text == rest[-1].response.output_text
    assert final.output_text
    # followed again from the start, once it ended
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in again] == seqs


def test_cancel_stops_the_engine_and_stores_it_cancelled(client, server):
    r = client.responses.create(background=True, **LONG)
    while client.responses.retrieve(r.id).status == "queued" or not \
            client.responses.retrieve(r.id).output:
        time.sleep(0.05)                # decoding
    assert running(server) == 1
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"       # idempotent
    deadline = time.monotonic() + 3     # the whole answer would take ~10 s
    while running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(server) == 0
    kept = client.responses.retrieve(r.id)
    assert 0 < len(kept.output_text) < 900 * 4 and kept.usage is None


def test_what_cannot_be_cancelled_or_streamed_again_is_a_400(client):
    fore = client.responses.create(input="Hi", max_output_tokens=4, **GREEDY)
    with pytest.raises(openai.BadRequestError) as cancel:
        client.responses.cancel(fore.id)
    assert cancel.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as stream:
        list(client.responses.retrieve(fore.id, stream=True))
    assert stream.value.body["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
