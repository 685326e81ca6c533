"""The dashboards against a live server: a real `strata serve` with host and disk KV tiers and
sparse decode, scraped by the real Prometheus binary (Debian's package; `make test` provides it)
on loopback every second while it serves a request. Every metric a dashboard panel uses is in
its /metrics; Prometheus finds the stage and tier series; every panel's query runs in Prometheus
and returns the series its legend names."""
from __future__ import annotations

import re
import subprocess
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server_helpers import (MODEL, REQUEST_TIMEOUT_S, free_port, running_server,
                                   sse_payloads)
from tests.deploy_helpers import (dashboard_metric_names, dashboards, panel_queries,
                                  prometheus_tool)

pytestmark = pytest.mark.slow

# ~170 prompt tokens: ten full pages per layer written to the disk tier at prefill, and a
# context over the sparse budget below, so decode steps select pages
PROMPT = "The lighthouse keeper wrote in his log every night about the ships he saw. " * 10
STAGES = {"select", "resolve", "fetch", "compute"}
TIERS = {"device", "host", "disk"}


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv")
    with running_server("--kv-device-gb", "0.05", "--kv-host-gb", "0.05", "--kv-host-pool",
                        "separate", "--kv-disk-gb", "0.1",
                        "--kv-disk-path", str(disk), "--sparse-budget", "64",
                        "--sparse-local-tokens", "32") as proc:
        yield proc


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log):
        self.url, self.proc, self.log = url, proc, log

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10.0)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict]:
        """Poll an instant query until it returns a series."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no series for {expr} after {timeout_s} s; Prometheus "
                                     f"log:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.25)


@pytest.fixture(scope="module")
def prometheus(tiered, tmp_path_factory):
    """The real Prometheus on a free loopback port, scraping `tiered` every second."""
    binary = prometheus_tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "strata", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [f"127.0.0.1:{tiered.port}"]}]}]}))
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, f"--config.file={config}",
                                 f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=out, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(prom.url + "/-/ready", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready:\n{log.read_text()}"
            time.sleep(0.1)
        prom.wait_for('up{job="strata"} == 1')
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_while_prometheus_watches(server, prom: Prometheus) -> float:
    """Stream one request; while it decodes, wait until Prometheus has scraped it running;
    then drop the stream (the server aborts the request). Returns the running count seen."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        payloads = sse_payloads(r.iter_lines())
        tokens = 0
        for payload in payloads:                      # past prefill: decoding now
            assert payload != "[DONE]" and "error" not in payload, payload
            if payload["choices"] and payload["choices"][0]["delta"].get("content"):
                tokens += 1
                if tokens >= 2:
                    break
        (seen,) = prom.wait_for("strata_requests_running >= 1")
    return float(seen["value"][1])


@pytest.fixture(scope="module")
def scraped(tiered, prometheus) -> float:
    """A request served under Prometheus's eye, and two scrapes of what it left."""
    running = serve_while_prometheus_watches(tiered, prometheus)
    prometheus.wait_for("strata_requests_running == 0")
    prometheus.wait_for('count_over_time(strata_kv_transfer_bytes_total{src="device", '
                        'dst="disk"}[1m]) >= 2')
    return running


def exported_sample_names(server) -> dict[str, str]:
    """Sample name (`_total`, `_bucket`, ... included) -> its family's type, from /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10.0).text
    return {s.name: fam.type for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def test_every_metric_a_dashboard_uses_is_exported(tiered):
    # a request that fills a few pages, so the tier-transfer counters exist
    r = httpx.post(tiered.url + "/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
        "model": MODEL, "prompt": PROMPT[:250], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    exported = exported_sample_names(tiered)
    used = dashboard_metric_names()
    assert len(used) >= 20
    missing = {name: sorted(where) for name, where in used.items() if name not in exported}
    assert not missing, f"used by dashboards, not exported by the server: {missing}"
    for name in used:
        kind = exported[name]
        if name.endswith(("_bucket", "_sum", "_count")):
            assert kind == "histogram", f"{name}: a {kind}"
        elif name.endswith("_total"):
            assert kind == "counter", f"{name}: a {kind}"
        else:
            assert kind == "gauge", f"{name}: a {kind}"


def test_prometheus_scrapes_the_server_while_it_serves(scraped):
    assert scraped >= 1


def test_prometheus_finds_the_stage_and_tier_series(prometheus, scraped):
    def labels(expr: str, label: str) -> set[str]:
        return {s["metric"][label] for s in prometheus.query(expr)}

    for metric in ("strata_stage_seconds_count", "strata_stage_seconds_sum",
                   "strata_stage_busy_seconds_total", "strata_pipeline_stall_seconds_total"):
        assert labels(metric, "stage") == STAGES, metric
    assert labels('strata_stage_seconds_bucket{le="+Inf"}', "stage") == STAGES
    for metric in ("strata_kv_tier_used_bytes", "strata_kv_tier_capacity_bytes",
                   "strata_kv_page_lookups_total", "strata_kv_page_hits_total",
                   "strata_kv_evictions_total"):
        assert labels(metric, "tier") == TIERS, metric
    assert labels("strata_kv_tier_capacity_bytes > 0", "tier") == TIERS
    assert prometheus.query('strata_kv_transfer_bytes_total{src="device", dst="disk"} > 0')
    assert prometheus.query('strata_kv_page_hits_total{tier="device"} > 0'), "decode looked up"
    assert prometheus.query("strata_sparse_selected_tokens_count > 0"), "sparse decode ran"


def test_every_dashboard_query_runs_in_prometheus_and_names_its_legend(prometheus, scraped):
    failures = []
    for board in dashboards().values():
        for panel, target in panel_queries(board):
            expr = (target["expr"].replace("$__rate_interval", "1m")
                    .replace("$instance", ".*"))
            where = f"{board['title']}: {panel['title']}: {target['expr']}"
            result = prometheus.query(expr)
            if not result:
                failures.append(f"{where}: no series")
                continue
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                if any(label not in s["metric"] for s in result):
                    failures.append(f"{where}: a series without the legend's {label}")
    assert not failures, "\n".join(failures)
