"""bench/common.py, the helpers the benchmark scripts share: where results go, what they name,
the timing loop, percentiles, a server that will not start, the budget plot; and stepping an
engine (bench/engine_steps.py).
No model and no server: the scripts' own tests (test_bench_suite.py, test_soak.py, ...) run
them for real."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench import common, engine_steps, servers


def test_results_go_under_bench_results_unless_out_says_otherwise(tmp_path):
    assert common.result_path(None, "ruler") == common.ROOT / "bench" / "results" / "ruler.json"
    assert common.result_path(None, "ruler", quick=True).name == "ruler_quick.json"
    assert common.result_path(str(tmp_path / "x.json"), "ruler", quick=True) == tmp_path / "x.json"
    ap = common.parser("First line.\n\nMore.")
    common.add_out_arg(ap, "soak")
    common.add_out_arg(ap2 := common.parser("x"), "ruler", quick=True)
    assert ap.description == "First line." and ap.parse_args([]).out.endswith("soak.json")
    assert ap2.parse_args([]).out is None                   # result_path picks, --quick or not
    path = common.write_json(tmp_path / "a" / "b.json", {"k": [1, 2]})
    assert common.read_json(path) == {"k": [1, 2]}
    assert path.read_text() == '{\n "k": [\n  1,\n  2\n ]\n}'           # indent=1, as before


def test_every_result_header_names_the_cpu_and_the_code():
    head = common.result_header("soak")
    assert head["bench"] == "soak" and list(head) == ["bench", "code_version", "machine"]
    m = head["machine"]
    assert m["cpu"] and m["cpu"] == common.cpu_name() and m["cores"] >= 1
    assert set(m["cpu_flags"]) <= set(common.CPU_FLAGS)
    assert common.cpu_line(m).startswith(m["cpu"] + " (")
    assert len(head["code_version"]["head"]) >= 7


def test_time_calls_warms_up_then_times_each_call():
    calls = []
    times = common.time_calls(lambda: calls.append(1), 5, warmup=3)
    assert len(calls) == 8 and len(times) == 5 and all(t >= 0 for t in times)


def test_pct_is_the_nearest_rank():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert (common.pct(xs, 0), common.pct(xs, 50), common.pct(xs, 100)) == (1.0, 3.0, 5.0)
    assert common.pct([], 50) != common.pct([], 50)                       # NaN


def test_a_server_that_exits_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("boom: no model\n")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match=r"exited with 3; log: .*\nboom: no model"):
        servers.wait_ready(proc, f"http://127.0.0.1:{servers.free_port()}/health", log, timeout=30)
    with servers.server_or_url("http://example.invalid/v1", ["--never-started"]) as (proc, url):
        assert proc is None and url == "http://example.invalid/v1"


class FakeEngine:
    """Each step gives every added request one token; request "bad" fails instead."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def add_request(self, rid, ids, params) -> None:
        self.requests.append(rid)

    def step(self) -> list:
        return [SimpleNamespace(request_id=r, new_token_ids=[] if r == "bad" else [7],
                                error="broken" if r == "bad" else None) for r in self.requests]


def test_engine_steps_prefill_one_request_at_a_time_and_keep_errors():
    run = engine_steps.EngineSteps(FakeEngine())
    assert run.prefill_one_by_one({"a": [1], "b": [2], "bad": [3]}, None, "prefill") == 3
    assert run.produced == {"a": 3, "b": 2, "bad": 0} and run.errors == {"bad": "broken"}
    strict = engine_steps.EngineSteps(FakeEngine(), raise_errors=True)
    strict.engine.add_request("bad", [3], None)
    with pytest.raises(RuntimeError, match="requests failed"):
        strict.step()
    assert common.counter_delta({"a": 1, "b": 2}, {"b": 5, "c": 1}) == {"a": -1, "b": 3, "c": 1}


def test_budget_plot_draws_every_config_variant_and_dense(tmp_path):
    scores = {("dense", 4000): 90.0, ("sparse-256", 4000): 60.0, ("sparse-1024", 4000): 85.0,
              ("sparse-1024-p0", 4000): 70.0}
    assert common.config_budget("dense") == 0 and common.config_budget("sparse-1024-p0") == 1024
    png = tmp_path / "acc.png"
    common.plot_by_budget(lambda c, n: scores.get((c, n)), [c for c, _ in scores], [4000, 7000],
                          png, "accuracy (%)", "title")
    assert png.stat().st_size > 0
