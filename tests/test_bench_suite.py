"""The benchmark harness (bench/throughput.py, roofline.py, report.py, suite.py): the ramp
measures real streams from a real server and cancels them; the roofline's byte model; the README's
Results section is generated, spliced between its markers, and up to date with the committed
results. The benchmarks' numbers themselves are never asserted (timings on a shared box)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from bench import common, report, roofline, ruler, suite, throughput, throughput_report
from server.tokenizer import Tokenizer
from tests.server_helpers import REPO, running_server


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


def test_prompts_hit_the_context_and_differ(tokenizer):
    texts = common.essay_texts(tokenizer, 3, 1000)
    lens = [len(tokenizer.encode_chat([{"role": "user", "content": t}])) for t in texts]
    assert all(950 <= n <= 1000 for n in lens), lens
    assert len(set(texts)) == 3 and all(t.endswith(common.QUESTION) for t in texts)
    # the same prompts as token ids (bench/sparse_decode.py's and pipeline.py's)
    assert [len(ids) for ids in common.essay_prompts(tokenizer, 3, 1000)] == lens


def test_ramp_times_every_level_over_http_and_cancels_the_requests(tokenizer, tmp_path):
    texts = common.essay_texts(tokenizer, 3, 300)
    lens = [len(tokenizer.encode_chat([{"role": "user", "content": t}])) for t in texts]
    with running_server("--kv-disk-gb", "1", "--kv-disk-path", str(tmp_path),
                        "--kv-force-tier", "disk", "--sparse-budget", "64",
                        "--max-num-seqs", "4") as srv:
        rows = asyncio.run(throughput.ramp(srv.url, "SmolLM2-135M-Instruct", texts, lens,
                                           [1, 3], steps=3))
        throughput._drain(srv.url, timeout=60)            # the cancelled requests are gone
        assert srv.metric("strata_requests_running") == 0
        assert srv.metric("strata_request_success_total", 'finished_reason="abort"') == 3
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["timed_tokens"] >= 3 * r["concurrency"]
        assert r["decode_tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["ttft_s"]["mean"] > 0 and r["itl_s"]["p50"] >= 0
        assert set(r["stage_busy_s_per_step"]) >= {"select", "fetch", "compute"}
        assert r["stage_busy_s_per_step"]["compute"] > 0
        assert r["kv_bytes_per_step"]["disk->device"] > 0    # every page comes from disk
    assert rows[1]["prompt_tokens"] == pytest.approx(sum(lens[1:]) / 2)


def test_a_burst_after_the_ramp_sends_every_request_at_once_on_the_same_server(tokenizer):
    from tqdm import tqdm
    texts = common.essay_texts(tokenizer, 2, 300)
    lens = [len(tokenizer.encode_chat([{"role": "user", "content": t}])) for t in texts]
    with running_server("--max-num-seqs", "4") as srv:
        # what the bench records about the server's --dtype auto / --weights auto choice
        lines = throughput.weight_lines(srv.log_path)
        assert any(line.startswith("--dtype auto: ") for line in lines), srv.log_tail()
        cells = throughput.run_server_cells(
            "dense", srv.url, "SmolLM2-135M-Instruct", {300: texts}, {300: lens}, [1], steps=2,
            bar=tqdm(disable=True), metrics=True, bursts=[2], burst_tokens=4)
        assert srv.metric("strata_requests_running") == 0
        assert srv.metric("strata_request_success_total", 'finished_reason="abort"') == 1
        assert srv.metric("strata_request_success_total", 'finished_reason="length"') == 2
    assert [(c["mode"], c["concurrency"]) for c in cells] == [("ramp", 1), ("burst", 2)]
    b = cells[1]
    assert b["engine"] == "dense" and b["context"] == 300 and b["burst_tokens"] == 4
    assert b["wall_s"] >= b["ttft_s"]["max"] >= b["ttft_s"]["mean"] >= b["ttft_s"]["min"] > 0
    assert b["wall_s"] >= b["first_finish_s"] > b["ttft_s"]["max"]
    assert b["decode_tokens_per_s"] > 0 and 0 < b["window_tokens"] <= 2 * 3
    assert b["output_tokens_per_s"] == pytest.approx(2 * 4 / b["wall_s"])
    assert b["prompt_tokens"] == pytest.approx(sum(lens) / 2)


def test_burst_row_counts_only_the_window_while_every_request_decodes():
    # sent at 0; A's tokens at 1, 2, 3, 4 (its last at 4), B's first at 2.5 and then 3.5, 4.5, 5.5
    row = throughput_report.burst_row([[1, 2, 3, 4], [2.5, 3.5, 4.5, 5.5]], [4.1, 5.6], 0.0,
                                      4, 300.0)
    assert row["mode"] == "burst" and row["concurrency"] == 2
    assert row["wall_s"] == pytest.approx(5.6) and row["first_finish_s"] == 4
    assert row["ttft_s"]["min"] == 1 and row["ttft_s"]["max"] == 2.5
    # window (2.5, 4]: A's 3 and 4, B's 3.5: 3 tokens in 1.5 s
    assert row["window_s"] == pytest.approx(1.5) and row["window_tokens"] == 3
    assert row["decode_tokens_per_s"] == pytest.approx(2.0)
    assert row["output_tokens_per_s"] == pytest.approx(8 / 5.6)
    # A done before B starts: no window, no rate (and not a crash)
    row = throughput_report.burst_row([[1, 2], [3, 4]], [2, 4], 0.0, 2, 10.0)
    assert row["decode_tokens_per_s"] is None and row["window_s"] == 0
    with pytest.raises(RuntimeError, match="expected 4 tokens"):
        throughput_report.burst_row([[1, 2, 3]], [3], 0.0, 4, 10.0)


def test_weight_lines_are_read_from_a_strata_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO:strata.cli:loading\n"
                   "INFO:engine.weight_plan:--dtype auto: fp32 (a 64-row block: fp32 1.0 ms)\n"
                   "INFO:engine.weight_plan:--weights auto: native for decode (1+8 rows)\n"
                   "INFO:uvicorn:ready\n")
    assert throughput.weight_lines(log) == ["--dtype auto: fp32 (a 64-row block: fp32 1.0 ms)",
                                            "--weights auto: native for decode (1+8 rows)"]
    assert throughput.weight_lines(tmp_path / "missing.log") == []


def test_peers_default_to_llama_cpp_and_transformers_fp32():
    args = throughput.build_parser().parse_args([])
    assert args.peers == ["llama.cpp", "transformers-fp32"] and args.burst == []
    args = throughput.build_parser().parse_args(["--peers", "transformers", "transformers-fp32",
                                                 "--burst", "8", "--burst-tokens", "32"])
    assert args.peers == ["transformers", "transformers-fp32"]
    assert args.burst == [8] and args.burst_tokens == 32
    from bench.peers import hf_transformers
    assert hf_transformers.DTYPES == {"transformers": "bfloat16", "transformers-fp32": "float32"}


def _throughput_report() -> dict:
    cell = {"ttft_s": {"mean": 1.0, "p50": 1.0, "max": 1.0},
            "itl_s": {"mean": 0.1, "p50": 0.1, "p99": 0.2}, "timed_tokens": 32}
    cells = [
        {**cell, "engine": "dense", "context": 4000, "concurrency": 8, "prompt_tokens": 4000,
         "decode_tokens_per_s": 10.0, "step_s": 0.8, "kv_bytes_per_step": {},
         "stage_busy_s_per_step": {"compute": 0.5}},
        {**cell, "engine": "sparse-tiered", "context": 4000, "concurrency": 8,
         "prompt_tokens": 4000, "decode_tokens_per_s": 25.0, "step_s": 0.32,
         "kv_bytes_per_step": {"disk->device": 3.2e7, "host->device": 1e6},
         "stage_busy_s_per_step": {"select": 0.05, "compute": 0.2}},
        {**cell, "engine": "transformers", "context": 4000, "concurrency": 8,
         "prompt_tokens": 4000, "decode_tokens_per_s": 5.0, "step_s": 1.6},
    ]
    return {"bench": "throughput", "code_version": {"head": "abc1234"},
            "machine": {"cpu": "Test CPU 9000", "cores": 2, "mem_gib": 24.0},
            "settings": {"contexts": [4000], "concurrency": [8], "steps": 8,
                         "configs": {"dense": ["--kv-device-gb", "4"],
                                     "sparse-tiered": ["--sparse-budget", "1024"]}},
            "skipped": {"llama.cpp": "not installed"}, "wall_s": 60.0, "cells": cells}


MB = {"weights": 1000, "kv_token_layer": 10, "layers": 30, "kv_heads": 3}


def test_roofline_counts_weights_plus_the_kv_each_configuration_attends():
    rows = {r["engine"]: r for r in roofline.achieved(_throughput_report(), 10.0, 1.0, MB)}
    assert set(rows) == {"dense", "sparse-tiered"}            # peers have no /metrics
    assert rows["dense"]["dram_bytes_per_step"] == 1000 + 8 * 10 * 30 * 4000
    # 2 dense layers read the whole context, the other 28 the budget
    assert rows["sparse-tiered"]["dram_bytes_per_step"] == 1000 + 8 * 10 * (2 * 4000 + 28 * 1024)
    assert rows["sparse-tiered"]["disk_bytes_per_step"] == 3.2e7
    assert rows["sparse-tiered"]["disk_fraction"] == pytest.approx(3.2e7 / 0.32 / 1e9)
    assert rows["dense"]["disk_fraction"] == 0


def test_report_tables_name_the_machine_and_compare_against_dense(tmp_path):
    (tmp_path / "throughput.json").write_text(json.dumps(_throughput_report()))
    text = report.render(tmp_path)
    assert "Test CPU 9000, 2 cores, 24 GiB RAM" in text
    assert "| 4K | 8 | 10.0 | 25.0 (2.50x) | 5.0 (0.50x) |" in text
    assert "Skipped: llama.cpp: not installed." in text
    assert "| sparse-tiered | 4K | 8 | 320 | 50 | 200 |" in text     # select, compute busy ms
    assert "no `" in text and "bench/ruler.py" in text               # the missing parts say so
    assert text.startswith(report.BEGIN) and text.endswith(report.END)


def test_burst_rows_get_their_own_table_and_leave_the_ramp_tables_alone(tmp_path):
    rep = _throughput_report()
    burst = {"mode": "burst", "context": 4000, "concurrency": 8, "burst_tokens": 64,
             "ttft_s": {"mean": 20.0, "p50": 20.0, "min": 5.0, "max": 40.0},
             "first_finish_s": 45.0, "window_s": 4.0, "window_tokens": 200, "step_s": 0.16,
             "itl_s": None, "prompt_tokens": 4000}
    rep["cells"] += [
        {**burst, "engine": "dense", "wall_s": 120.0, "decode_tokens_per_s": 20.0,
         "output_tokens_per_s": 4.3},
        {**burst, "engine": "sparse-tiered", "wall_s": 50.0, "decode_tokens_per_s": 60.0,
         "output_tokens_per_s": 10.2},
        {**burst, "engine": "llama.cpp", "wall_s": 100.0, "decode_tokens_per_s": 30.0,
         "output_tokens_per_s": 5.1}]
    rep["settings"]["strata_weights"] = {"dense": ["--dtype auto: fp32 (x)"], "sparse-tiered": []}
    (tmp_path / "throughput.json").write_text(json.dumps(rep))
    text = report.render(tmp_path)
    assert "| 4K | 8 | 10.0 | 25.0 (2.50x) | 5.0 (0.50x) |" in text      # the ramp's, as before
    assert "| 4K | 8 | sparse-tiered | 50.0 (0.50x llama.cpp) | 20.0 / 40.0 | " \
           "60.0 (2.00x llama.cpp, 3.00x dense) | 10.2 |" in text
    assert "| 4K | 8 | llama.cpp | 100.0 | 20.0 / 40.0 | 30.0 (1.50x dense) | 5.1 |" in text
    assert "**dense** `--dtype auto: fp32 (x)`" in text
    printed = throughput.table(rep)
    assert printed.count("\n") == len(rep["cells"]) + 3 and "burst" in printed
    throughput_report.plot(rep, tmp_path / "t.png")                   # ramp cells only
    assert (tmp_path / "t.png").exists() and (tmp_path / "t_stages.png").exists()
    labels = [throughput_report.label(rep, e) for e in ("dense", "sparse-tiered", "llama.cpp",
                                                        "transformers", "transformers-fp32")]
    assert labels == ["dense (fp32, ? decode)", "sparse-tiered", "llama.cpp (Q4_1)",
                      "transformers (bf16)", "transformers-fp32"]


def test_report_replaces_only_the_marked_section(tmp_path):
    readme = f"# Title\n\nbefore\n\n{report.BEGIN}\nold results\n{report.END}\n\nafter\n"
    new = report.splice(readme, f"{report.BEGIN}\nnew\n{report.END}")
    assert new == f"# Title\n\nbefore\n\n{report.BEGIN}\nnew\n{report.END}\n\nafter\n"
    assert report.splice(new, f"{report.BEGIN}\nnew\n{report.END}") == new
    with pytest.raises(ValueError, match="markers"):
        report.splice("# no markers\n", "x")


def test_readme_results_are_generated_from_the_committed_results():
    rc = subprocess.run([sys.executable, "bench/report.py", "--check"], cwd=REPO,
                        capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr


@pytest.mark.parametrize("preset", ["quick", "default", "full"])
def test_suite_presets_pass_options_each_part_accepts(preset):
    # every part's parser accepts the preset's options (a typo would fail an hour into a run)
    modules = {"throughput": throughput, "ruler": ruler, "roofline": roofline}
    for name, cmd in suite.commands(preset):
        assert cmd[0] == f"bench/{name}.py"
        args = modules[name].build_parser().parse_args(cmd[1:])
        assert args.out.endswith(f"{name}_quick.json" if preset == "quick" else f"{name}.json")
        if name == "throughput" and preset != "quick":
            assert args.burst == [8] and args.peer_concurrency is None   # peers at every level


def test_report_has_a_soak_section_when_the_soak_ran(tmp_path):
    soak = {"bench": "soak", "clients": 32, "minutes": 10.0, "disconnect": 0.1,
            "server_args": "--kv-disk-gb 2", "requests": 900, "hang_ups": 90, "failed": 0,
            "latency_s": {"p50": 1.5, "p99": 9.25},
            "flat": {"rss_mb": {"after_warmup": 900.0, "end": 910.0, "max": 930.0},
                     "open_files": {"after_warmup": 40, "end": 40, "max": 44}}}
    (tmp_path / "soak.json").write_text(json.dumps(soak))
    text = report.render(tmp_path)
    assert "### Soak" in text and "bench/soak.py --clients 32 --minutes 10`" in text
    assert "| 900 | 90 | 0 | 1.50 / 9.25 | 900 -> 910 MB (max 930) | 40 -> 40 (max 44) |" in text
