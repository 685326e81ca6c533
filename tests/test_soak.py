"""A short soak (bench/soak.py): clients for half a minute against a server spilling to disk,
some hanging up mid-stream: no failed request, open files flat."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_short_soak_fails_nothing_and_leaks_no_files(tmp_path):
    from bench import soak
    out = tmp_path / "soak.json"
    code = soak.main(["--clients", "4", "--minutes", "0.5", "--disconnect", "0.25",
                      "--out", str(out),
                      f"--server-args=--kv-device-gb 0.05 --kv-host-gb 0.02 --kv-disk-gb 1 "
                      f"--kv-disk-path {tmp_path / 'kv'} --max-num-seqs 4"])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["failed"] == 0, summary["failures"]
    assert summary["requests"] >= 8 and summary["hang_ups"] >= 1
    files = summary["flat"]["open_files"]
    assert files["end"] <= files["after_warmup"] + 2, files
