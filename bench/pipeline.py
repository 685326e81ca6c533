"""Decode step time per pipeline mode (--pipeline sequential | sfc | layer-ahead) with the KV
mostly off the device: 8 requests of ~7K tokens, --kv-device-gb 0.064 --kv-host-gb 0.256, the
rest on disk, sparse budget 1024.

    .venv/bin/python bench/pipeline.py                 # 4 rounds x 8 steps per mode
    .venv/bin/python bench/pipeline.py --quick         # 4 requests x ~4K tokens, 2 rounds x 4 steps
    .venv/bin/python bench/pipeline.py --replot bench/results/pipeline.json

One process, one prefill: the modes are then timed in alternating rounds on the same requests
(round r runs --warmup untimed, then --steps timed decode steps of each mode in turn; the
store's pipeline object is swapped between them), so the noise of this shared 2-core box hits
every mode alike. Before the rounds, SFC runs without --micro-batch and calibrates it
(candidates 1, 2, 4, 8 sequences); the rounds use the calibrated size (and --micro-batch values
given with --micro-batches).
`sequential-lru` is sequential with --residency lru (the others run the default policy).
`sfc-whole` is sfc with KVDrive's whole-batch compute (attention once every fetch of the layer
is in) instead of each micro-batch's attention as soon as its own fetch is in; `sfc-ahead2`
fetches the last step's pages two layers ahead instead of one, `sfc-no-ahead` not at all.
Reported per mode: median decode step time, overlap ratio 1 - step(mode) / step(sequential),
busy and stall seconds per stage per step, bytes per tier per step, device hit ratio; and the
recall of what was fetched ahead (exact-selected pages the layer-ahead prediction, or sfc's
reuse of the last step's pages, had already fetched). Also the share of the sequential step
spent resolving and fetching (the issue's target, sfc >= 1.3x sequential, applies when that
share is a third or more), and, in the same rounds, sequential and sfc at other budgets
(--budgets; each pair in both orders), where that share differs. Decode runs on 1 torch
thread; the stage threads use the second core. Results: bench/results/pipeline.json and .png.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (KV_TMP, RESULTS, add_out_arg, add_replot_arg,  # noqa: E402
                          add_thread_args, code_version, counter_delta, essay_prompts, parser,
                          profile_text, pyplot, read_json, result_path, save_figure,
                          use_checkout_cache, write_json)
from bench.engine_steps import EngineSteps  # noqa: E402

use_checkout_cache()
STAGES = ("select", "resolve", "fetch", "compute")


def run(args) -> dict:
    import torch
    torch.set_num_threads(args.threads)
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from kvstore.calibration import CALIBRATION_CANDIDATES, CALIBRATION_STEPS
    from scheduler.sampling_params import SamplingParams
    from server.tokenizer import Tokenizer
    from tqdm import tqdm

    disk_path = Path(args.kv_disk_path) / "pipeline"
    shutil.rmtree(disk_path, ignore_errors=True)
    disk_path.mkdir(parents=True)
    # sfc-whole: KVDrive's rule, attention once every fetch of the layer is in (the default
    # sfc computes each micro-batch's attention as soon as its own fetch is in)
    modes = [("sequential", 0), ("sequential-lru", 0), ("sfc", None), ("sfc-ahead2", None),
             ("sfc-no-ahead", None), ("sfc-whole", None), ("layer-ahead", 0)]
    modes += [("sfc", mb) for mb in args.micro_batches]
    if args.with_resolve_thread:
        modes.append(("sfc-3threads", None))
    # the budget sweep: sequential and sfc at other sparse budgets (decode only: one prefill)
    sweep = [b for b in args.budgets if b != args.budget]
    calib_steps = (len(CALIBRATION_CANDIDATES) + 1) * CALIBRATION_STEPS
    total_steps = (calib_steps + args.rounds * (args.steps + args.warmup)
                   * (len(modes) + 2 * len(sweep)) + args.requests + 8)
    eargs = EngineArgs(max_model_len=8192, max_num_seqs=args.requests,
                       max_num_batched_tokens=args.prefill_tokens, kv_device_gb=args.device_gb,
                       kv_host_gb=args.host_gb, kv_disk_gb=4.0, kv_disk_path=disk_path,
                       sparse_budget=args.budget, sparse_threshold=1, threads=args.threads,
                       pipeline="sfc",
                       micro_batch=0)
    try:
        engine = LLMEngine(eargs)
        store = engine.store
        tok = Tokenizer.from_folder(engine.model_folder)
        prompts = essay_prompts(tok, args.requests, args.context)
        params = SamplingParams(max_tokens=total_steps, temperature=0.0, ignore_eos=True)
        rids = [f"r{i}" for i in range(len(prompts))]
        driver = EngineSteps(engine, raise_errors=True)  # a failed request fails the bench
        step = driver.step

        t0 = time.perf_counter()
        driver.prefill_one_by_one(dict(zip(rids, prompts)), params, "prefill")
        prefill_s = time.perf_counter() - t0
        torch.set_num_threads(args.decode_threads)
        # calibration of the SFC micro-batch (the engine was built with --micro-batch 0)
        for _ in tqdm(range(calib_steps), desc="sfc calibration", leave=False):
            step()
        calibrated = store.pipeline.micro_batch
        if not calibrated:
            raise RuntimeError("the SFC calibration did not finish in the calibration steps")
        modes = [(m, calibrated if mb is None else mb, args.budget) for m, mb in modes]
        sweep_pairs = [[("sequential", 0, b), ("sfc", calibrated, b)] for b in sweep]
        key = {(m, mb, b): m + (f"-mb{mb}" if m.startswith("sfc") else "")
               if b == args.budget else f"{m}@{b}" for m, mb, b in modes + sum(sweep_pairs, [])}
        per_mode = {k: {"mode": m, "micro_batch": mb, "budget": b, "step_s": [], "stats": []}
                    for (m, mb, b), k in key.items()}
        if args.profile:
            import cProfile
            m = args.profile
            store.use_pipeline(m, calibrated if m == "sfc" else 0)
            step()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(args.steps):
                step()
            prof.disable()
            ms = 1e3 * (time.perf_counter() - t0) / args.steps
            (RESULTS / f"pipeline_profile_{m}.txt").write_text(
                f"cProfile of {args.steps} decode steps, --pipeline {m}, {args.requests} x "
                f"~{args.context} tokens; {ms:.0f} ms/step under the profiler (engine thread "
                f"only; stage threads are not profiled)\n" + profile_text(prof))
            print(f"wrote {RESULTS / f'pipeline_profile_{m}.txt'}")
            return None
        bar = tqdm(total=args.rounds * (len(modes) + 2 * len(sweep)) * args.steps,
                   desc="rounds", leave=False)
        for r in range(args.rounds):
            # each pair of the sweep in both orders over the rounds (the first mode after a
            # switch pays while the tiers settle)
            runs = modes + sum((p[::-1] if r % 2 else p for p in sweep_pairs), [])
            for m, mb, b in runs:
                rec = per_mode[key[m, mb, b]]
                set_budget(store, b)
                store.tiers.use_residency("lru" if m == "sequential-lru" else eargs.residency)
                store.use_pipeline("sfc" if m.startswith("sfc") else m.removesuffix("-lru"), mb,
                                   resolve_thread=m == "sfc-3threads",
                                   whole_batch_compute=m == "sfc-whole",
                                   reuse_ahead={"sfc-no-ahead": 0, "sfc-ahead2": 2}.get(m, 1))
                for _ in range(args.warmup):        # the tiers settle to the mode: not timed
                    step()
                before = store.stats.snapshot()
                for _ in range(args.steps):
                    ts = time.perf_counter()
                    outs = step()
                    rec["step_s"].append(time.perf_counter() - ts)
                    if len(outs) != len(rids) or any(o.finished for o in outs):
                        raise RuntimeError("a request finished or was preempted mid-benchmark")
                    bar.update(1)
                rec["stats"].append((before, store.stats.snapshot()))
        bar.close()
        for rid in rids:
            engine.abort(rid)
    finally:
        shutil.rmtree(disk_path, ignore_errors=True)

    def delta(pairs, field):                  # summed over the rounds
        out: dict = {}
        for a, b in pairs:
            for k, v in counter_delta(getattr(a, field), getattr(b, field)).items():
                out[k] = out.get(k, 0) + v
        return out

    results = {}
    for name, rec in per_mode.items():
        n = len(rec["step_s"])
        pairs = rec["stats"]
        busy, stall = delta(pairs, "stage_busy"), delta(pairs, "stage_stall")
        xfer = delta(pairs, "transfer_bytes")
        lookups, hits = delta(pairs, "lookups"), delta(pairs, "hits")
        la_hits = sum(b.lookahead_hits - a.lookahead_hits for a, b in pairs)
        la_exact = sum(b.lookahead_exact - a.lookahead_exact for a, b in pairs)
        results[name] = {
            **{k: rec[k] for k in ("mode", "micro_batch", "budget")}, "steps": n,
            "step_ms": [1e3 * s for s in rec["step_s"]],
            "step_ms_median": 1e3 * statistics.median(rec["step_s"]),
            "decode_tok_s": args.requests * n / sum(rec["step_s"]),
            "busy_ms_per_step": {s: 1e3 * busy.get(s, 0) / n for s in STAGES},
            "stall_ms_per_step": {s: 1e3 * stall.get(s, 0) / n for s in STAGES},
            "bytes_per_step": {f"{s}->{d}": v / n for (s, d), v in xfer.items()},
            "device_hit_ratio": hits.get("device", 0) / lookups["device"]
            if lookups.get("device") else None,
            "lookahead_recall": la_hits / la_exact if la_exact else None,
        }
    def share(seq: dict) -> float:     # of a sequential step, resolving and fetching
        return (seq["busy_ms_per_step"]["resolve"] + seq["busy_ms_per_step"]["fetch"]) \
            / seq["step_ms_median"]

    for r in results.values():   # against sequential at the same budget
        seq = results[key["sequential", 0, r["budget"]]]
        r["overlap_ratio"] = 1 - r["step_ms_median"] / seq["step_ms_median"]
        r["speedup_vs_sequential"] = seq["step_ms_median"] / r["step_ms_median"]
        r["sequential_fetch_share"] = share(seq)
    fetch_share = share(results["sequential"])
    return {"code": code_version(), "requests": args.requests,
            "prompt_tokens": [len(p) for p in prompts], "sparse_budget": args.budget,
            "kv_device_gb": args.device_gb, "kv_host_gb": args.host_gb,
            "decode_threads": args.decode_threads, "prefill_s": prefill_s,
            "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup,
            "calibrated_micro_batch": calibrated,
            "sequential_fetch_share": fetch_share, "modes": results}


def set_budget(store, budget: int) -> None:
    """Swap the store's --sparse-budget (read at each decode step; prefill is dense)."""
    store.reconfigure(sparse_budget=budget)


def print_table(res: dict) -> None:
    print(f"\n{res['requests']} requests x ~{statistics.mean(res['prompt_tokens']):.0f} tokens, "
          f"device {res['kv_device_gb']} GB, host {res['kv_host_gb']} GB, rest on disk; "
          f"budget {res['sparse_budget']}; calibrated micro-batch "
          f"{res['calibrated_micro_batch']}; sequential step resolving+fetching: "
          f"{100 * res['sequential_fetch_share']:.0f}%")
    hdr = (f"{'mode':<16}{'ms/step':>8}{'x seq':>7}{'overlap':>8}{'tok/s':>7}"
           + "".join(f"{s[:7]:>8}" for s in STAGES) + "".join(f"{'st ' + s[:4]:>8}" for s in STAGES)
           + f"{'host MB':>8}{'disk MB':>8}{'dev hit':>8}{'recall':>7}")
    print(hdr)
    for name, r in res["modes"].items():
        if "@" in name:
            continue
        b = r["bytes_per_step"]
        rec = r["lookahead_recall"]
        print(f"{name:<16}{r['step_ms_median']:>8.0f}{r['speedup_vs_sequential']:>7.2f}"
              f"{r['overlap_ratio']:>8.2f}{r['decode_tok_s']:>7.2f}"
              + "".join(f"{r['busy_ms_per_step'][s]:>8.0f}" for s in STAGES)
              + "".join(f"{r['stall_ms_per_step'][s]:>8.0f}" for s in STAGES)
              + f"{b.get('host->device', 0) / 1e6:>8.1f}{b.get('disk->device', 0) / 1e6:>8.1f}"
              f"{(r['device_hit_ratio'] or 0):>8.3f}"
              + (f"{rec:>7.2f}" if rec is not None else f"{'-':>7}"))
    print("(stage columns: busy ms per step; 'st' columns: stall ms per step)")
    sweep = budget_sweep(res)
    if len(sweep) > 1:
        print(f"\n{'budget':>7}{'fetch %':>9}{'seq ms':>8}{'sfc ms':>8}{'x seq':>7}"
              f"{'sfc stall':>10}{'seq disk MB':>12}{'sfc disk MB':>12}")
        for b, (seq, sfc) in sweep.items():
            print(f"{b:>7}{100 * seq['sequential_fetch_share']:>9.0f}{seq['step_ms_median']:>8.0f}"
                  f"{sfc['step_ms_median']:>8.0f}{sfc['speedup_vs_sequential']:>7.2f}"
                  f"{sum(sfc['stall_ms_per_step'].values()):>10.0f}"
                  + "".join(f"{r['bytes_per_step'].get('disk->device', 0) / 1e6:>12.1f}"
                            for r in (seq, sfc)))
        print("(sequential and sfc at each sparse budget, same requests and tiers)")


def budget_sweep(res: dict) -> dict:
    """budget -> (sequential's result, sfc's at the calibrated micro-batch), ascending."""
    main, mb = res["sparse_budget"], res["calibrated_micro_batch"]
    out = {main: (res["modes"]["sequential"], res["modes"][f"sfc-mb{mb}"])}
    for name, r in res["modes"].items():
        if name.startswith("sequential@"):
            out[r["budget"]] = (r, res["modes"][f"sfc@{r['budget']}"])
    return dict(sorted(out.items()))


def plot(res: dict, path: Path) -> None:
    names = [n for n in res["modes"] if "@" not in n]
    sweep = budget_sweep(res)
    fig, axes = pyplot().subplots(1, 3 if len(sweep) > 1 else 2,
                             figsize=(16 if len(sweep) > 1 else 11, 4))
    ax, ax2 = axes[:2]
    steps = [res["modes"][n]["step_ms_median"] for n in names]
    bars = ax.bar(range(len(names)), steps, color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
    for b, n in zip(bars, names):
        r = res["modes"][n]
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(),
                f"{r['step_ms_median']:.0f} ms\n{r['speedup_vs_sequential']:.2f}x",
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set(ylabel="decode step, median (ms)", ylim=(0, 1.25 * max(steps)))
    ax.set_title("step time per pipeline mode", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    bottom = [0.0] * len(names)
    colors = {"select": "tab:orange", "resolve": "tab:purple", "fetch": "tab:red",
              "compute": "tab:green"}
    for s in STAGES:
        vals = [res["modes"][n]["busy_ms_per_step"][s] for n in names]
        ax2.bar(range(len(names)), vals, bottom=bottom, color=colors[s], label=f"{s} busy")
        bottom = [a + b for a, b in zip(bottom, vals)]
    stall = [sum(res["modes"][n]["stall_ms_per_step"].values()) for n in names]
    ax2.bar(range(len(names)), stall, bottom=bottom, color="lightgray", hatch="//",
            label="stall (all stages)")
    ax2.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax2.set_ylabel("ms per step (stage threads overlap)")
    ax2.set_title("time per stage (busy, stacked) and stall", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(axis="y", alpha=0.3)
    if len(sweep) > 1:
        ax3, budgets = axes[2], list(sweep)
        for i, label, color in ((0, "sequential", "tab:gray"), (1, "sfc", "tab:blue")):
            ax3.plot(range(len(budgets)), [sweep[b][i]["step_ms_median"] for b in budgets],
                     "o-", color=color, label=label)
        top = 1.15 * max(max(r["step_ms_median"] for r in sweep[b]) for b in budgets)
        for k, b in enumerate(budgets):
            seq, sfc = sweep[b]
            ax3.text(k, 0.03 * top, f"sfc {sfc['speedup_vs_sequential']:.2f}x\nfetch "
                     f"{100 * seq['sequential_fetch_share']:.0f}%", ha="center", fontsize=7)
        ax3.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax3.set(xlabel="--sparse-budget (tokens per request, layer and KV head)",
                ylabel="decode step, median (ms)", ylim=(0, top))
        ax3.set_title("sfc against sequential per budget (fetch: share of the sequential "
                      "step)", fontsize=9)
        ax3.legend(fontsize=7)
        ax3.grid(alpha=0.3)
    fig.suptitle(f"{res['requests']} x ~{statistics.mean(res['prompt_tokens']):.0f} tokens, "
                 f"KV device {res['kv_device_gb']} GB / host {res['kv_host_gb']} GB / disk, "
                 f"budget {res['sparse_budget']}", fontsize=9)
    save_figure(fig, path)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--budget", type=int, default=1024, help="sparse budget of every mode")
    ap.add_argument("--budgets", type=int, nargs="*", default=[512, 768, 1536, 2048],
                    help="other sparse budgets at which sequential and sfc are timed too")
    ap.add_argument("--device-gb", type=float, default=0.064)
    ap.add_argument("--host-gb", type=float, default=0.256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per mode and round")
    ap.add_argument("--warmup", type=int, default=4,
                    help="untimed decode steps per mode and round, first (the tiers settle to "
                         "the mode: with 2, sfc's first 2 timed steps ran 3-7%% slower)")
    ap.add_argument("--micro-batches", type=int, nargs="*", default=[],
                    help="extra fixed SFC micro-batch sizes to time")
    add_thread_args(ap)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--kv-disk-path", default=str(KV_TMP))
    ap.add_argument("--with-resolve-thread", action="store_true",
                    help="also time SFC with resolution on its own thread (3 stage threads)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (GIL hand-off, default 0.005 s)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", choices=("sequential", "sfc", "layer-ahead"), default=None,
                    help="instead of the rounds: cProfile --steps steps of this mode")
    add_out_arg(ap, "pipeline", quick=True)
    add_replot_arg(ap, "plot (and tables)")
    args = ap.parse_args()
    if args.replot:
        res = read_json(args.replot)
        print_table(res)
        plot(res, Path(args.replot).with_suffix(".png"))
        return
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.quick:
        args.requests, args.context, args.rounds, args.steps = 4, 4000, 2, 4
    out = result_path(args.out, "pipeline", args.quick)
    res = run(args)
    if res is None:
        return
    write_json(out, res)
    print_table(res)
    plot(res, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
