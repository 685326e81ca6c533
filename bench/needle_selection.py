"""Does sparse decode select the needle's page? Per decode step, layer and KV head (diagnostic).

    .venv/bin/python bench/needle_selection.py --length 4000 --depth 0.3 --index 0 --budget 1024

Builds the same prompt as bench/needle.py (format passcode_noprefix), prefills it in one step
with a sparse budget, then decodes greedily; at every sparse decode step it records, for every
sparse layer and KV head, whether the page(s) holding the needle's digits are selected and the
rank of their selector score among the sequence's pages (0 = best; sink and local pages are
forced in on top). Prints the generated tokens with, per step, how many (layer, head) rows kept
the needle page, and the layers that dropped it. Monkeypatches the step's selection (bench only).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (RESULTS, add_thread_args, essay_ids, parser,  # noqa: E402
                          use_checkout_cache, write_json)
from bench.needle_prompts import DEFAULT_FORMAT, build_prompt  # noqa: E402
from engine.args import EngineArgs  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from kvstore import step as step_mod  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from server.tokenizer import Tokenizer  # noqa: E402

use_checkout_cache()


def needle_positions(tok: Tokenizer, ids: list[int], value: str) -> list[int]:
    """Token positions whose text makes up `value` in the prompt (binary searches)."""
    has = lambda lo, hi: value in tok.decode(ids[lo:hi])           # noqa: E731
    if not has(0, len(ids)):
        raise ValueError("needle not found in prompt")
    lo, hi = 1, len(ids)                     # smallest end e with value in ids[:e]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if has(0, mid) else (mid + 1, hi)
    end = lo
    lo, hi = 0, end - 1                      # largest start j with value in ids[j:end]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if has(mid, end) else (lo, mid - 1)
    return list(range(lo, end))


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--depth", type=float, default=0.3)
    ap.add_argument("--index", type=int, default=0, help="needle value index (as bench/needle.py)")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--head-pages", default="per-head")
    ap.add_argument("--selector", default="quest")
    ap.add_argument("--prior-share", type=float, default=EngineArgs.sparse_prior_share)
    ap.add_argument("--max-tokens", type=int, default=16)
    add_thread_args(ap, decode_threads=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineArgs(max_model_len=8192, max_num_seqs=1,
                                  max_num_batched_tokens=8192, kv_device_gb=0.3,
                                  sparse_budget=args.budget, sparse_threshold=1,
                                  sparse_head_pages=args.head_pages,
                                  selector=args.selector,
                                  sparse_prior_share=args.prior_share,
                                  threads=args.threads))
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_folder(engine.model_folder)
    essay = essay_ids(tok)
    rng = random.Random(f"{args.seed}-{args.length}-{args.depth}-{args.index}")
    value = str(rng.randrange(10000, 100000))
    offset = args.index * 37_003 + int(args.depth * 10_007)
    ids = build_prompt(tok, essay, DEFAULT_FORMAT, args.length, args.depth, value, offset)
    pos = needle_positions(tok, ids, value)
    ps = engine.args.page_size
    pages = sorted({p // ps for p in pos})
    print(f"prompt {len(ids)} tokens; needle {value} at tokens {pos[0]}-{pos[-1]} "
          f"(pages {pages} of {-(-len(ids) // ps)})")

    store = engine.store
    records: list[dict] = []
    orig_score = store.selection.selector.score
    captured = {}

    def score(q, summaries, num_pages, group):
        s = orig_score(q, summaries, num_pages, group)
        captured["scores"] = s
        return s

    store.selection.selector.score = score
    store.selection.selector.native = False          # the torch path, which calls `score`
    orig_select = step_mod.StepKV.select

    def select(self, layer, qd, idx, observe=True):
        sel = orig_select(self, layer, qd, idx, observe)
        if not observe:                    # a layer-ahead prediction, not the exact selection
            return sel
        s = captured["scores"][0]                                    # [KVH, P]
        kvh = s.shape[0]
        n = s.shape[1]
        prior = store.request("r").prior
        row = {"layer": layer, "kept": [], "rank": [], "prior_rank": []}
        for h in range(kvh):
            chosen = set(sel.row(0, h).tolist())
            row["kept"].append(any(p in chosen for p in pages))
            order = torch.argsort(s[h], descending=True).tolist()
            row["rank"].append(min(order.index(p) for p in pages))
            if prior is not None:
                porder = torch.argsort(prior[layer, :n, h], descending=True).tolist()
                row["prior_rank"].append(min(porder.index(p) for p in pages))
        records[-1]["layers"].append(row)
        return sel

    step_mod.StepKV.select = select
    engine.add_request("r", ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    out: list[int] = []
    while engine.has_unfinished():
        records.append({"layers": []})
        for o in engine.step():
            out.extend(o.new_token_ids)
        records[-1]["token"] = out[-1] if out else None
    print(f"output: {tok.decode(out)!r}  correct: {value in tok.decode(out).replace(' ', '')}")
    budget_pages = -(-args.budget // ps)
    print(f"budget {budget_pages} pages per (layer, head); per step: token, (layer, head) rows "
          f"keeping the needle page / sparse rows, layers where some head dropped it "
          f"(layer:best rank of the needle page among the dropping heads)")
    for r in records:
        if not r["layers"]:
            print(f"  {tok.token_text(r['token'])!r:>10}  (prefill, dense)")
            continue
        n = sum(sum(x["kept"]) for x in r["layers"])
        tot = sum(len(x["kept"]) for x in r["layers"])
        dropped = [f"{x['layer']}:{min(rk for k, rk in zip(x['kept'], x['rank']) if not k)}"
                   for x in r["layers"] if not all(x["kept"])]
        prior = [x["prior_rank"][h] for x in r["layers"] for h in range(len(x["kept"]))
                 if x["prior_rank"]]
        pr = (f"; prior rank of the needle page median {sorted(prior)[len(prior) // 2]}, "
              f"<{store.cfg.prior_pages} in {sum(p < store.cfg.prior_pages for p in prior)}"
              if prior else "")
        print(f"  {tok.token_text(r['token'])!r:>10}  {n:>3}/{tot}{pr}  dropped in "
              f"{' '.join(dropped) if dropped else '-'}")
    name = f"needle_selection_{args.length}_d{args.depth}_{args.index}_{args.selector}.json"
    write_json(RESULTS / name, {"args": vars(args), "value": value, "needle_pages": pages,
                                "output": tok.decode(out), "steps": records}, indent=None)


if __name__ == "__main__":
    main()
