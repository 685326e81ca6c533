"""bench/needle.py's report: accuracy per config, length and depth, its tables and plot."""
from __future__ import annotations

from pathlib import Path

from bench.common import plot_by_budget, read_json


def summarize(rows: list[dict], configs: list[str], lengths: list[int]) -> dict:
    acc: dict[str, dict[str, float]] = {}
    for c in configs:
        acc[c] = {}
        for n in lengths + ["all"]:
            sel = [r for r in rows if r["config"] == c and (n == "all" or r["length"] == n)]
            acc[c][str(n)] = 100.0 * sum(r["correct"] for r in sel) / len(sel) if sel else None
    by_depth = {c: {str(n): {str(d): 100.0 * sum(r["correct"] for r in rows if r["config"] == c
                                                 and r["length"] == n and r["depth"] == d)
                             / max(1, sum(1 for r in rows if r["config"] == c
                                          and r["length"] == n and r["depth"] == d))
                             for d in sorted({r["depth"] for r in rows})}
                    for n in lengths} for c in configs}
    gaps = {}
    for c in configs:
        if c != "dense" and "dense" in acc:
            gaps[c] = {k: (acc[c][k] - acc["dense"][k]) if acc[c][k] is not None else None
                       for k in acc[c]}
    return {"accuracy_pct": acc, "accuracy_by_depth_pct": by_depth, "gap_vs_dense_points": gaps}


def print_tables(summary: dict, configs: list[str], lengths: list[int], n_per: dict) -> None:
    acc = summary["accuracy_pct"]
    cols = [str(n) for n in lengths] + ["all"]
    print("\naccuracy % (n prompts per cell: " + ", ".join(f"{k}: {v}" for k, v in n_per.items())
          + ")")
    print(f"{'config':<20}" + "".join(f"{c + ' tok':>12}" if c != "all" else f"{c:>12}"
                                      for c in cols))
    for c in configs:
        print(f"{c:<20}" + "".join(f"{acc[c][k]:>12.1f}" for k in cols))
    for c, g in summary["gap_vs_dense_points"].items():
        print(f"gap {c} - dense (points): " + ", ".join(f"{k}: {v:+.1f}" for k, v in g.items()))
    print("\nby depth (accuracy %):")
    depths = sorted({d for c in configs for n in summary["accuracy_by_depth_pct"][c].values()
                     for d in n}, key=float)
    print(f"{'config':<20}{'len':>6}" + "".join(f"{d:>7}" for d in depths))
    for c in configs:
        for n in lengths:
            row = summary["accuracy_by_depth_pct"][c][str(n)]
            print(f"{c:<20}{n:>6}" + "".join(f"{row[d]:>7.0f}" for d in depths))


def plot(summary: dict, configs: list[str], lengths: list[int], path: Path, title: str) -> None:
    acc = summary["accuracy_pct"]
    plot_by_budget(lambda c, n: acc[c][str(n)], configs, lengths, path, "needle accuracy (%)",
                   title, markersize=8)


def plot_title(fmt: str, depths: list[float], per_depth: int) -> str:
    return (f"NIAH, SmolLM2-135M, format {fmt}, {len(depths)} depths x {per_depth} needles "
            f"per length")


def replot(path: Path) -> None:
    report = read_json(path)
    for fmt, rep in report["formats"].items():
        png = path.with_suffix(".png")
        plot(rep, report["configs"], report["lengths"], png,
             plot_title(fmt, report["depths"], report["per_depth"]))
        print(f"wrote {png}")
