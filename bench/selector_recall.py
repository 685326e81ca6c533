"""Recall of each page selector against the pages that really get the attention, its index
bytes and its selection time: `quest`, `mean`, `lowrank` (--lowrank-rank r) and `centroid`
(--centroid-pages) side by side.

    .venv/bin/python bench/selector_recall.py              # needle ~4K/~7K + RULER ~4K/~7K
    .venv/bin/python bench/selector_recall.py --quick      # fewer prompts, ~4K only
    .venv/bin/python bench/selector_recall.py --replot bench/results/selector_recall.json

Prompts: bench/needle.py's (the passcode at depths 0.1-0.9) and bench/ruler.py's (niah_single,
niah_multikey, niah_multivalue, vt). Each prompt is prefilled and then decoded greedily for
`--steps` tokens by the bundled model over a dense in-memory cache (this script's seam: every
key is kept, nothing is selected). At each decode step, in each layer past --dense-layers and
each KV head, the true attention of the step's query to each page (its softmax mass summed over
the page's tokens, the largest over the heads of the GQA group, as the selectors combine them)
ranks the pages; the sink and local pages (always attended) are set aside, and each selector's
top k pages (k = the budget's pages less those) are compared with the true top k: page recall
(the share of the true top k it picked) and mass recall (the attention its k pages hold over
what the true k hold). The selectors score through the serving code (kernels/page_summary.py's
summaries, kernels/page_select.py's scores, kvstore/centroids.py's index, built at each step over
the pages outside the local window); lowrank's projection is the one serving uses
(calibrated on the bundled essays if absent). Index bytes: what a selector keeps per page and
KV head to rank pages (Quest's min and max rows, the mean row, the projected min and max in
bf16; centroid: the index's bf16 centroids and int32 labels, measured on the prompts),
per token against its K and V in bf16. Selection time: the select call of a layer for 8
sequences of ~7K tokens (random summaries), per selector, interleaved: C for quest, mean and
lowrank, the serving path of kvstore/selection.py for centroid (its index built before), and
quest with a budget per KV head (`quest-per-head`: --sparse-budget-plan's torch path).
Results: bench/results/selector_recall.json and .png.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvstore.lowrank import causal_attention  # noqa: E402
from bench.common import (add_out_arg, add_replot_arg, code_version, cpu_line,  # noqa: E402
                          essay_ids, machine, parser, pyplot, replot_or_run, save_figure)

SELECTORS = ("quest", "mean", "lowrank", "centroid")


class _DenseSeam:
    """The model's KV seam over a dense per-layer cache of one sequence; records each decode
    query and the keys it saw."""

    def __init__(self, layers: int):
        self.k = [None] * layers
        self.v = [None] * layers
        self.queries: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def attend(self, layer, q, k, v, scale):
        prefill = self.k[layer] is None
        self.k[layer] = k if prefill else torch.cat([self.k[layer], k])
        self.v[layer] = v if prefill else torch.cat([self.v[layer], v])
        if not prefill:
            self.queries[layer].append(q[0].float())
        return causal_attention(q, self.k[layer], self.v[layer], scale, causal=prefill)


def decode_queries(model, ids: list[int], steps: int) -> _DenseSeam:
    seam = _DenseSeam(model.config.num_hidden_layers)
    x = torch.tensor(ids)
    logits = model(x, torch.arange(len(ids)), seam, torch.tensor([len(ids) - 1]))
    pos = len(ids)
    for _ in range(steps):
        tok = logits.argmax(-1)
        logits = model(tok, torch.tensor([pos]), seam, torch.tensor([0]))
        pos += 1
    return seam


def page_recall(seam: _DenseSeam, proj, cfg, args, index_bytes: list[float]
                ) -> dict[str, list[tuple[float, float]]]:
    """Per selector: (page recall, mass recall) of every (step, layer, KV head); appends the
    centroid index's bytes per indexed page and KV head of each (step, layer) to
    index_bytes."""
    from kernels.page_select import mean_scores, quest_scores
    from kernels.page_summary import summarize_pages
    from kvstore.centroids import CentroidIndex
    ps, kvh, group = args.page_size, cfg.num_key_value_heads, \
        cfg.num_attention_heads // cfg.num_key_value_heads
    out = {s: [] for s in SELECTORS}
    for layer in range(args.dense_layers, cfg.num_hidden_layers):
        k_all = seam.k[layer]                                           # [N, KVH, D]
        for step, q in enumerate(seam.queries[layer]):
            n = k_all.shape[0] - len(seam.queries[layer]) + step + 1    # keys this query saw
            pages = -(-n // ps)
            k = torch.zeros(pages * ps, kvh, k_all.shape[-1], dtype=k_all.dtype)
            k[:n] = k_all[:n]
            kp = k.view(pages, ps, kvh, -1).transpose(1, 2)             # [P, KVH, ps, D]
            valid = [ps] * (pages - 1) + [n - (pages - 1) * ps]
            # the true attention: per query head over the n keys, per page, max over a group
            logits = torch.einsum("hd,nhd->hn", q, k[:n].float().repeat_interleave(group, 1))
            w = torch.softmax(logits * cfg.head_dim ** -0.5, -1)        # [H, n]
            mass = torch.zeros(q.shape[0], pages * ps)
            mass[:, :n] = w
            mass = mass.view(kvh, group, pages, ps).sum(-1).amax(1)     # [KVH, P]
            free = torch.arange(pages)
            free = free[(free >= args.sink_pages) & (free < pages - args.local_pages)]
            kk = args.budget // ps - args.sink_pages - args.local_pages
            if kk <= 0 or free.numel() <= kk:
                continue
            true_top = mass[:, free].topk(kk, -1).indices                # [KVH, kk]
            best = mass[:, free].gather(1, true_top).sum(-1)
            summ = summarize_pages(kp, valid)
            summ_lr = summarize_pages(proj.keys(layer, kp), valid)
            qb = q[None]
            index = CentroidIndex(pages)
            indexed = pages - args.local_pages
            index.update(layer, summ, indexed, args.centroid_pages)
            index_bytes.append(index.nbytes(layer) / (indexed * kvh))
            scores = {"quest": quest_scores(qb, [summ], [pages], group)[0],
                      "mean": mean_scores(qb, [summ], [pages], group)[0],
                      "lowrank": quest_scores(proj.queries(layer, qb, group), [summ_lr],
                                              [pages], group)[0],
                      "centroid": index.page_keys(layer, q.view(kvh, group, -1), pages)}
            for name, sc in scores.items():
                top = sc[:, free].topk(kk, -1).indices
                hits = [len(set(a.tolist()) & set(b.tolist())) / kk
                        for a, b in zip(top, true_top)]
                got = mass[:, free].gather(1, top).sum(-1) / best.clamp_min(1e-30)
                out[name] += list(zip(hits, got.tolist()))
    return out


def select_time(proj, cfg, args, reps: int = 30) -> dict[str, float]:
    """ms per layer of the select call for 8 sequences of ~7K tokens, per selector."""
    from kernels.page_select import make_selector
    from kvstore.centroids import CentroidIndex
    from kvstore.config import KVStoreConfig
    from kvstore.selection import PageSelection
    from kvstore.stats import KVStats
    g = torch.Generator().manual_seed(0)
    pages, kvh, d = 438, cfg.num_key_value_heads, cfg.head_dim
    group = cfg.num_attention_heads // kvh
    q = torch.randn(8, cfg.num_attention_heads, d, generator=g)
    full = [torch.randn(pages, kvh, 3, d, generator=g).to(torch.bfloat16) for _ in range(8)]
    low = [torch.randn(pages, kvh, 3, proj.rank, generator=g).to(torch.bfloat16)
           for _ in range(8)]
    sel = {"quest": make_selector("quest"), "mean": make_selector("mean")}
    budget = args.budget // args.page_size
    ccfg = KVStoreConfig(page_size=args.page_size, sparse_budget=args.budget,
                         sink_tokens=args.sink_pages * args.page_size,
                         local_tokens=args.local_pages * args.page_size, obs_window=0,
                         selector="centroid", centroid_pages=args.centroid_pages)
    csel = PageSelection(ccfg, 1, KVStats(), d)
    indexes = [CentroidIndex(pages) for _ in range(8)]
    csel.select(5, q, full, [pages] * 8, [args.page_size] * 8, kvh, observe=False,
                indexes=indexes)                       # builds the indexes (end of prefill)

    def run(name):
        if name == "centroid":
            return csel.select(5, q, full, [pages] * 8, [args.page_size] * 8, kvh,
                               observe=False, indexes=indexes)
        if name == "lowrank":
            return sel["quest"].select(proj.queries(5, q, group), low, [pages] * 8, group,
                                       budget, args.sink_pages, args.local_pages)
        return sel[name].select(q, full, [pages] * 8, group, budget, args.sink_pages,
                                args.local_pages)
    per_head = torch.full((kvh,), budget, dtype=torch.int64)

    def run_plan():             # quest with a budget per KV head (--sparse-budget-plan)
        return sel["quest"].select(q, full, [pages] * 8, group, per_head, args.sink_pages,
                                   args.local_pages)
    names = SELECTORS + ("quest-per-head",)
    times = {s: [] for s in names}
    for _ in range(reps):
        for name in names:
            t0 = time.perf_counter()
            run_plan() if name == "quest-per-head" else run(name)
            times[name].append(time.perf_counter() - t0)
    return {s: 1e3 * statistics.median(t) for s, t in times.items()}


def build_prompts(tok, args) -> list[tuple[str, list[int]]]:
    from bench.needle_prompts import DEFAULT_FORMAT, make_prompts
    from bench.ruler_tasks import TASKS, generate
    out = []
    depths = [0.1, 0.3, 0.5, 0.7, 0.9]
    for p in make_prompts(tok, essay_ids(tok), DEFAULT_FORMAT, args.lengths, depths,
                          args.per_depth, 0):
        out.append((f"needle-{p.length}", p.ids))
    for s in generate(tok, TASKS, args.lengths, args.per_task, seed=1):
        ids = tok.encode_chat([{"role": "user", "content": s["prompt"]}])
        out.append((f"ruler-{s['length']}", ids))
    return out


def run(args) -> dict:
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from server.tokenizer import Tokenizer
    from tqdm import tqdm
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineArgs(max_model_len=8192, kv_device_gb=0.05, sparse_budget=args.budget,
                                  sparse_threshold=1, selector="lowrank", lowrank_rank=args.rank,
                                  prefix_cache="off"))
    model, cfg = engine.runner.model, engine.runner.config
    proj = engine.store.selection.projection
    tok = Tokenizer.from_folder(engine.model_folder)
    per_set: dict[str, dict[str, list]] = {}
    index_bytes: list[float] = []
    for name, ids in tqdm(build_prompts(tok, args), desc="prompts"):
        with torch.inference_mode():
            seam = decode_queries(model, ids, args.steps)
        for sel, pairs in page_recall(seam, proj, cfg, args, index_bytes).items():
            per_set.setdefault(name, {}).setdefault(sel, []).extend(pairs)
    rows = {}
    for name, by_sel in per_set.items():
        rows[name] = {sel: {"page_recall": statistics.mean(p for p, _ in pairs),
                            "mass_recall": statistics.mean(m for _, m in pairs),
                            "rows": len(pairs)} for sel, pairs in by_sel.items()}
    kv_token = 2 * cfg.head_dim * 2                 # K and V of a token and KV head, bf16
    memory = {"quest": 2 * cfg.head_dim * 2, "mean": cfg.head_dim * 2,
              "lowrank": 2 * proj.rank * 2, "centroid": statistics.mean(index_bytes)}
    memory = {s: b / args.page_size for s, b in memory.items()}     # per token and KV head
    return {"bench": "selector_recall", "machine": machine(), "code": code_version(),
            "budget": args.budget, "page_size": args.page_size, "rank": proj.rank,
            "energy_kept": list(proj.energy), "steps": args.steps,
            "dense_layers": args.dense_layers, "centroid_pages": args.centroid_pages,
            "sets": rows, "index_bytes_per_token": memory,
            "index_share_of_kv": {s: b / kv_token for s, b in memory.items()},
            "select_ms_per_layer": select_time(proj, cfg, args)}


def report(res: dict) -> str:
    m = res["machine"]
    sels = list(res["index_share_of_kv"])
    lines = [f"{cpu_line(m)}; budget {res['budget']}, rank {res['rank']}, "
             f"{res['steps']} decode steps a prompt",
             "| prompts | " + " | ".join(f"{s} page / mass recall" for s in sels) + " |",
             "|---|" + "---|" * len(sels)]
    for name, by_sel in res["sets"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{by_sel[s]['page_recall']:.3f} / {by_sel[s]['mass_recall']:.3f}"
            for s in sels) + " |")
    lines.append("| index bytes / KV | " + " | ".join(
        f"1/{1 / res['index_share_of_kv'][s]:.1f}" for s in sels) + " |")
    lines.append("| select ms / layer (8 x 7K) | " + " | ".join(
        f"{res['select_ms_per_layer'][s]:.2f}" for s in sels) + " |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    sets = list(res["sets"])
    sels = list(res["index_share_of_kv"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(sels)
    for i, s in enumerate(sels):
        ax.bar([j + i * width for j in range(len(sets))],
               [res["sets"][n][s]["mass_recall"] for n in sets], width,
               label=f"{s} (index 1/{1 / res['index_share_of_kv'][s]:.0f} of the KV)")
    ax.set_xticks([j + width * (len(sels) - 1) / 2 for j in range(len(sets))], sets)
    ax.set_ylabel("attention mass recall")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"page selectors at budget {res['budget']}: their top pages' attention over "
                 f"the best; {res['machine']['cpu']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4000, 7000])
    ap.add_argument("--per-depth", type=int, default=1)
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--centroid-pages", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--local-pages", type=int, default=4)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    add_out_arg(ap, "selector_recall", quick=True)
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.lengths, args.per_depth, args.per_task, args.steps = [4000], 1, 1, 2
    replot_or_run(args, "selector_recall", run, plot, report)


if __name__ == "__main__":
    main()
