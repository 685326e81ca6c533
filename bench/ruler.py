"""RULER (NVIDIA's synthetic long-context tasks) against a Strata server: dense against \
sparse decode.

    .venv/bin/python bench/ruler.py              # ~4K and ~7K tokens, 2 samples per task, 5 configs
    .venv/bin/python bench/ruler.py --quick      # ~4K, 1 sample per task, dense and sparse-1024
    .venv/bin/python bench/ruler.py --lengths 4000 7000 --per-task 3 \\
        --configs dense sparse-256 sparse-512 sparse-1024 sparse-2048 --out bench/results/ruler.json
    .venv/bin/python bench/ruler.py --url http://127.0.0.1:8000/v1 --configs dense
                                                 # a running server
    .venv/bin/python bench/ruler.py --replot bench/results/ruler.json

Tasks, their generation, lengths and scoring: bench/ruler_tasks.py.

Configs: `dense` (no sparse flags) and `sparse-N` (--sparse-budget N; otherwise the server's
defaults, every page on the device tier); suffixes as in bench/needle.py: `-union`
(--sparse-head-pages union), `-mean` (--selector mean), `-pS` (--sparse-prior-share S). Each config
starts one server (bench/common.py's start_server), gets every sample (the same ones), and is
stopped. Cost on a 2-core CPU: prefill runs ~200-500 tokens/s (4 requests in flight, shared box),
so each config takes about total prompt tokens / 400 s: ~3-4 min for the default 16 samples
(88K tokens; ~15-20 min for the 5 configs), 40-90 s for --quick (16K tokens; 133 s in all).
Generating a ~7K-token sample takes ~0.5 s (the binary search tokenizes ~13 candidate prompts).
Writes the JSON (--out; bench/results/ruler.json, ruler_quick.json with --quick) and a PNG beside
it: accuracy against sparse budget, one line per length, dense as a dashed line.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (add_out_arg, add_replot_arg, code_version, cpu_name,  # noqa: E402
                          model_folder, parser, plot_by_budget, read_json, result_path,
                          use_checkout_cache, write_json)
from bench.servers import async_openai, server_or_url  # noqa: E402
from bench.ruler_tasks import (MAX_TOKENS, TASKS, generate, postprocess,  # noqa: E402
                               string_match_all, task_score)
from server.tokenizer import Tokenizer  # noqa: E402

use_checkout_cache()


def config_flags(name: str) -> list[str]:
    """dense -> []; sparse-N[-union][-mean][-pS] -> --sparse-budget N and the suffixes' flags
    (with --sparse-threshold 1: sparse from the first page past the budget, the selector's
    accuracy at N whatever the length, not the server's default of dense up to 2N)."""
    if name == "dense":
        return []
    parts = name.split("-")
    if parts[0] != "sparse" or len(parts) < 2 or not parts[1].isdigit():
        raise ValueError(f"config {name!r}: expected dense or sparse-N[-union|-mean|-pS]")
    flags = ["--sparse-budget", parts[1], "--sparse-threshold", "1"]
    for p in parts[2:]:
        if p == "union":
            flags += ["--sparse-head-pages", "union"]
        elif p in ("mean", "quest"):
            flags += ["--selector", p]
        elif re.fullmatch(r"p[0-9.]+", p):
            flags += ["--sparse-prior-share", p[1:]]
        else:
            raise ValueError(f"config {name!r}: unknown suffix {p!r}")
    return flags


# ------------------------------------------------------------------------------ running
async def query_all(url: str, model: str | None, samples: list[dict], concurrency: int,
                    desc: str) -> list[dict]:
    """Every sample through /v1/chat/completions (greedy), `concurrency` in flight
    -> [{prediction, server_tokens, error}] in the samples' order."""
    from tqdm import tqdm

    client = async_openai(url, timeout=3600)
    if model is None:
        model = (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(samples), desc=desc, unit="req")

    async def one(s: dict) -> dict:
        async with sem:
            try:
                resp = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": s["prompt"]}],
                    max_tokens=MAX_TOKENS[s["task"]], temperature=0)
                out = {"prediction": resp.choices[0].message.content or "",
                       "server_tokens": resp.usage.prompt_tokens if resp.usage else None}
            except Exception as exc:  # noqa: BLE001 - recorded per sample, scored 0
                out = {"prediction": "", "server_tokens": None, "error": repr(exc)}
            bar.update(1)
            return out

    try:
        return await asyncio.gather(*(one(s) for s in samples))
    finally:
        bar.close()
        await client.close()


def run_config(name: str, samples: list[dict], args) -> list[dict]:
    """Start a server for the config (unless --url), send every sample, stop it."""
    with server_or_url(args.url, config_flags(name) + args.server_args.split()) as (_, url):
        outs = asyncio.run(query_all(url, args.model, samples, args.concurrency, name))
    rows = []
    for s, o in zip(samples, outs):
        pred = postprocess(o["prediction"])
        row = {"config": name, "task": s["task"], "length": s["length"], "tokens": s["tokens"],
               "server_tokens": o["server_tokens"], "depth": s["depth"], "answers": s["answers"],
               "prediction": pred, "score": 100.0 * string_match_all(pred, s["answers"])}
        if "error" in o:
            row["error"] = o["error"]
        rows.append(row)
    return rows


def aggregate(rows: list[dict], configs, tasks, lengths) -> tuple[list[dict], list[dict]]:
    """-> results (config, task, length: mean score) and summary (config, length: mean over
    tasks)."""
    results, summary = [], []
    for c in configs:
        for n in lengths:
            per_task = []
            for t in tasks:
                sel = [r for r in rows if r["config"] == c and r["task"] == t and r["length"] == n]
                if sel:
                    score = task_score([r["prediction"] for r in sel], [r["answers"] for r in sel])
                    results.append({"config": c, "task": t, "length": n, "n": len(sel),
                                    "score": score})
                    per_task.append(score)
            if per_task:
                summary.append({"config": c, "length": n,
                                "score": sum(per_task) / len(per_task)})
    return results, summary


def print_table(report: dict) -> None:
    s = report["settings"]
    print(f"\nRULER string_match_all x 100 ({s['per_task']} samples per task and length)")
    tasks = s["tasks"]
    print(f"{'config':<16}{'length':>7}" + "".join(f"{t:>17}" for t in tasks) + f"{'mean':>8}")
    for row in report["summary"]:
        cells = {r["task"]: r["score"] for r in report["results"]
                 if r["config"] == row["config"] and r["length"] == row["length"]}
        print(f"{row['config']:<16}{row['length']:>7}"
              + "".join(f"{cells.get(t, float('nan')):>17.1f}" for t in tasks)
              + f"{row['score']:>8.1f}")


def plot(report: dict, path: Path) -> None:
    summ = {(r["config"], r["length"]): r["score"] for r in report["summary"]}
    s = report["settings"]
    plot_by_budget(lambda c, n: summ.get((c, n)), s["configs"], s["lengths"], path,
                   "RULER accuracy, mean over tasks (%)",
                   f"RULER ({', '.join(s['tasks'])}), SmolLM2-135M, greedy, "
                   f"samples per task and length: {s['per_task']}")


def build_parser() -> argparse.ArgumentParser:
    ap = parser(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="target prompt lengths in tokens (default 4000 7000; --quick 4000)")
    ap.add_argument("--per-task", type=int, default=None,
                    help="samples per task and length (default 2; --quick 1)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="dense, sparse-N[-union|-mean|-pS] (default dense and budgets "
                         "256-2048; --quick dense sparse-1024)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--quick", action="store_true", help="~4K only, 1 sample per task, "
                                                         "dense and sparse-1024")
    ap.add_argument("--url", default=None,
                    help="base URL (…/v1) of a running server: one config, named by --configs")
    ap.add_argument("--model", default=None, help="model id to send (default: the server's first)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--server-args", default="", help="extra flags for every started server")
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap, "ruler", quick=True)
    add_replot_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.replot:
        path = Path(args.replot)
        plot(read_json(path), path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
        return
    lengths = args.lengths or ([4000] if args.quick else [4000, 7000])
    per_task = args.per_task or (1 if args.quick else 2)
    configs = args.configs or (["dense", "sparse-1024"] if args.quick else
                               ["dense", "sparse-256", "sparse-512", "sparse-1024", "sparse-2048"])
    for c in configs:
        try:
            config_flags(c)                               # fail early on a bad name
        except ValueError as exc:
            ap.error(str(exc))
    if args.url and len(configs) != 1:
        ap.error("--url runs one config: name it with a single --configs value")
    out = result_path(args.out, "ruler", args.quick)
    t_all = time.perf_counter()

    folder = model_folder()
    tok = Tokenizer.from_folder(folder)
    t0 = time.perf_counter()
    samples = generate(tok, args.tasks, lengths, per_task, args.seed)
    gen_s = time.perf_counter() - t0
    print(f"generated {len(samples)} samples in {gen_s:.1f} s; prompt tokens "
          + ", ".join(f"~{n}: {min(s['tokens'] for s in samples if s['length'] == n)}-"
                      f"{max(s['tokens'] for s in samples if s['length'] == n)}" for n in lengths))

    rows: list[dict] = []
    config_s = {}
    for name in configs:
        t0 = time.perf_counter()
        rows += run_config(name, samples, args)
        config_s[name] = time.perf_counter() - t0
        print(f"{name}: {config_s[name]:.0f} s")
    results, summary = aggregate(rows, configs, args.tasks, lengths)
    wall = time.perf_counter() - t_all
    report = {
        "bench": "ruler",
        "code_version": code_version(),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "settings": {"tasks": args.tasks, "lengths": lengths, "per_task": per_task,
                     "configs": configs,
                     "server_flags": {c: config_flags(c) + args.server_args.split()
                                      for c in configs},
                     "url": args.url, "model_folder": folder.name, "seed": args.seed,
                     "concurrency": args.concurrency, "max_tokens": MAX_TOKENS,
                     "temperature": 0, "quick": args.quick, "generation_s": gen_s,
                     "config_s": config_s, "wall_s": wall},
        "results": results,
        "summary": summary,
        "samples": rows,
    }
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"WARNING: {len(errors)} requests failed (scored 0), e.g. {errors[0]['error']}")
    mismatched = [r for r in rows if r["server_tokens"] not in (None, r["tokens"])]
    if mismatched:
        print(f"WARNING: {len(mismatched)} prompts counted differently by the server, e.g. "
              f"{mismatched[0]['tokens']} here against {mismatched[0]['server_tokens']}")
    print_table(report)
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(report, png)
    print(f"\nwrote {out} and {png}; wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
