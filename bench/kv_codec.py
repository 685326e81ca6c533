"""Disk bytes and decode step time per --kv-tier-codec (none | int8 | int4), side by side.

    .venv/bin/python bench/kv_codec.py                  # 8 x 7K tokens, 2 rounds x 12 steps
    .venv/bin/python bench/kv_codec.py --quick          # 4 x 4K tokens, 1 round x 6 steps
    .venv/bin/python bench/kv_codec.py --replot bench/results/kv_codec.json

The workload is bench/pipeline.py's: `--batch` essay prompts of `--context` tokens (a
different stretch of the bundled essays each, and a question; prefilled one after another, so
that greedy decoding follows the same text whatever the codec), sparse budget 1024, --kv-device-gb
0.064 --kv-host-gb 0.256 (on a CPU one DRAM pool of 0.32 GB; with `int8-host` / `int4-host` a
separate host pool of 0.256 GB that stores codes too), the rest on disk (`int4-s0.5`: half the
layers coded there, `int4-auto`: the share the start-up cost model picks, --kv-tier-codec-share);
--pipeline as given (default sequential). Each codec runs in its own process
(bench/kv_ab.py's arms: its own disk folder and format), the codecs taking turns for
`--rounds`, so the box's noise falls on all alike. Per codec: median decode step, what the
store moved from disk per step (pages x bytes per page on disk), what the reads asked of the
drive (gap pages included) and in how many reads, and the codec's scales kept in memory.
Accuracy is bench/needle.py's `sparse-1024-int8` / `-int4` configs. Results:
bench/results/kv_codec.json and .png.
"""
from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (add_out_arg, add_replot_arg, code_version, cpu_line,  # noqa: E402
                          machine, parser, pyplot, replot_or_run, save_figure)
from bench.kv_ab import run_arm  # noqa: E402

# "-host": with a separate host pool (--kv-host-pool separate), which the codec stores too;
# "-s0.5": --kv-tier-codec-share 0.5 (half the layers coded on disk); "-auto": the share the
# start-up cost model picks (kvstore/codec_share.py)
CODECS = ("none", "int8", "int4", "int8-host", "int4-host", "int4-s0.5", "int4-auto")


def arm_settings(codec: str) -> dict:
    """An arm's name -> its engine settings beside TIERS."""
    name, _, mod = codec.partition("-")
    over = {"kv_tier_codec": name}
    if mod == "host":
        over["kv_host_pool"] = "separate"
    elif mod == "auto" or mod.startswith("s"):
        over["kv_tier_codec_share"] = "auto" if mod == "auto" else mod[1:]
    elif mod:
        raise ValueError(f"unknown codec arm {codec!r}")
    return over
TIERS = dict(kv_device_gb=0.064, kv_host_gb=0.256, kv_disk_gb=8, sparse_budget=1024)


def summarize(runs: list[dict]) -> dict:
    """One codec's runs (one per round) -> medians."""
    def med(key):
        return statistics.median(r[key] for r in runs)
    return {"step_ms_median": statistics.median(s for r in runs for s in r["step_ms"]),
            "disk_to_device_bytes_per_step": statistics.median(
                r["bytes_per_step"].get("disk->device", 0) for r in runs),
            "disk_read_bytes_per_step": med("disk_read_bytes_per_step"),
            "disk_reads_per_step": med("disk_reads_per_step"),
            "disk_page_bytes": runs[0]["disk_page_bytes"], "max_pages": runs[0]["max_pages"],
            "disk_coded_layers": runs[0].get("disk_coded_layers"),
            "prefill_s": med("prefill_s"), "rounds": len(runs),
            "host_to_device_bytes_per_step": statistics.median(
                r["bytes_per_step"].get("host->device", 0) for r in runs)}


def run(args) -> dict:
    by_codec: dict[str, list[dict]] = {c: [] for c in args.codecs}
    root = Path(__file__).resolve().parents[1]
    for r in range(args.rounds):
        for codec in args.codecs:
            print(f"round {r + 1}/{args.rounds}: --kv-tier-codec {codec} ...", flush=True)
            over = {**TIERS, **arm_settings(codec), "pipeline": args.pipeline}
            res = run_arm(f"codec-{codec}", root, over, args)
            shutil.rmtree(res["engine"]["kv_disk_path"], ignore_errors=True)   # GBs of pages
            by_codec[codec].append(res)
            print(f"  step {res['step_ms_median']:.0f} ms, disk -> device "
                  f"{res['bytes_per_step'].get('disk->device', 0) / 2**20:.1f} MiB/step",
                  flush=True)
    rows = {c: summarize(runs) for c, runs in by_codec.items()}
    base = rows.get("none")
    for c, row in rows.items():
        if base is not None:
            row["fewer_disk_bytes_x"] = (base["disk_to_device_bytes_per_step"]
                                         / max(1.0, row["disk_to_device_bytes_per_step"]))
            row["step_vs_none"] = row["step_ms_median"] / base["step_ms_median"]
    return {"bench": "kv_codec", "machine": machine(), "code": code_version(),
            "batch": args.batch, "context": args.context, "steps": args.steps,
            "pipeline": args.pipeline, "tiers": TIERS, "codecs": rows,
            "runs": {c: [{k: v for k, v in r.items() if k != "engine"} for r in runs]
                     for c, runs in by_codec.items()}}


def report(res: dict) -> str:
    m = res["machine"]
    lines = [f"{cpu_line(m)}; {res['batch']} x {res['context']} tokens, budget "
             f"{res['tiers']['sparse_budget']}, --pipeline {res['pipeline']}",
             "| codec | layers coded on disk | bytes per page on disk | disk -> device "
             "MiB/step | pages/step | fewer bytes | disk reads/step | decode step ms | "
             "step vs none |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c, row in res["codecs"].items():
        coded = row.get("disk_coded_layers")
        lines.append(f"| {c} | {'-' if coded is None else len(coded)} | "
                     f"{row['disk_page_bytes']} | "
                     f"{row['disk_to_device_bytes_per_step'] / 2**20:.1f} | "
                     f"{row['disk_to_device_bytes_per_step'] / row['disk_page_bytes']:.0f} | "
                     f"{row.get('fewer_disk_bytes_x', 1):.2f}x | "
                     f"{row['disk_reads_per_step']:.0f} | "
                     f"{row['step_ms_median']:.0f} | {row.get('step_vs_none', 1):.2f} |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    codecs = list(res["codecs"])
    rows = [res["codecs"][c] for c in codecs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(codecs, [r["disk_to_device_bytes_per_step"] / 2**20 for r in rows], color="#4c72b0")
    a.set_ylabel("MiB read from disk per decode step")
    b.bar(codecs, [r["step_ms_median"] for r in rows], color="#dd8452")
    b.set_ylabel("decode step, ms (median)")
    for ax in (a, b):
        ax.set_xlabel("--kv-tier-codec")
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"{res['batch']} x {res['context']} tokens, budget "
                 f"{res['tiers']['sparse_budget']}, KV spilling to disk; "
                 f"{res['machine']['cpu']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pipeline", default="sequential")
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS,
                    help="-host: a separate host pool (DRAM split as --kv-device-gb 0.064 "
                         "--kv-host-gb 0.256), stored as codes too")
    ap.add_argument("--quick", action="store_true")
    add_out_arg(ap, "kv_codec", quick=True)
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    args.serial_prefill, args.prompts = True, "essay"
    if args.quick:
        args.batch, args.context, args.steps, args.rounds = 4, 4000, 6, 1
    replot_or_run(args, "kv_codec", run, plot, report)


if __name__ == "__main__":
    main()
