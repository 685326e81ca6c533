"""Two real Strata replicas behind the real vllm-router (the installed wheel's binary), with
deploy/router/flags: the OpenAI SDK through the router, prefix affinity with cache hits, a 429
retried on the other replica, and a replica stopped mid-run."""
from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from bench.scaleout import router_flags
from tests.server_helpers import (MODEL, ServerProcess, free_port, openai_client,
                                  running_server)

pytestmark = pytest.mark.slow

ROUTER = Path(sys.executable).parent / "vllm-router"
DRAIN = ("--drain-seconds", "6")            # > the router's 2 checks x 2 s to notice
SUCCESS = ("strata_request_success_total", 'finished_reason="length"')


@contextmanager
def running_router(workers: list[str], *extra: str) -> Iterator[str]:
    port = free_port()
    flags = router_flags()
    for i, flag in enumerate(flags):                 # a test may swap the policy
        if flag == "--policy" and "--policy" in extra:
            del flags[i:i + 2]
            break
    log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(ROUTER), "--host", "127.0.0.1", "--port", str(port),
                             "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(free_port()),
                             "--worker-urls", *workers, *flags, *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "router not ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        Path(log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    """A with the default capacity; B running one request with one waiting at most (429s)."""
    with ExitStack() as stack:
        servers = [stack.enter_context(running_server(*DRAIN, wait=False)),
                   stack.enter_context(running_server(*DRAIN, "--max-num-seqs", "1",
                                                      "--max-waiting", "1", wait=False))]
        for s in servers:
            s.wait_ready()
        yield servers


@pytest.fixture(scope="module")
def router(replicas) -> Iterator[str]:
    with running_router([s.url for s in replicas]) as url:
        yield url


def rejections(server: ServerProcess) -> float:
    try:
        return server.metric("strata_admission_rejections_total", 'reason="queue_full"')
    except KeyError:                                 # none yet: the label has no sample
        return 0.0


def served(replicas) -> list[float]:
    return [s.metric(*SUCCESS) for s in replicas]


DOC = ("Harbour log. The ship Aurora left at dawn with grain, the Borealis came in with "
       "timber, and the wind turned north by noon. ") * 80          # ~2K tokens


def ask(client: httpx.Client, question: str, max_tokens: int = 4) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": f"{DOC}\n\nQuestion: {question}"}]})


def test_the_sdk_through_the_router(router):
    client = openai_client(router)
    # NOTE: five tokens whatever is sampled (a sampled answer may end sooner: a flaky test)
    five = dict(model=MODEL, max_tokens=5, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **five)
    assert r.choices[0].message.content and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        stream=True, messages=[{"role": "user", "content": "Hi"}], **five))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_shared_prefix_lands_on_one_replica_and_hits_its_cache(router, replicas):
    before = served(replicas)
    hits_before = [s.metric("strata_prefix_cache_hits_total") for s in replicas]
    with httpx.Client(base_url=router, timeout=300) as client:
        for q in range(10):
            assert ask(client, f"what came in on day {q}?").status_code == 200
    got = [a - b for a, b in zip(served(replicas), before)]
    assert sorted(got) == [0, 10], got
    home = got.index(10)
    hits = replicas[home].metric("strata_prefix_cache_hits_total") - hits_before[home]
    assert hits >= 9 * 1500, hits                    # the 9 later requests reuse the prefix


def test_a_full_replica_429_is_retried_on_the_other(replicas):
    rejected = rejections(replicas[1])
    with running_router([s.url for s in replicas], "--policy", "round_robin") as url, \
            httpx.Client(base_url=url, timeout=300) as client, ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda q: ask(client, f"question {q}", 24).status_code, range(8)))
    assert codes == [200] * 8
    assert rejections(replicas[1]) > rejected        # B refused some: the router moved them


def test_a_replica_stopped_mid_run_loses_no_request(router, replicas):
    with httpx.Client(base_url=router, timeout=300) as client:
        assert ask(client, "first").status_code == 200
        before = served(replicas)
        assert ask(client, "second").status_code == 200
        home = [a - b for a, b in zip(served(replicas), before)].index(1)
        codes = []
        stopper = threading.Timer(0.5, replicas[home].proc.terminate)   # SIGTERM: drains
        stopper.start()
        for q in range(8):
            codes.append(ask(client, f"after {q}").status_code)
            time.sleep(0.5)
        stopper.join()
    assert codes == [200] * 8
    assert replicas[home].proc.wait(timeout=30) is not None
    other = replicas[1 - home]
    assert other.metric(*SUCCESS) > before[1 - home]
