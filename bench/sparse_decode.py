"""Sparse decode speed and memory at 8 concurrent ~7K-token requests, by KV tier budget.

    .venv/bin/python bench/sparse_decode.py                       # driver: every config
    .venv/bin/python bench/sparse_decode.py --quick               # fewer configs and steps
    .venv/bin/python bench/sparse_decode.py --config sparse-dev0.5 --steps 64   # one worker
    .venv/bin/python bench/sparse_decode.py --config sparse-dev0.5 --profile 8  # cProfile
    .venv/bin/python bench/sparse_decode.py --replot bench/results/sparse_decode.json

The driver runs each config (CONFIGS below) in a fresh subprocess (its own RSS) and writes
bench/results/sparse_decode.json and bench/results/sparse_decode.png. Prefill runs on
--threads (2) torch threads, the timed decode on --decode-threads (1: the box is shared, and one
thread keeps the timings steadier). Disk tiers live under bench/results/kv-tmp/ and are removed.

A worker builds one engine in-process (bundled SmolLM2, bf16 KV, page 16, max_model_len 8192),
adds 8 chat prompts of ~7000 tokens of Paul Graham essays (each a different stretch), one at a
time so each prompt is prefilled in a single engine step (--prefill-tokens 8192 per step; the
first requests decode meanwhile), then, once every request has finished its prefill, times
`--steps` decode steps of all 8 (greedy, ignore_eos): decode tokens/s = 8 x steps / time of
those steps. Per step: wall time, VmRSS; over the decode phase: deltas of the store's
transfer_bytes per (src, dst) and of its device/host/disk lookups and hits.
RSS: VmHWM (peak, includes the prefill's activations) and the largest VmRSS seen during decode,
against model bytes + device + host budgets (the pools are pre-touched at start-up); the
overhead is broken into the Python/torch runtime measured before the engine is built, the page
summaries, and the rest (workspaces, bookkeeping, allocator slack). --malloc-trim calls glibc's
malloc_trim(0) after prefill and records the RSS it leaves (how much is freed-but-retained heap).
--profile N: cProfile of N decode steps, written to
bench/results/sparse_decode_profile_<config>.txt.
"""
from __future__ import annotations

import cProfile
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (KV_TMP, RESULTS, add_out_arg, add_replot_arg,  # noqa: E402
                          add_thread_args, code_version, counter_delta, essay_prompts, parser,
                          proc_memory, profile_text, pyplot, read_json, result_path,
                          save_figure, use_checkout_cache, write_json)
from bench.engine_steps import EngineSteps  # noqa: E402

use_checkout_cache()
GiB = 2**30

# name -> (sparse_budget, kv_device_gb, kv_host_gb, kv_disk_gb); a "-union" suffix runs
# --sparse-head-pages union (every KV head attends to the union of the heads' pages), "-p0"
# --sparse-prior-share 0 (Quest's bound alone, no observation-window prior)
CONFIGS = {
    "dense":                 (0, 2.0, 0.0, 0.0),
    "sparse-inmem":          (1024, 2.0, 0.0, 0.0),
    "sparse-dev0.5":         (1024, 0.5, 1.0, 4.0),
    "sparse-dev0.5-union":   (1024, 0.5, 1.0, 4.0),
    "sparse-dev0.5-p0":      (1024, 0.5, 1.0, 4.0),
    "sparse-dev0.25":        (1024, 0.25, 0.256, 4.0),
    "sparse-dev0.128":       (1024, 0.128, 0.256, 4.0),
    "sparse-dev0.064":       (1024, 0.064, 0.256, 4.0),   # the memory config
    "sparse-dev0.064-nohost": (1024, 0.064, 0.0, 4.0),
}
QUICK = ["dense", "sparse-dev0.5", "sparse-dev0.064"]
MEMORY_CONFIG = "sparse-dev0.064"


# ------------------------------------------------------------------------------ worker
def worker(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams
    from server.tokenizer import Tokenizer
    from tqdm import tqdm

    rss_runtime = proc_memory()["VmRSS"]                     # Python + torch + libraries
    budget, dev_gb, host_gb, disk_gb = CONFIGS[args.config]
    disk_path = None
    if disk_gb:
        disk_path = Path(args.kv_disk_path) / args.config
        shutil.rmtree(disk_path, ignore_errors=True)
        disk_path.mkdir(parents=True)
    eargs = EngineArgs(max_model_len=8192, max_num_seqs=args.requests,
                       max_num_batched_tokens=args.prefill_tokens, kv_device_gb=dev_gb,
                       kv_host_gb=host_gb, kv_disk_gb=disk_gb, kv_disk_path=disk_path,
                       sparse_budget=budget, threads=args.threads,
                       sparse_head_pages="union" if args.config.endswith("-union") else "per-head",
                       **({"sparse_prior_share": 0.0} if args.config.endswith("-p0") else {}))
    try:
        engine = LLMEngine(eargs)
        torch.set_num_threads(args.threads)
        model = engine.runner.model
        model_bytes = (sum(p.numel() * p.element_size() for p in model.parameters())
                       + sum(b.numel() * b.element_size() for b in model.buffers()))
        rss_loaded = proc_memory()["VmRSS"]
        tok = Tokenizer.from_folder(engine.model_folder)
        prompts = essay_prompts(tok, args.requests, args.context)
        max_tokens = args.steps + args.requests + 16        # early requests decode during prefill
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rids = [f"r{i}" for i in range(len(prompts))]
        driver = EngineSteps(engine)
        errors = driver.errors

        t0 = time.perf_counter()
        prefill_steps = driver.prefill_one_by_one(dict(zip(rids, prompts)), params,
                                                  f"{args.config} prefill")
        prefill_s = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"requests failed during prefill: {errors}")
        rss_prefilled = proc_memory()["VmRSS"]
        rss_trimmed = None
        if args.malloc_trim:
            import ctypes
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            rss_trimmed = proc_memory()["VmRSS"]
        torch.set_num_threads(args.decode_threads)
        load_before = os.getloadavg()
        store = engine.store
        before = store.stats.snapshot()
        rss_decode = 0
        step_s = []
        tokens = 0
        prof = cProfile.Profile() if args.profile else None
        n_steps = args.profile or args.steps
        for i in tqdm(range(n_steps), desc=f"{args.config} decode", leave=False):
            if prof is not None:
                prof.enable()
            ts = time.perf_counter()
            outs = driver.step()
            step_s.append(time.perf_counter() - ts)
            if prof is not None:
                prof.disable()
            tokens += sum(len(o.new_token_ids) for o in outs)
            rss_decode = max(rss_decode, proc_memory()["VmRSS"])
            if errors:
                raise RuntimeError(f"requests failed during decode: {errors}")
            if len(outs) != len(rids) or any(o.finished for o in outs):
                raise RuntimeError(f"decode step {i}: {len(outs)} outputs (a request finished "
                                   f"or was preempted; preemptions: {engine.num_preemptions})")
        after = store.stats.snapshot()
        usage = store.tier_usage()
        status = proc_memory()
        load_after = os.getloadavg()
        summaries = sum(r.summaries.numel() * r.summaries.element_size()
                        for r in map(store.request, store.request_ids()))
        for rid in rids:
            engine.abort(rid)
    finally:
        if disk_path is not None:
            shutil.rmtree(disk_path, ignore_errors=True)

    n = len(step_s)
    xfer = counter_delta(before.transfer_bytes, after.transfer_bytes)
    lookups = counter_delta(before.lookups, after.lookups)
    hits = counter_delta(before.hits, after.hits)
    evictions = counter_delta(before.evictions, after.evictions)
    budgets = int(dev_gb * GiB) + int(host_gb * GiB)
    res = {
        "config": args.config, "code": code_version(), "sparse_budget": budget,
        "head_pages": eargs.sparse_head_pages, "kv_device_gb": dev_gb,
        "kv_host_gb": host_gb, "kv_disk_gb": disk_gb, "prefill_threads": args.threads,
        "decode_threads": args.decode_threads,
        "requests": args.requests, "prompt_tokens": [len(p) for p in prompts],
        "prefill_tokens_per_step": args.prefill_tokens, "prefill_s": prefill_s,
        "prefill_steps": prefill_steps, "steps": n, "tokens": tokens,
        "decode_s": sum(step_s), "decode_tok_s": tokens / sum(step_s),
        "step_ms": [1e3 * s for s in step_s],
        "step_ms_median": 1e3 * statistics.median(step_s),
        "step_ms_mean_after_4": 1e3 * statistics.mean(step_s[4:]) if n > 4 else None,
        "per_step_bytes": {f"{s}->{d}": v / n for (s, d), v in xfer.items()},
        "per_step_lookups": {k: v / n for k, v in lookups.items()},
        "per_step_hits": {k: v / n for k, v in hits.items()},
        "per_step_evictions": {k: v / n for k, v in evictions.items()},
        "device_hit_ratio": hits.get("device", 0) / lookups["device"] if lookups.get("device")
        else None,
        "host_hit_ratio": hits.get("host", 0) / lookups["host"] if lookups.get("host") else None,
        "mean_selected_tokens": ((after.selected_sum - before.selected_sum)
                                 / (after.selected_count - before.selected_count)
                                 if after.selected_count > before.selected_count else None),
        "tier_usage": {k: list(v) for k, v in usage.items()},
        "loadavg_1m_before_after_decode": [load_before[0], load_after[0]],
        "memory": {
            "model_bytes": model_bytes, "budget_bytes": budgets,
            "rss_runtime": rss_runtime, "rss_after_load": rss_loaded,
            "rss_after_prefill": rss_prefilled, "rss_after_malloc_trim": rss_trimmed,
            "rss_decode_max": rss_decode, "rss_peak_hwm": status["VmHWM"],
            "summaries_bytes": summaries,
        },
    }
    m = res["memory"]
    m["overhead_decode"] = rss_decode - model_bytes - budgets
    m["overhead_peak"] = status["VmHWM"] - model_bytes - budgets
    m["overhead_rest_decode"] = m["overhead_decode"] - rss_runtime - summaries
    if prof is not None:
        res["profile"] = profile_text(prof, by_cumulative=45)
        (RESULTS / f"sparse_decode_profile_{args.config}.txt").write_text(
            f"cProfile of {n} decode steps, {args.config}, {args.requests} x ~{args.context} "
            f"tokens, {args.decode_threads} torch thread(s); "
            f"{1e3 * sum(step_s) / n:.0f} ms/step under the profiler\n" + res["profile"])
    return res


# ------------------------------------------------------------------------------ driver
def mib(b) -> str:
    return f"{b / 2**20:.0f}"


def print_table(results: list[dict]) -> None:
    dense = next((r for r in results if r["config"] == "dense"), None)
    print(f"\n{'config':<24}{'tok/s':>7}{'x dense':>8}{'ms/step':>8}{'med ms':>7}"
          f"{'host->dev':>11}{'disk->dev':>11}{'dev->host':>11}{'dev hit':>8}"
          f"{'RSS dec':>8}{'RSS pk':>8}{'budgets':>8}{'ovh':>6}")
    print(f"{'':<24}{'':>7}{'':>8}{'':>8}{'':>7}{'MiB/step':>11}{'MiB/step':>11}{'MiB/step':>11}"
          f"{'':>8}{'MiB':>8}{'MiB':>8}{'+model':>8}{'MiB':>6}")
    for r in results:
        b = r["per_step_bytes"]
        m = r["memory"]
        ratio = r["decode_tok_s"] / dense["decode_tok_s"] if dense else float("nan")
        hit = r["device_hit_ratio"]
        print(f"{r['config']:<24}{r['decode_tok_s']:>7.2f}{ratio:>8.2f}"
              f"{1e3 * r['decode_s'] / r['steps']:>8.0f}{r['step_ms_median']:>7.0f}"
              f"{b.get('host->device', 0) / 2**20:>11.1f}{b.get('disk->device', 0) / 2**20:>11.1f}"
              f"{b.get('device->host', 0) / 2**20:>11.1f}"
              f"{(hit if hit is not None else float('nan')):>8.3f}"
              f"{mib(m['rss_decode_max']):>8}{mib(m['rss_peak_hwm']):>8}"
              f"{mib(m['model_bytes'] + m['budget_bytes']):>8}{mib(m['overhead_decode']):>6}")


def print_memory(r: dict) -> None:
    m = r["memory"]
    print(f"\nmemory, {r['config']} (MiB): model {mib(m['model_bytes'])} + device "
          f"{mib(r['kv_device_gb'] * GiB)} + host {mib(r['kv_host_gb'] * GiB)} = "
          f"{mib(m['model_bytes'] + m['budget_bytes'])}; RSS during decode "
          f"{mib(m['rss_decode_max'])} (peak VmHWM {mib(m['rss_peak_hwm'])}); overhead "
          f"{mib(m['overhead_decode'])} (peak {mib(m['overhead_peak'])}) = runtime before engine "
          f"{mib(m['rss_runtime'])} + page summaries {mib(m['summaries_bytes'])} + rest "
          f"{mib(m['overhead_rest_decode'])}")


def plot(results: list[dict], path: Path, title: str) -> None:
    names = [r["config"] for r in results]
    tps = [r["decode_tok_s"] for r in results]
    fig, ax = pyplot().subplots(figsize=(8, 4))
    colors = ["tab:gray" if n == "dense" else "tab:blue" for n in names]
    bars = ax.bar(range(len(names)), tps, color=colors)
    dense = next((r["decode_tok_s"] for r in results if r["config"] == "dense"), None)
    if dense:
        ax.axhline(2 * dense, ls="--", color="tab:red", label="2x dense (target)")
        ax.legend(fontsize=8)
    for b, r in zip(bars, results):
        hit = r["device_hit_ratio"]
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(),
                f"{r['decode_tok_s']:.1f}" + (f"\nhit {hit:.2f}" if hit is not None else ""),
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("decode tokens/s (8 requests)")
    ax.set_ylim(0, 1.2 * max(tps + [2 * dense if dense else 0]))
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def plot_title(rep: dict) -> str:
    return (f"SmolLM2-135M bf16, {rep['requests']} x ~{rep['context']} tokens, "
            f"{rep['steps']} decode steps, {rep['decode_threads']} torch thread(s), CPU")


def driver(args) -> None:
    names = args.configs or (QUICK if args.quick else list(CONFIGS))
    RESULTS.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        out = RESULTS / f".sparse_decode_{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--config", name,
               "--steps", str(args.steps), "--threads", str(args.threads),
               "--decode-threads", str(args.decode_threads),
               "--requests", str(args.requests), "--context", str(args.context),
               "--prefill-tokens", str(args.prefill_tokens), "--kv-disk-path", args.kv_disk_path,
               "--out", str(out)] + (["--malloc-trim"] if args.malloc_trim else [])
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        if rc != 0:
            print(f"   {name} failed (rc {rc})")
            continue
        r = read_json(out)
        out.unlink()
        print(f"   {name}: {r['decode_tok_s']:.2f} tok/s, prefill {r['prefill_s']:.0f} s, "
              f"wall {time.perf_counter() - t0:.0f} s", flush=True)
        results.append(r)
    if not results:
        return
    print_table(results)
    mem = next((r for r in results if r["config"] == MEMORY_CONFIG), None)
    if mem:
        print_memory(mem)
    rep = {"prefill_threads": args.threads, "decode_threads": args.decode_threads,
           "steps": args.steps, "requests": args.requests, "context": args.context,
           "results": results}
    path = write_json(result_path(args.out, "sparse_decode", args.quick), rep)
    png = path.with_suffix(".png")
    plot(results, png, plot_title(rep))
    print(f"\nwrote {path} and {png}")
    shutil.rmtree(Path(args.kv_disk_path), ignore_errors=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", choices=list(CONFIGS), help="worker mode: run one config")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="driver: these configs")
    ap.add_argument("--quick", action="store_true", help=f"configs {QUICK}, 16 steps")
    ap.add_argument("--steps", type=int, default=None, help="decode steps timed (default 64)")
    add_thread_args(ap)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=7000, help="prompt tokens per request")
    ap.add_argument("--prefill-tokens", type=int, default=8192,
                    help="--max-num-batched-tokens (a prompt per prefill step)")
    ap.add_argument("--kv-disk-path", default=str(KV_TMP))
    ap.add_argument("--profile", type=int, default=0,
                    help="worker: cProfile this many decode steps instead of --steps")
    ap.add_argument("--malloc-trim", action="store_true",
                    help="call glibc malloc_trim(0) after prefill (diagnoses allocator retention)")
    add_replot_arg(ap, "plot (and tables)")
    add_out_arg(ap, "sparse_decode", quick=True)
    args = ap.parse_args()
    if args.replot:
        rep = read_json(args.replot)
        print_table(rep["results"])
        mem = next((r for r in rep["results"] if r["config"] == MEMORY_CONFIG), None)
        if mem:
            print_memory(mem)
        plot(rep["results"], Path(args.replot).with_suffix(".png"), plot_title(rep))
        return
    if args.steps is None:
        args.steps = 16 if args.quick else 64
    if args.config is None:
        driver(args)
        return
    res = worker(args)
    if args.out:
        write_json(args.out, res, indent=None)
    else:
        if "profile" in res:
            print(res.pop("profile"))
        print(print_table([res]) or "", end="")
        print_memory(res)
        res.pop("step_ms")
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
