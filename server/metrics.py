"""ServerMetrics: the request-level Prometheus metrics of the HTTP edge (prefix ``strata_``).

Each app owns a :class:`ServerMetrics` with its own ``CollectorRegistry`` (several apps can live in
one process, as in tests). Engine gauges (running / waiting requests, device KV bytes) are read
from ``EngineClient.stats()`` at scrape time. ``/metrics`` also serves prometheus_client's default
registry, where engine-side code may register its own families (stages, tiers, transfers).
"""
from __future__ import annotations

import logging

from prometheus_client import (REGISTRY, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.protocol import EngineClient
from server.kv_metrics import kv_families

logger = logging.getLogger(__name__)

# vLLM's bucket lists (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FINISHED_REASONS = ("stop", "length", "abort", "error")
REJECTION_REASONS = ("queue_full", "context_length", "too_large", "not_ready", "engine_dead",
                     "priority_not_enabled")


class EngineStatsCollector(Collector):
    """Gauges read from the engine when Prometheus scrapes."""

    def __init__(self, engine: EngineClient):
        self._engine = engine

    def collect(self):
        try:
            stats = self._engine.stats()
        except Exception:                      # NOTE: a loading or dead engine has no stats
            logger.debug("engine stats unavailable", exc_info=True)
            return
        yield GaugeMetricFamily("strata_requests_running", "Requests in the running batch.",
                                value=stats.num_running)
        yield GaugeMetricFamily("strata_requests_waiting", "Requests waiting for admission.",
                                value=stats.num_waiting)
        yield from kv_families(stats)
        if stats.lora_requests:
            lora = GaugeMetricFamily("strata_lora_requests", "Requests of each LoRA adapter, "
                                     "running or waiting.", labels=["adapter", "state"])
            for name, (running, waiting) in sorted(stats.lora_requests.items()):
                lora.add_metric([name, "running"], running)
                lora.add_metric([name, "waiting"], waiting)
            yield lora


class ServerMetrics:
    """Request-level histograms and counters, plus the engine gauges, in one registry."""

    def __init__(self, engine: EngineClient):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.time_to_first_token = Histogram(
            "strata_time_to_first_token_seconds", "Time from arrival to the first token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "strata_inter_token_latency_seconds", "Time between consecutive outputs of a request.",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "strata_e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            "strata_request_queue_time_seconds", "Time from arrival to first scheduling.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "strata_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(
            "strata_generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            "strata_request_success", "Finished engine requests by finish reason.",
            ["finished_reason"], registry=r)
        self.admission_rejections = Counter(
            "strata_admission_rejections", "Requests refused before admission, by reason.",
            ["reason"], registry=r)
        for reason in FINISHED_REASONS:        # export zeros so dashboards see every series
            self.request_success.labels(reason)
        for reason in REJECTION_REASONS:
            self.admission_rejections.labels(reason)
        r.register(EngineStatsCollector(engine))
        self.prompt_total = 0                  # the two counters' values, for the stats line
        self.generated_total = 0
        self.log_requests = False              # a log line per finished request

    def count_prompt(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.prompt_total += tokens

    def count_generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)
        self.generated_total += tokens

    def record_finished(self, reason: str, *, e2e_s: float, queue_s: float | None) -> None:
        self.request_success.labels(reason if reason in FINISHED_REASONS else "error").inc()
        self.e2e_request_latency.observe(max(0.0, e2e_s))
        if queue_s is not None:
            self.request_queue_time.observe(max(0.0, queue_s))

    def record_rejection(self, reason: str) -> None:
        self.admission_rejections.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(REGISTRY)
