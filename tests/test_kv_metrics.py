"""server/kv_metrics.py mirrors label values and bucket bounds of kvstore.stats (the server may
not import kvstore): the copies must agree, or /metrics mislabels the counts."""
import kvstore.stats as counted
import server.kv_metrics as exported


def test_exported_labels_and_buckets_match_the_counters():
    for name in ("TIERS", "SELECTED_TOKEN_BUCKETS", "STAGES", "STAGE_BUCKETS"):
        assert getattr(exported, name) == getattr(counted, name), name
