"""bench/gpu/kit.py, which carries the GPU checks' wheels to a lent CUDA machine in parts, one
device call each: the parts reassemble into the same wheels, a part that did not arrive (or
arrived damaged) is named as missing, the device calls it prints carry one part each and fit
the tool's 64 MiB, and the checks write at most the 8 files the tool brings back. No GPU: the
gpu tests skip, and the bench step runs a stand-in command."""
from __future__ import annotations

import json
import sys
import tarfile
from types import SimpleNamespace

import pytest

from bench.gpu import kit


@pytest.fixture()
def wheels(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, size in enumerate([300_000, 1_000, 700_000]):
        (folder / f"pkg{i}-1.0-py3-none-any.whl").write_bytes(bytes([i + 1]) * size)
    return folder


@pytest.fixture()
def places(tmp_path, monkeypatch):
    monkeypatch.setattr(kit, "KIT", tmp_path / "repo" / ".gpukit")
    monkeypatch.setattr(kit, "HOME", tmp_path / "home")
    return kit.KIT


def test_parts_reassemble_into_the_same_wheels(wheels, places):
    manifest = kit.pack(wheels, places, part_mb=0.25, python_version="3.12")
    assert len(manifest["parts"]) == 4          # ~1 MB of tar in 0.25 MiB parts
    assert all(p["bytes"] <= 0.25 * 2**20 for p in manifest["parts"])
    assert json.loads((places / "manifest.json").read_text()) == manifest
    assert kit.stage(manifest) == []            # every part carried at once
    whole = places.parent / "whole.tar"
    with whole.open("wb") as out:
        for p in manifest["parts"]:
            out.write((kit.HOME / "parts" / p["name"]).read_bytes())
    with tarfile.open(whole) as tar:
        names = sorted(tar.getnames())
        assert names == sorted(w.name for w in wheels.glob("*.whl"))
        for name in names:
            assert tar.extractfile(name).read() == (wheels / name).read_bytes()


def test_staging_keeps_parts_across_calls_and_names_the_missing(wheels, places, tmp_path):
    manifest = kit.pack(wheels, places, part_mb=0.25, python_version="3.12")
    away = tmp_path / "away"
    away.mkdir()
    for p in manifest["parts"]:
        (places / p["name"]).rename(away / p["name"])
    names = [p["name"] for p in manifest["parts"]]
    (away / names[2]).rename(places / names[2])          # call 1 carries part 2
    assert kit.stage(manifest) == [names[0], names[1], names[3]]
    (places / names[2]).unlink()                          # call 2: part 0, damaged
    bad = bytearray((away / names[0]).read_bytes())
    bad[10] ^= 1
    (places / names[0]).write_bytes(bytes(bad))
    assert kit.stage(manifest) == [names[0], names[1], names[3]]
    for n in (names[0], names[1], names[3]):              # the rest, in a last call
        (places / n).unlink(missing_ok=True)
        (away / n).rename(places / n)
    assert kit.stage(manifest) == []


def test_the_printed_calls_carry_one_part_each_within_the_tools_limit(wheels, places):
    manifest = kit.pack(wheels, places, part_mb=0.25, python_version="3.12")
    lines = [line for line in kit.plan(manifest).splitlines() if "run(command=" in line]
    assert len(lines) == len(manifest["parts"])
    for line, p in zip(lines, manifest["parts"]):
        assert f".gpukit/{p['name']}'" in line and ".gpukit/manifest.json" in line
    assert all("--stage-only" in line for line in lines[:-1]) and "--stage-only" not in lines[-1]
    assert kit.tree_mb() < 16                   # the repo leaves room for a part in each call


def test_checks_write_at_most_the_eight_files_the_tool_brings_back(places, tmp_path,
                                                                   monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    ran = []

    def fake_run(self, name, cmd, log, cap_s=None):
        ran.append(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"{name} ran\n")
        if name == "bench":                     # what bench/throughput.py writes
            for f in ("throughput_gpu.json", "throughput_gpu.png", "throughput_gpu_stages.png"):
                (out / f).write_text("x")
            (kit.HOME / "logs" / "servers").mkdir()
            (kit.HOME / "logs" / "servers" / "dense.log").write_text("server")
        self.rows.append({"step": name, "rc": 0, "seconds": 0})
        (self.out / "summary.json").write_text(json.dumps(self.rows))
        return 0

    monkeypatch.setattr(kit.Steps, "run", fake_run)
    args = SimpleNamespace(run="tests,bench", bench_args=kit.BENCH, deadline_s=60)
    kit.checks(args, tmp_path / "site")
    assert ran == ["build", "env", "tests", "bench"]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir())
    with tarfile.open(out / "logs.tgz") as tar:
        assert {"logs/build.log", "logs/bench.log", "logs/servers/dense.log"} <= set(
            tar.getnames())


def test_a_step_past_the_deadline_is_stopped_and_recorded(tmp_path):
    steps = kit.Steps(tmp_path, {}, deadline=kit.time.time() + 6)
    rc = steps.run("slow", [sys.executable, "-c", "import time; time.sleep(30)"],
                   tmp_path / "slow.log")
    assert rc == 1 and steps.rows[-1]["rc"] == "timed out"
    assert steps.run("next", [sys.executable, "-c", "pass"], tmp_path / "next.log") == 1
    assert steps.rows[-1]["rc"] == "skipped: no time left"
    assert json.loads((tmp_path / "summary.json").read_text())[0]["step"] == "slow"
