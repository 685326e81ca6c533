"""deploy/'s Prometheus configs (promtool) and Grafana dashboards without a running stack: the
configs pass promtool, the dashboards are well-formed Grafana models with the panels the
monitoring issue asked for, and every metric they query is in docs/monitoring.md's contract
(test_monitoring.py runs the same queries against a live server; test_deploy.py checks that
Compose mounts these files)."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.deploy_helpers import (DEPLOY, REPO, dashboard_metric_names, dashboards,
                                  metric_names, panel_queries, panels, prometheus_tool,
                                  rated_metric_names, variable_queries)


# --- Prometheus configs ---------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-local.yml",
                                    "prometheus-scale.yml"])
def test_promtool_check_config_passes(config):
    result = subprocess.run([prometheus_tool("promtool"), "check", "config",
                             str(DEPLOY / "prometheus" / config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --- Grafana dashboards -------------------------------------------------------------------------

REQUIRED_PANELS = {
    "Strata overview": {
        "Requests running and waiting": {"strata_requests_running", "strata_requests_waiting"},
        "Time to first token": {"strata_time_to_first_token_seconds_bucket"},
        "Inter-token latency": {"strata_inter_token_latency_seconds_bucket"},
        "End-to-end latency": {"strata_e2e_request_latency_seconds_bucket"},
        "Tokens per second": {"strata_generation_tokens_total", "strata_prompt_tokens_total"},
        "Finished requests by reason": {"strata_request_success_total"},
        "Rejections by reason": {"strata_admission_rejections_total"},
        "Draft acceptance": {"strata_spec_decode_num_accepted_tokens_total",
                             "strata_spec_decode_num_draft_tokens_total"},
    },
    "Strata I/O vs compute": {
        "Time per stage (stacked)": {"strata_stage_busy_seconds_total"},
        "Stall time per stage (stacked)": {"strata_pipeline_stall_seconds_total"},
        "Bytes per second per tier pair": {"strata_kv_transfer_bytes_total"},
        "Hit ratio per tier": {"strata_kv_page_hits_total", "strata_kv_page_lookups_total"},
        "Tier usage against capacity": {"strata_kv_tier_used_bytes",
                                        "strata_kv_tier_capacity_bytes"},
        "Selected tokens per step": {"strata_sparse_selected_tokens_bucket"},
    },
}


def test_dashboards_have_the_panels_the_issue_asks_for():
    boards = {b["title"]: b for b in dashboards().values()}
    assert set(boards) == set(REQUIRED_PANELS)
    for title, required in REQUIRED_PANELS.items():
        by_title = {p["title"]: p for p in panels(boards[title])}
        for panel_title, metrics in required.items():
            assert panel_title in by_title, f"{title}: no panel {panel_title!r}"
            used = set().union(*(metric_names(t["expr"]) for t in by_title[panel_title]["targets"]))
            assert metrics <= used, f"{title}: {panel_title}: {metrics - used} not used"
    io = {p["title"]: p for p in panels(boards["Strata I/O vs compute"])}
    for stacked in ("Time per stage (stacked)", "Stall time per stage (stacked)"):
        assert io[stacked]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_dashboards_are_well_formed_grafana_models():
    uids = set()
    for name, board in dashboards().items():
        assert board["uid"] not in uids
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells = set()
        for p in board["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, f"{name}: {p['title']} is wider than the grid"
            cell = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                    for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & cell, f"{name}: {p['title']} overlaps another panel"
            cells |= cell
        for panel, target in panel_queries(board):
            where = f"{name}: {panel['title']}"
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            expr = target["expr"]
            assert expr.strip(), where
            # every selector is filtered by the instance variable, every window is Grafana's
            assert expr.count("{") == expr.count('instance=~"$instance"'), where
            assert set(re.findall(r"\[([^\]]*)\]", expr)) <= {"$__rate_interval"}, where


def test_promql_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, stage) (rate(strata_stage_seconds_bucket'
            '{instance=~"$instance", stage!="x"}[$__rate_interval]))) / on (stage) '
            'group_left sum without (le) (strata_b_total offset 5m) > 1e3')
    assert metric_names(expr) == {"strata_stage_seconds_bucket", "strata_b_total"}
    assert metric_names("label_values(strata_requests_running, instance)") == \
        {"strata_requests_running"}
    assert rated_metric_names(expr) == {"strata_stage_seconds_bucket"}


def test_dashboards_only_rate_counters_and_histogram_series():
    for board in dashboards().values():
        for panel, target in panel_queries(board):
            expr = target["expr"]
            for name in metric_names(expr):
                rated = name in rated_metric_names(expr)
                counter_like = re.search(r"_(total|bucket|sum|count)$", name) is not None
                assert rated == counter_like, \
                    f"{board['title']}: {panel['title']}: {name} {'' if rated else 'not '}rated"
        for query in variable_queries(board):
            assert metric_names(query), query


def test_dashboard_metrics_are_in_the_metrics_contract():
    """The names the dashboards use are the contract's, docs/monitoring.md (the live check is
    in test_monitoring.py)."""
    contract = REPO / "docs" / "monitoring.md"
    strip = re.compile(r"_(total|bucket|sum|count)$")
    families = {strip.sub("", n) for n in re.findall(r"`(strata_[a-z0-9_]+)", contract.read_text())}
    for name in dashboard_metric_names():
        assert strip.sub("", name) in families, \
            f"{name} is not in docs/monitoring.md's metrics contract"
