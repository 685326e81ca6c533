"""Prometheus families of the KV store (strata_kv_*, strata_sparse_*, strata_dense_fallback_*),
built at scrape time from the plain counters in EngineStats (no kvstore import here)."""
from __future__ import annotations

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

TIERS = ("device", "host", "disk")
# must match kvstore.stats.SELECTED_TOKEN_BUCKETS (EngineStats carries the counts per bucket)
SELECTED_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def kv_families(stats):
    used = GaugeMetricFamily("strata_kv_tier_used_bytes", "KV bytes stored per tier.",
                             labels=["tier"])
    cap = GaugeMetricFamily("strata_kv_tier_capacity_bytes", "KV byte budget per tier.",
                            labels=["tier"])
    for tier in TIERS:
        u, c = stats.kv_tiers.get(tier, (0, 0))
        used.add_metric([tier], u)
        cap.add_metric([tier], c)
    yield used
    yield cap
    kv = stats.kv
    if kv is None:
        return
    transfer = CounterMetricFamily("strata_kv_transfer_bytes", "KV bytes moved between tiers.",
                                   labels=["src", "dst"])
    for (src, dst), n in sorted(kv.transfer_bytes.items()):
        transfer.add_metric([src, dst], n)
    yield transfer
    for name, doc, values in (
            ("strata_kv_page_lookups", "KV pages looked up per tier.", kv.lookups),
            ("strata_kv_page_hits", "KV pages found per tier.", kv.hits),
            ("strata_kv_evictions", "KV pages evicted per tier.", kv.evictions)):
        fam = CounterMetricFamily(name, doc, labels=["tier"])
        for tier in TIERS:
            fam.add_metric([tier], values.get(tier, 0))
        yield fam
    fb = CounterMetricFamily("strata_dense_fallback", "Request-layer steps run dense in sparse "
                             "mode, by reason.", labels=["reason"])
    for reason in ("prefill", "fits_budget", "dense_layer"):
        fb.add_metric([reason], kv.dense_fallbacks.get(reason, 0))
    yield fb
    buckets, acc = [], 0
    for bound, n in zip(list(SELECTED_TOKEN_BUCKETS) + ["+Inf"], kv.selected_buckets):
        acc += n
        buckets.append((str(float(bound)) if bound != "+Inf" else "+Inf", acc))
    yield HistogramMetricFamily("strata_sparse_selected_tokens",
                                "Tokens attended per request, layer and KV head in sparse decode.",
                                buckets=buckets, sum_value=kv.selected_sum)
