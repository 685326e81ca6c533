"""--scheduling-policy priority through the openai SDK: with one request running at a time,
the waiting request of the highest priority (the lowest value) runs next, whatever the order
the requests came in, and a request of any priority still completes."""
from __future__ import annotations

import threading
import time

import pytest

from tests.server_helpers import MODEL, fresh_salt, openai_client, running_server

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Count from one to one hundred in words."}]


@pytest.fixture(scope="module")
def server():
    with running_server("--scheduling-policy", "priority", "--max-num-seqs", "1") as s:
        yield s


def test_the_highest_priority_waiting_request_runs_next(server):
    client = openai_client(server.url)
    done: list[str] = []
    lock = threading.Lock()

    def ask(name: str, priority: int, tokens: int) -> None:
        client.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=tokens, temperature=0.0,
            extra_body={"priority": priority, "ignore_eos": True, **fresh_salt()})
        with lock:
            done.append(name)

    # the blocker runs alone (one running request at most) while the others queue up
    first = client.chat.completions.create(
        model=MODEL, messages=PROMPT, max_tokens=400, temperature=0.0, stream=True,
        extra_body={"priority": 10, "ignore_eos": True, **fresh_salt()})
    next(iter(first))
    threads = [threading.Thread(target=ask, args=(name, prio, 16)) for name, prio in
               (("low-1", 5), ("low-2", 5), ("mid", 0), ("high", -3), ("low-3", 5))]
    for t in threads:
        t.start()
        time.sleep(0.05)                    # arrival order: as listed
    deadline = time.monotonic() + 30
    while server.metric("strata_requests_waiting") < len(threads):
        assert time.monotonic() < deadline, "the requests never queued"
        time.sleep(0.05)
    for _ in first:                          # the blocker ends; the queue drains in turn
        pass
    for t in threads:
        t.join()
    assert done == ["high", "mid", "low-1", "low-2", "low-3"]
