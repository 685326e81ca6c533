"""server/kv_metrics.py mirrors label values and bucket bounds of kvstore.stats (the server may
not import kvstore): the copies must agree, or /metrics mislabels the counts."""
import kvstore.stats as counted
import server.kv_metrics as exported


def test_exported_labels_and_buckets_match_the_counters():
    for name in ("TIERS", "SELECTED_TOKEN_BUCKETS", "STAGES", "STAGE_BUCKETS"):
        assert getattr(exported, name) == getattr(counted, name), name


def test_the_micro_batch_gauge_shows_the_calibration_with_sfc_only():
    """strata_pipeline_micro_batch: 0 while --pipeline sfc calibrates, then the size it chose;
    no series in the other modes (-1)."""
    from engine.protocol import EngineStats

    def gauge(mb):
        fams = [f for f in exported.kv_families(EngineStats(0, 0, 0, 0, 0,
                                                            pipeline_micro_batch=mb))
                if f.name == "strata_pipeline_micro_batch"]
        return [s.value for f in fams for s in f.samples]

    assert gauge(-1) == []
    assert gauge(0) == [0]
    assert gauge(4) == [4]
