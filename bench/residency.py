"""Which pages stay in DRAM: device hit rate and disk bytes per step per --residency policy
(cycle | lru | score) and --kv-placement (recency | mass), side by side.

    .venv/bin/python bench/residency.py                 # 8 x 7K tokens, 2 rounds x 12 steps
    .venv/bin/python bench/residency.py --arms cycle lru score --rounds 1
    .venv/bin/python bench/residency.py --quick         # 4 x 4K tokens, 1 round x 6 steps
    .venv/bin/python bench/residency.py --replot bench/results/residency.json

The workload is bench/pipeline.py's (and bench/kv_codec.py's): `--batch` essay prompts of
`--context` tokens prefilled one after another, sparse budget 1024, --kv-device-gb 0.064
--kv-host-gb 0.256 (on a CPU one DRAM pool of 0.32 GB, a quarter of the KV), the rest on disk,
--pipeline sequential. Each arm runs in its own process (bench/kv_ab.py: its own prefill and
disk folder), the arms taking turns for `--rounds`. Per arm: the device tier's hit rate over
the timed steps (pages found in DRAM / pages a step needed: KVDrive's Table 3), pages and
bytes read from disk per step, what the reads asked of the drive (gap pages included) and in
how many reads, disk bytes per step over the first 3 decode steps (what the placement left on
disk), and the median decode step. Results: bench/results/residency.json and .png.
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
from engine.args import disk_folders  # noqa: E402

TIERS = dict(kv_device_gb=0.064, kv_host_gb=0.256, kv_disk_gb=8, sparse_budget=1024,
             pipeline="sequential")
ARMS = {"cycle": {"residency": "cycle"}, "lru": {"residency": "lru"},
        "score": {"residency": "score"}, "cycle+mass": {"kv_placement": "mass"},
        "score+mass": {"residency": "score", "kv_placement": "mass"},
        # two folders (kvstore/tiers/disk_set.py; one drive on this box): the reads' split
        "score+2folders": {"residency": "score", "disk_folders": 2}}


def summarize(runs: list[dict]) -> dict:
    """One arm's runs (one per round) -> medians."""
    def med(fn):
        return statistics.median(fn(r) for r in runs)
    return {"step_ms_median": statistics.median(s for r in runs for s in r["step_ms"]),
            "device_hit_rate": med(lambda r: r["hits"]["device"] / max(1, r["lookups"]["device"])),
            "disk_to_device_bytes_per_step": med(
                lambda r: r["bytes_per_step"].get("disk->device", 0)),
            "disk_read_bytes_per_step": med(lambda r: r["disk_read_bytes_per_step"]),
            "disk_reads_per_step": med(lambda r: r["disk_reads_per_step"]),
            "first_steps_disk_bytes_per_step": med(
                lambda r: r["first_steps_disk_bytes_per_step"]),
            "disk_page_bytes": runs[0]["disk_page_bytes"], "rounds": len(runs),
            "per_path_read_bytes_per_step": {
                Path(p).name: statistics.median(r["per_path_read_bytes_per_step"][p] for r in runs)
                for p in runs[0].get("per_path_read_bytes_per_step", {})}}


def run(args) -> dict:
    by_arm: dict[str, list[dict]] = {a: [] for a in args.arms}
    root = Path(__file__).resolve().parents[1]
    for r in range(args.rounds):
        for arm in args.arms:
            print(f"round {r + 1}/{args.rounds}: {arm} ...", flush=True)
            res = run_arm(f"residency-{arm}", root, {**TIERS, **ARMS[arm]}, args)
            for folder in disk_folders(res["engine"]["kv_disk_path"]):      # GBs of pages
                shutil.rmtree(folder, ignore_errors=True)
            by_arm[arm].append(res)
            print(f"  step {res['step_ms_median']:.0f} ms, disk -> device "
                  f"{res['bytes_per_step'].get('disk->device', 0) / 2**20:.1f} MiB/step",
                  flush=True)
    rows = {a: summarize(runs) for a, runs in by_arm.items()}
    base = rows.get("cycle")
    for row in rows.values():
        if base is not None:
            for key in ("disk_to_device_bytes_per_step", "disk_read_bytes_per_step",
                        "step_ms_median"):
                row[f"{key}_vs_cycle"] = row[key] / max(1.0, base[key])
    return {"bench": "residency", "machine": machine(), "code": code_version(),
            "batch": args.batch, "context": args.context, "steps": args.steps,
            "tiers": TIERS, "arms": {a: ARMS[a] for a in args.arms}, "rows": rows,
            "runs": {a: [{k: v for k, v in r.items() if k != "engine"} for r in runs]
                     for a, runs in by_arm.items()}}


def report(res: dict) -> str:
    m = res["machine"]
    lines = [f"{cpu_line(m)}; {res['batch']} x {res['context']} tokens, budget "
             f"{res['tiers']['sparse_budget']}, --kv-device-gb {res['tiers']['kv_device_gb']} "
             f"--kv-host-gb {res['tiers']['kv_host_gb']}, --pipeline {res['tiers']['pipeline']}",
             "| arm | device hit rate | pages from disk / step | MiB from disk / step | "
             "vs cycle | drive MiB / step (gaps too) | vs cycle | reads / step | "
             "first 3 steps MiB / step | decode step ms | vs cycle |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a, row in res["rows"].items():
        mib = row["disk_to_device_bytes_per_step"] / 2**20
        lines.append(
            f"| {a} | {100 * row['device_hit_rate']:.1f}% | "
            f"{row['disk_to_device_bytes_per_step'] / row['disk_page_bytes']:.0f} | {mib:.1f} | "
            f"{row.get('disk_to_device_bytes_per_step_vs_cycle', 1):.2f} | "
            f"{row['disk_read_bytes_per_step'] / 2**20:.1f} | "
            f"{row.get('disk_read_bytes_per_step_vs_cycle', 1):.2f} | "
            f"{row['disk_reads_per_step']:.0f} | "
            f"{row['first_steps_disk_bytes_per_step'] / 2**20:.1f} | "
            f"{row['step_ms_median']:.0f} | {row.get('step_ms_median_vs_cycle', 1):.2f} |")
    for a, row in res["rows"].items():
        if len(row.get("per_path_read_bytes_per_step", {})) > 1:      # a disk set
            lines.append("")
            lines.append(f"`{a}`: drive MiB read per step per folder: " + ", ".join(
                f"{p} {v / 2**20:.1f}" for p, v in row["per_path_read_bytes_per_step"].items()))
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    arms = list(res["rows"])
    rows = [res["rows"][a] for a in arms]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 3.6))
    a.bar(arms, [100 * r["device_hit_rate"] for r in rows], color="#55a868")
    a.set_ylabel("device tier hit rate, %")
    b.bar(arms, [r["disk_read_bytes_per_step"] / 2**20 for r in rows], color="#4c72b0",
          label="drive (gaps too)")
    b.bar(arms, [r["disk_to_device_bytes_per_step"] / 2**20 for r in rows], color="#8fa8d8",
          label="pages")
    b.set_ylabel("MiB read from disk per decode step")
    b.legend(fontsize=7)
    c.bar(arms, [r["step_ms_median"] for r in rows], color="#dd8452")
    c.set_ylabel("decode step, ms (median)")
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{res['batch']} x {res['context']} tokens, budget "
                 f"{res['tiers']['sparse_budget']}, DRAM a quarter of the KV; "
                 f"{res['machine']['cpu']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=["cycle", "score", "score+mass"],
                    choices=list(ARMS))
    ap.add_argument("--quick", action="store_true")
    add_out_arg(ap, "residency", quick=True)
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    args.serial_prefill, args.prompts = True, "essay"
    if args.quick:
        args.batch, args.context, args.steps, args.rounds = 4, 4000, 6, 1
    replot_or_run(args, "residency", run, plot, report)


if __name__ == "__main__":
    main()
