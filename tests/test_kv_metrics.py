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


def test_disk_bytes_are_exported_per_folder():
    """strata_kv_disk_bytes_total{path, op}: one series pair per disk folder; none without."""
    from engine.protocol import EngineStats
    io = {"/a": {"bytes_read": 10, "bytes_written": 20, "reads": 1},
          "/b": {"bytes_read": 30, "bytes_written": 40, "reads": 2}}
    fams = {f.name: f for f in exported.kv_families(EngineStats(0, 0, 0, 0, 0, kv_disk_io=io))}
    got = {(s.labels["path"], s.labels["op"]): s.value
           for s in fams["strata_kv_disk_bytes"].samples}
    assert got == {("/a", "read"): 10, ("/a", "write"): 20, ("/b", "read"): 30,
                   ("/b", "write"): 40}
    assert "strata_kv_disk_bytes" not in {f.name for f in exported.kv_families(
        EngineStats(0, 0, 0, 0, 0))}
