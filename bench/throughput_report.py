"""bench/throughput.py's report: the weight formats each Strata server chose, a burst's row from
its token timestamps, the plots (decode tokens/s against context; time per stage) and the text
table. (The machine it ran on: bench/common.py's machine().)

    .venv/bin/python bench/throughput.py --replot bench/results/throughput.json

Reports written before the burst existed have no "mode" on their cells: those are ramp rows.
"""
from __future__ import annotations

import re
import statistics
from pathlib import Path

from bench.common import pct, pyplot, save_figure

STAGES = ("select", "resolve", "fetch", "compute")      # the decode stages, in pipeline order
# what `--dtype auto` / `--weights auto` log at start-up (engine/weight_plan.py), e.g.
# "--dtype auto: fp32 (a 64-row block: ...)", "--weights auto: native for decode (...)"
WEIGHT_LINE = re.compile(r"--(dtype|weights) \w+: .*")


def weight_lines(log: Path) -> list[str]:
    """The `--dtype ...: ...` and `--weights ...: ...` lines a Strata server logged at start-up
    (what it chose for this CPU), from the log prefix on; [] when it logged none."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [m.group(0).strip() for line in text.splitlines()
            if (m := WEIGHT_LINE.search(line))]


def burst_row(times: list[list[float]], ends: list[float], t0: float, tokens: int,
              prompt_tokens: float) -> dict:
    """A burst's row from its requests' token timestamps (all sent at t0, `tokens` each) and end
    times: wall time to the last end, TTFT, and the decode rate over the window while all of
    them decode: tokens streamed after the last request's first token, up to and including the
    first request's last token, over that time (None when the windows do not overlap)."""
    n = len(times)
    counts = [len(ts) for ts in times]
    if counts != [tokens] * n:
        raise RuntimeError(f"burst: expected {tokens} tokens per request, counted {counts}")
    ttft = [ts[0] - t0 for ts in times]
    wall = max(ends) - t0
    all_decoding = max(ts[0] for ts in times)
    first_done = min(ts[-1] for ts in times)
    inside = [[t for t in ts if all_decoding < t <= first_done] for ts in times]
    window = max(0.0, first_done - all_decoding)
    counted = sum(map(len, inside))
    rate = counted / window if window > 0 and counted else None
    itl = [b - a for ts in inside for a, b in zip(ts, ts[1:])]
    return {"mode": "burst", "concurrency": n, "burst_tokens": tokens, "wall_s": wall,
            "ttft_s": {"mean": statistics.fmean(ttft), "p50": pct(ttft, 50), "min": min(ttft),
                       "max": max(ttft)},
            "first_finish_s": first_done - t0, "window_s": window, "window_tokens": counted,
            "decode_tokens_per_s": rate, "step_s": n / rate if rate else None,
            "itl_s": {"mean": statistics.fmean(itl), "p50": pct(itl, 50), "p99": pct(itl, 99)}
            if itl else None,
            "output_tokens_per_s": n * tokens / wall, "prompt_tokens": prompt_tokens}


def ramp_cells(report: dict) -> list[dict]:
    return [c for c in report["cells"] if c.get("mode", "ramp") == "ramp"]


def burst_cells(report: dict) -> list[dict]:
    return [c for c in report["cells"] if c.get("mode") == "burst"]


def label(report: dict, engine: str) -> str:
    """A plot label that says each line's number format: a Strata config's chosen activations
    and decode weights (from its start-up log), llama.cpp's GGUF, transformers' dtype."""
    s = report.get("settings", {})
    if engine in s.get("configs", {}):
        found = {}
        for line in s.get("strata_weights", {}).get(engine, []):
            m = re.match(r"--(dtype|weights) \w+: (\w+)", line)
            if m:
                found[m.group(1)] = m.group(2)
        if not found:
            return engine if "strata_weights" in s else f"{engine} ({s.get('dtype', '?')})"
        return f"{engine} ({found.get('dtype', '?')}, {found.get('weights', '?')} decode)"
    if engine == "llama.cpp":
        return "llama.cpp (Q4_1)"
    if engine == "transformers":
        return "transformers (bf16)"
    return engine


def plot(report: dict, png: Path) -> None:
    cells = ramp_cells(report)
    configs = report.get("settings", {}).get("configs", {})
    levels = sorted({c["concurrency"] for c in cells})
    engines = list(dict.fromkeys(c["engine"] for c in cells))
    fig, axes = pyplot().subplots(1, max(1, len(levels)), figsize=(4 * max(1, len(levels)), 3.6),
                             squeeze=False, sharey=False)
    for ax, level in zip(axes[0], levels):
        for eng in engines:
            pts = sorted((c["context"], c["decode_tokens_per_s"]) for c in cells
                         if c["engine"] == eng and c["concurrency"] == level)
            if pts:
                ax.plot([p[0] / 1000 for p in pts], [p[1] for p in pts], marker="o",
                        label=label(report, eng), linestyle="-" if eng in configs else "--")
        ax.set_title(f"{level} request{'s' if level > 1 else ''} in flight")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    m = report.get("machine", {})
    fig.suptitle(f"Decode throughput, SmolLM2-135M ({m.get('cores', '?')} cores, "
                 f"{m.get('cpu', '')})", fontsize=10)
    save_figure(fig, png, dpi=110)
    plot_stages(report, png.with_name(png.stem + "_stages.png"))


def plot_stages(report: dict, png: Path) -> None:
    """Busy ms per decode step of each stage, stacked, per configuration and context, at the
    largest number of requests in flight."""
    rows = [c for c in ramp_cells(report) if c.get("stage_busy_s_per_step")]
    if not rows:
        return
    top = max(c["concurrency"] for c in rows)
    rows = [c for c in rows if c["concurrency"] == top]
    seen = {k for c in rows for k in c["stage_busy_s_per_step"]}
    stages = [st for st in STAGES if st in seen] + sorted(seen - set(STAGES))
    labels = [f"{c['engine']}\n{c['context'] // 1000}K" for c in rows]
    fig, ax = pyplot().subplots(figsize=(max(5, 1.1 * len(rows)), 3.8))
    bottom = [0.0] * len(rows)
    for st in stages:
        vals = [c["stage_busy_s_per_step"].get(st, 0.0) * 1e3 for c in rows]
        ax.bar(labels, vals, bottom=bottom, label=st)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(labels, [c["step_s"] * 1e3 for c in rows], color="k", marker="_", s=400,
               label="step time", zorder=3)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Time per stage, {top} requests in flight (busy time; stages overlap "
                 "under sfc)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    save_figure(fig, png, dpi=110)


def _f(x: float | None, fmt: str, scale: float = 1.0) -> str:
    width = int(fmt.split(".")[0] or 0)
    return "-".rjust(width) if x is None else format(x * scale, fmt)


def table(report: dict) -> str:
    lines = [f"{'engine':17} {'ctx':>5} {'conc':>4} {'tok/s':>7} {'step ms':>8} "
             f"{'TTFT s':>7} {'ITL p50':>8} {'ITL p99':>8}"]
    for c in ramp_cells(report):
        lines.append(f"{c['engine']:17} {c['context']:>5} {c['concurrency']:>4} "
                     f"{c['decode_tokens_per_s']:7.2f} {c['step_s'] * 1e3:8.0f} "
                     f"{c['ttft_s']['mean']:7.2f} {c['itl_s']['p50'] * 1e3:8.0f} "
                     f"{c['itl_s']['p99'] * 1e3:8.0f}")
    bursts = burst_cells(report)
    if bursts:
        lines += ["", "burst: N requests sent at once; tok/s while all N decode, and N x tokens "
                  "over the wall time", f"{'engine':17} {'ctx':>5} {'N':>4} {'wall s':>7} "
                  f"{'TTFT s':>7} {'TTFTmax':>7} {'tok/s':>7} {'e2e t/s':>7} {'window s':>8}"]
        for c in bursts:
            lines.append(f"{c['engine']:17} {c['context']:>5} {c['concurrency']:>4} "
                         f"{c['wall_s']:7.2f} {c['ttft_s']['mean']:7.2f} "
                         f"{c['ttft_s']['max']:7.2f} {_f(c['decode_tokens_per_s'], '7.2f')} "
                         f"{c['output_tokens_per_s']:7.2f} {c['window_s']:8.2f}")
    return "\n".join(lines)
