"""The log lines for people watching a terminal (server/stats_log.py): the periodic stats
line over the interval just ended, silent while idle, and a finished request's line."""
from __future__ import annotations

from dataclasses import replace

from engine.protocol import EngineStats
from server.stats_log import StatsLogger, request_line


class FakeMetrics:
    prompt_total = 0
    generated_total = 0


class FakeEngine:
    def __init__(self):
        self.s = EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=200,
                             kv_page_bytes=1)

    def stats(self):
        return self.s


def test_the_stats_line_covers_the_interval_and_is_silent_while_idle(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("server.stats_log.time.monotonic", lambda: clock[0])
    metrics, engine = FakeMetrics(), FakeEngine()
    log = StatsLogger(metrics, engine)
    clock[0] = 110.0
    assert log.line() is None                               # nothing ran or waited
    metrics.prompt_total, metrics.generated_total = 1000, 50
    engine.s = replace(engine.s, num_running=2, num_waiting=1, kv_pages_used=50,
                       prefix_queried_tokens=1000, prefix_hit_tokens=250, spec_decode=(10, 30, 12))
    clock[0] = 120.0
    assert log.line() == (
        "prompt throughput 100.0 tokens/s, generation throughput 5.0 tokens/s, running 2 "
        "reqs, waiting 1 reqs, KV pages used 25.0%, prefix cache hit rate 25.0%, drafts "
        "kept 40.0%")
    engine.s = replace(engine.s, num_running=0, num_waiting=0)
    clock[0] = 130.0
    assert log.line() is None                               # idle again: no line


def test_a_finished_requests_line():
    assert request_line("cmpl-1-0", "stop", 812, 768, 65, 10.0, 10.25, 11.85) == (
        "cmpl-1-0: 812 prompt tokens (768 cached), 65 output tokens (stop); first token "
        "0.250 s, decode 40.0 tokens/s, total 1.850 s")
    assert request_line("x", "abort", 5, 0, 0, 1.0, None, 2.0).endswith(
        "first token -, decode -, total 1.000 s")
