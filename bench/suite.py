"""The benchmark suite: throughput, accuracy and roofline, then the README's Results section.

    .venv/bin/python bench/suite.py            # default: ~25-35 min on 2 cores (estimated, below)
    .venv/bin/python bench/suite.py --quick    # within ~5 minutes (writes *_quick.json)
    .venv/bin/python bench/suite.py --full     # the whole grid: ~70 minutes on 2 cores
    make bench-suite ARGS=--quick

Each part is its own command (and process, so one part's memory never carries into the next),
with its own progress bar and JSON under bench/results/:

| part | default | --quick | --full |
|---|---|---|---|
| bench/throughput.py | contexts 4K 7K x 1 4 8 requests, 4 Strata configs, peers (llama.cpp, \
transformers fp32) at every level; a burst of 8 | 1K x 1 4, dense and sparse-tiered, \
transformers fp32 | 1K 4K 7K x 1 4 8 16 requests, peers at every level; a burst of 8 |
| bench/ruler.py | ~4K and ~7K, 1 sample per task, dense and budgets 256, 1024 \
| ~4K, 1 per task, dense and 1024 | budgets 256-2048, 3 per task |
| bench/roofline.py | 1 GiB DRAM, 2 GiB disk file | 256 MiB, 512 MiB | as default |

Prefill dominates on a CPU (~350-600 tokens/s at 7K, depending on the box), and every request
of every configuration prefills its own prompt, so the grid's 1K row and 16-request column, the
512 and 2048 budgets and more RULER samples are --full's. Measured on 2026-11-23 (AMD EPYC, 2
cores) with the previous default (1K row, transformers at 4 too, all four budgets): throughput
21.5 min (per Strata config ~20 s at 1K, ~1.3 min at 4K, ~3 min at 7K; transformers ~2.5 min),
RULER 10.8 min (~2.2 min per config), roofline 0.4 min: 32.6 min. This default dropped ~6.5 min
of it (~26 min then). Measured again on 2026-11-25 (Intel Xeon, 2 cores) at 970f50b, after the
AVX-512 attention rows: throughput 7.8 min, RULER 2.4, roofline 0.4: 10.6 min. Since then the
default runs the peers (llama.cpp and transformers fp32) at 4 and 8 too, and a burst of 8 per
context and engine, which prefills 8 x (4K + 7K) tokens again per Strata config (~2.5-4 min each
at those prefill rates): an estimate, not yet timed.
Then bench/report.py rewrites the README's Results section (not for --quick or --suffix, whose
report goes to bench/results/report<suffix>.md). The wall time of each part is printed at the end.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import RESULTS, ROOT, parser  # noqa: E402

PRESETS = {
    "quick": {
        "throughput": ["--quick"],
        "ruler": ["--quick"],
        "roofline": ["--quick"],
    },
    "default": {
        "throughput": ["--contexts", "4000", "7000", "--concurrency", "1", "4", "8",
                       "--burst", "8"],
        "ruler": ["--lengths", "4000", "7000", "--per-task", "1",
                  "--configs", "dense", "sparse-256", "sparse-1024"],
        "roofline": [],
    },
    "full": {
        "throughput": ["--concurrency", "1", "4", "8", "16", "--burst", "8"],
        "ruler": ["--lengths", "4000", "7000", "--per-task", "3", "--configs", "dense",
                  "sparse-256", "sparse-512", "sparse-1024", "sparse-2048"],
        "roofline": [],
    },
}


def commands(preset: str, suffix: str | None = None) -> list[tuple[str, list[str]]]:
    if suffix is None:
        suffix = "_quick" if preset == "quick" else ""
    p = PRESETS[preset]
    tp = str(RESULTS / f"throughput{suffix}.json")
    return [
        ("throughput", ["bench/throughput.py", *p["throughput"], "--out", tp]),
        ("ruler", ["bench/ruler.py", *p["ruler"], "--out", str(RESULTS / f"ruler{suffix}.json")]),
        ("roofline", ["bench/roofline.py", *p["roofline"], "--throughput", tp,
                      "--out", str(RESULTS / f"roofline{suffix}.json")]),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, paragraph=True)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true")
    g.add_argument("--full", action="store_true")
    ap.add_argument("--only", nargs="+", choices=("throughput", "ruler", "roofline"),
                    help="run these parts only (the report still reads every JSON)")
    ap.add_argument("--suffix", default=None,
                    help="results as bench/results/<part><suffix>.json and the report in "
                         "report<suffix>.md, README untouched (default: '' and the README; "
                         "_quick with --quick)")
    args = ap.parse_args(argv)
    preset = "quick" if args.quick else "full" if args.full else "default"
    suffix = args.suffix if args.suffix is not None else ("_quick" if args.quick else "")
    walls = {}
    t0 = time.perf_counter()
    for name, cmd in commands(preset, suffix):
        if args.only and name not in args.only:
            continue
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call([sys.executable, *cmd], cwd=ROOT)
        walls[name] = time.perf_counter() - t
        if rc != 0:
            print(f"{name} failed with exit status {rc}", file=sys.stderr)
            return rc
    report = [sys.executable, "bench/report.py"]
    if suffix:
        out = RESULTS / f"report{suffix}.md"
        with out.open("w") as f:
            subprocess.check_call(report + ["--suffix", suffix, "--stdout"], cwd=ROOT, stdout=f)
        print(f"wrote {out}")
    else:
        subprocess.check_call(report, cwd=ROOT)
    total = time.perf_counter() - t0
    print(" ".join(f"{k} {v / 60:.1f} min," for k, v in walls.items())
          + f" total {total / 60:.1f} min ({preset})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
