"""Prometheus families of the KV store (strata_kv_*, strata_sparse_*, strata_dense_fallback_*),
built at scrape time from the plain counters in EngineStats (no kvstore import here)."""
from __future__ import annotations

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

TIERS = ("device", "host", "disk")
# must match kvstore.stats.SELECTED_TOKEN_BUCKETS (EngineStats carries the counts per bucket)
SELECTED_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# must match kvstore.stats.STAGES / STAGE_BUCKETS
STAGES = ("select", "resolve", "fetch", "compute")
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5)


def _cumulative(bounds, counts):
    out, acc = [], 0
    for bound, n in zip(list(bounds) + ["+Inf"], counts):
        acc += n
        out.append((str(float(bound)) if bound != "+Inf" else "+Inf", acc))
    return out


def kv_families(stats):
    yield GaugeMetricFamily("strata_kv_pages_used", "KV pages held by requests (pages only "
                            "the prefix cache holds count as free).", value=stats.kv_pages_used)
    yield GaugeMetricFamily("strata_kv_pages_total", "KV pages the backing tier holds.",
                            value=stats.kv_pages_total)
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
    mb = stats.pipeline_micro_batch
    if mb >= 0:
        yield GaugeMetricFamily("strata_pipeline_micro_batch", "Sequences per micro-batch of "
                                "--pipeline sfc (0 while the start-up calibration runs).",
                                value=mb)
    yield from prefix_families(stats)
    yield from spec_families(stats)
    if stats.kv_disk_io:
        disk = CounterMetricFamily("strata_kv_disk_bytes", "Bytes the disk tier's drives read "
                                   "and wrote, per folder (--kv-disk-path; reads count the gap "
                                   "pages a coalesced read spans).", labels=["path", "op"])
        for path, io in sorted(stats.kv_disk_io.items()):
            disk.add_metric([path, "read"], io["bytes_read"])
            disk.add_metric([path, "write"], io["bytes_written"])
        yield disk
    kv = stats.kv
    if kv is None:
        return
    transfer = CounterMetricFamily("strata_kv_transfer_bytes", "KV bytes moved between tiers.",
                                   labels=["src", "dst"])
    # the pairs data moves along, at zero until it first moves (so rate() panels have series)
    pairs = {("host", "device"): 0, ("disk", "device"): 0, ("device", "host"): 0,
             ("device", "disk"): 0, **kv.transfer_bytes}
    for (src, dst), n in sorted(pairs.items()):
        transfer.add_metric([src, dst], n)
    yield transfer
    for name, doc, values in (
            ("strata_kv_page_lookups", "KV pages looked up per tier.", kv.lookups),
            ("strata_kv_page_hits", "KV pages found per tier.", kv.hits),
            ("strata_kv_evictions", "KV pages evicted per tier.", kv.evictions),
            ("strata_kv_recomputed_pages", "KV pages a fill rebuilt from their stored layer "
             "inputs instead of reading them (KVPR), per tier they came from.",
             kv.recomputed)):
        fam = CounterMetricFamily(name, doc, labels=["tier"])
        for tier in TIERS:
            fam.add_metric([tier], values.get(tier, 0))
        yield fam
    yield CounterMetricFamily("strata_kv_window_dropped_pages", "Layer-pages of sliding-window "
                              "layers dropped from the KV store once no request reads them.",
                              value=kv.window_dropped)
    fb = CounterMetricFamily("strata_dense_fallback", "Request-layer steps run dense in sparse "
                             "mode, by reason.", labels=["reason"])
    for reason in ("prefill", "fits_budget", "dense_layer"):
        fb.add_metric([reason], kv.dense_fallbacks.get(reason, 0))
    yield fb
    yield HistogramMetricFamily("strata_sparse_selected_tokens",
                                "Tokens attended per request, layer and KV head in sparse decode.",
                                buckets=_cumulative(SELECTED_TOKEN_BUCKETS, kv.selected_buckets),
                                sum_value=kv.selected_sum)
    yield from stage_families(kv)


def prefix_families(stats):
    """strata_prefix_cache_*: tokens looked up and found (vLLM's prefix_cache_queries and
    _hits), cached pages per tier."""
    yield CounterMetricFamily("strata_prefix_cache_queries", "Prompt tokens of requests "
                              "looked up in the prefix cache.",
                              value=stats.prefix_queried_tokens)
    yield CounterMetricFamily("strata_prefix_cache_hits", "Prompt tokens whose KV the prefix "
                              "cache held.", value=stats.prefix_hit_tokens)
    pages = GaugeMetricFamily("strata_prefix_cache_pages", "Pages in the prefix cache, by the "
                              "tier that holds them.", labels=["tier"])
    for tier in TIERS:
        pages.add_metric([tier], stats.prefix_pages.get(tier, 0))
    yield pages


def spec_families(stats):
    """strata_spec_decode_*: n-gram drafts verified, tokens drafted and kept (vLLM's
    spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens)."""
    for name, text, value in zip(
            ("num_drafts", "num_draft_tokens", "num_accepted_tokens"),
            ("Decodes that verified drafts (--speculative-config).", "Tokens drafted.",
             "Drafted tokens kept."), stats.spec_decode):
        yield CounterMetricFamily(f"strata_spec_decode_{name}", text, value=value)


def stage_families(kv):
    """strata_stage_seconds{stage} (one observation per micro-batch), busy and stall totals."""
    hist = HistogramMetricFamily("strata_stage_seconds", "Time one micro-batch spent in a "
                                 "decode stage (per layer).", labels=["stage"])
    busy = CounterMetricFamily("strata_stage_busy_seconds", "Seconds each decode stage worked.",
                               labels=["stage"])
    stall = CounterMetricFamily("strata_pipeline_stall_seconds", "Seconds each decode stage "
                                "waited on the stage before it.", labels=["stage"])
    empty = [0] * (len(STAGE_BUCKETS) + 1)
    for st in STAGES:
        hist.add_metric([st], _cumulative(STAGE_BUCKETS, kv.stage_buckets.get(st, empty)),
                        sum_value=kv.stage_busy.get(st, 0.0))
        busy.add_metric([st], kv.stage_busy.get(st, 0.0))
        stall.add_metric([st], kv.stage_stall.get(st, 0.0))
    yield hist
    yield busy
    yield stall
