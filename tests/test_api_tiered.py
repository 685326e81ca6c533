"""The real server with all three KV tiers (forced down to disk every step), sparse decode and
layer-ahead prefetch, driven over HTTP: tier and stage metrics, a corrupt page mid-stream,
never-fits (400) and full-for-now (429)."""
from __future__ import annotations

import itertools
import time

import httpx
import pytest

from kvstore.cache_files import list_cache
from tests.server_helpers import (MODEL, REQUEST_TIMEOUT_S, read_metric, running_server,
                                   sse_payloads)

pytestmark = pytest.mark.slow

LONG = ("The lighthouse keeper wrote in his log every night about the ships he saw. " * 30
        + "The secret code is 4921. " + "Waves hit the rocks below the tower. " * 20)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def tiered(disk_dir):
    with running_server("--kv-device-gb", "0.05", "--kv-host-gb", "0.05", "--kv-host-pool",
                        "separate", "--kv-disk-gb", "0.1",
                        "--kv-disk-path", str(disk_dir), "--kv-force-tier", "disk",
                        "--sparse-budget", "256", "--pipeline", "layer-ahead") as proc:
        yield proc


def chat(url: str, content: str, max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, **extra})


def test_long_prompt_is_served_from_the_disk_tier_with_sparse_decode(tiered, disk_dir):
    r = chat(tiered.url, LONG + " What is the secret code?", 24)
    assert r.status_code == 200, r.text
    text = httpx.get(tiered.url + "/metrics").text
    assert read_metric(text, "strata_kv_transfer_bytes_total", 'dst="device",src="disk"') > 0
    assert read_metric(text, "strata_kv_transfer_bytes_total", 'dst="disk",src="device"') > 0
    assert read_metric(text, "strata_kv_page_hits_total", 'tier="disk"') > 0
    assert read_metric(text, "strata_sparse_selected_tokens_count") > 0
    # the decode stages, timed per micro-batch (layer-ahead: prefetch on the stage threads)
    for stage in ("select", "resolve", "fetch", "compute"):
        assert read_metric(text, "strata_stage_seconds_count", f'stage="{stage}"') > 0
        assert read_metric(text, "strata_stage_busy_seconds_total", f'stage="{stage}"') > 0
    assert read_metric(text, "strata_pipeline_stall_seconds_total", 'stage="compute"') >= 0
    assert "strata_pipeline_micro_batch" not in text        # sfc's alone
    for tier in ("device", "host", "disk"):
        assert read_metric(text, "strata_kv_tier_capacity_bytes", f'tier="{tier}"') > 0
    # nothing is left but the cached pages of the prompt and the answer: one file and its
    # index, on disk only (indexed by the engine once it is idle)
    assert read_metric(text, "strata_kv_pages_used") == 0
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(tiered.url + "/metrics").text
        cached = read_metric(text, "strata_prefix_cache_pages", 'tier="disk"')
        (segment,) = list_cache(disk_dir)
        if segment.pages == cached or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert cached > 0 and segment.pages == cached
    for tier in ("device", "host"):
        assert read_metric(text, "strata_prefix_cache_pages", f'tier="{tier}"') == 0
    assert sorted(p.suffix for p in disk_dir.iterdir()) == [".idx", ".kv"]


def test_corrupt_page_mid_stream_ends_that_stream_with_an_error(tiered, disk_dir):
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 300,
            "temperature": 0, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", tiered.url + "/v1/chat/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200
        corrupted = False
        for payload in sse_payloads(r.iter_lines()):
            events.append(payload)
            if not corrupted and len(events) >= 4:
                # the first page of every file: its own, and the cached prompt pages it shares
                for f in disk_dir.glob("seg-*.kv"):
                    with open(f, "r+b") as fh:
                        head = fh.read(4096)
                        fh.seek(0)
                        fh.write(bytes(b ^ 0xFF for b in head))
                corrupted = True
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert "error" in err and "corrupt" in err["error"]["message"].lower()
    # the server keeps serving, the damaged cached page is not served again
    r = chat(tiered.url, "Say hi.", 8)
    assert r.status_code == 200, r.text
    r = chat(tiered.url, LONG + " What is the secret code?", 8)
    assert r.status_code == 200, r.text


def test_request_that_can_never_fit_the_disk_tier_is_400(tiered):
    r = chat(tiered.url, "Hello", 6000)
    assert r.status_code == 400, r.text
    assert "raise --kv-disk-gb" in r.json()["error"]["message"]


def test_disk_budget_full_for_now_is_429_with_retry_after(tiered, disk_dir):
    # the first request reserves 2500+ tokens of the ~4.6K-token disk budget; so would the second
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}],
            "max_tokens": 2500, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiered.url + "/v1/chat/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as first:
        assert first.status_code == 200
        # keep the line iterator: a discarded one is closed at once, and closing it closes the
        # connection, so the server would abort the first request (a race with the second)
        lines = first.iter_lines()
        next(lines)
        r = chat(tiered.url, "Count.", 2500)
        assert r.status_code == 429, f"{r.text}\nserver log:\n{tiered.log_tail()}"
        assert int(r.headers["retry-after"]) >= 1
        assert "disk" in r.json()["error"]["message"]
        # the refusal harms nothing else: the first stream goes on
        assert any(line.startswith("data: {") for line in itertools.islice(lines, 4))
    # closing the first stream aborts it and frees its reservation: the same request now fits
    deadline = time.monotonic() + 60
    while read_metric(httpx.get(tiered.url + "/metrics").text, "strata_kv_pages_used") > 0:
        assert time.monotonic() < deadline, "the aborted request kept its pages"
        time.sleep(0.05)
    assert chat(tiered.url, "Count.", 2500, stop=["1"]).status_code == 200
