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

from bench import report, roofline, ruler, suite, throughput
from server.tokenizer import Tokenizer
from tests.conftest_server import REPO, running_server


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


def test_prompts_hit_the_context_and_differ(tokenizer):
    texts = throughput.make_texts(tokenizer, 3, 1000)
    lens = [len(tokenizer.encode_chat([{"role": "user", "content": t}])) for t in texts]
    assert all(950 <= n <= 1000 for n in lens), lens
    assert len(set(texts)) == 3 and all(t.endswith(throughput.QUESTION) for t in texts)


def test_ramp_times_every_level_over_http_and_cancels_the_requests(tokenizer, tmp_path):
    texts = throughput.make_texts(tokenizer, 3, 300)
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
