"""Per-decode-step cost of the sparse-decode leaf ops against dense paged attention (CPU).

    python -m bench.sparse_ops --threads 1 --batch 8 --context 7000 --budget 1024

SmolLM2 shapes by default (30 layers, 9 heads / 3 KV heads, head_dim 64, page 16, bf16 KV).
Per layer: summary update at append time (decode: one token per sequence), Quest scoring +
top-k selection + the per-head page table, sparse attention over the selection, and dense
attention over every page (TorchPagedAttention, and the C kernel the store's dense decodes use);
each times `layers` for the step. Random K/V and queries
(selection quality is the accuracy bench's job); `--resident` distinct layers are cycled so the
KV does not sit in the CPU caches.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_shape_args, parser, time_calls  # noqa: E402
from kernels.attention import AttentionBatch, TorchPagedAttention  # noqa: E402
from kernels import page_select  # noqa: E402
from kernels.page_select import make_selector, native_select_serves  # noqa: E402
from kernels.page_topk import select_pages  # noqa: E402
from kernels.page_summary import summarize_pages, update_summaries  # noqa: E402
from kernels.page_table import build_head_page_table  # noqa: E402
from kernels.backends import make_sparse_decode  # noqa: E402
from kernels.sparse_attention import NativeSparseDecode, TorchSparseDecode  # noqa: E402


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(time_calls(fn, repeats)) * 1e3


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--layers", type=int, default=30)
    add_shape_args(ap)
    ap.add_argument("--budget", type=int, default=1024, help="tokens per sequence and layer")
    ap.add_argument("--sink-pages", type=int, default=1)
    ap.add_argument("--local-pages", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", help="KV dtype")
    ap.add_argument("--summary-dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--resident", type=int, default=3, help="distinct layers cycled")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    b, ps, kvh, d = args.batch, args.page_size, args.kv_heads, args.head_dim
    group = args.heads // kvh
    n_pages = -(-args.context // ps)
    budget_pages = args.budget // ps
    scale = d ** -0.5

    # KV pools of `resident` layers (HND pages [2, KVH, ps, D]), each sequence's pages on
    # shuffled slots
    slots_total = b * n_pages
    perm = torch.randperm(slots_total)
    slot_table = perm.view(b, n_pages)
    pools = [torch.randn(slots_total, 2, kvh, ps, d).to(dtype) for _ in range(args.resident)]
    q = torch.randn(b, args.heads, d).to(dtype)
    kv_lens = [args.context] * b
    num_pages = torch.full((b,), n_pages)
    cyc = {"i": 0}

    def pool() -> torch.Tensor:
        cyc["i"] = (cyc["i"] + 1) % args.resident
        return pools[cyc["i"]]

    rows = []
    step_ms: dict[str, float] = {}

    def report(name: str, ms: float, per: str = "layer", key: str | None = None) -> None:
        step = ms * args.layers if per == "layer" else ms
        rows.append((name, ms if per == "layer" else ms / args.layers, step))
        if key:
            step_ms[key] = step

    # 1. summaries at append time: the decode token of every sequence, into its last page
    last = args.context - 1
    for si, sdt_name in enumerate(args.summary_dtype):
        sdt = getattr(torch, sdt_name)
        main_dtype = si == 0                                        # counted in the totals
        per_req = [summarize_pages(pools[0][slot_table[i], 0],
                                   [ps] * (n_pages - 1) + [args.context - (n_pages - 1) * ps], sdt)
                   for i in range(b)]
        pooled = torch.cat(per_req)                                 # one tensor for all requests
        k_new = torch.randn(b, kvh, d).to(dtype)
        page_rows = torch.arange(b) * n_pages + last // ps
        offs = torch.full((b,), last % ps)
        report(f"summary update, one call for the batch ({sdt_name})",
               _median_ms(lambda: update_summaries(pooled, page_rows, offs, k_new,
                                                   distinct_pages=True), 50),
               key="update" if main_dtype else None)
        report(f"  (same, generic grouping path; {sdt_name})",
               _median_ms(lambda: update_summaries(pooled, page_rows, offs, k_new), 50))

        def per_request():
            for i in range(b):
                update_summaries(per_req[i], page_rows[i:i + 1] - i * n_pages, offs[i:i + 1],
                                 k_new[i:i + 1], distinct_pages=True)
        report(f"summary update, one call per request ({sdt_name})", _median_ms(per_request, 50))

        chunk = torch.randn(2048, kvh, d).to(dtype)
        pos = torch.arange(2048)
        report(f"  (prefill chunk 2048 tokens, per layer; {sdt_name})",
               _median_ms(lambda: update_summaries(per_req[0], pos // ps, pos % ps, chunk), 10))

        # 2. scoring + selection + per-head page table
        for sel_name in ("quest", "mean"):
            selector = make_selector(sel_name)
            report(f"{sel_name} scores ({sdt_name} summaries)",
                   _median_ms(lambda: selector.score(q, per_req, num_pages, group), args.repeats),
                   key="score" if main_dtype and sel_name == "quest" else None)
        scores = make_selector("quest").score(q, per_req, num_pages, group)
        report("select_pages (top-k, sink, local, union)",
               _median_ms(lambda: select_pages(scores, num_pages, budget_pages,
                                               args.sink_pages, args.local_pages), args.repeats),
               key="select" if main_dtype else None)
        if native_select_serves(q, per_req, None):
            quest = make_selector("quest")
            report(f"quest scores + select_pages in one C call, the store's ({sdt_name})",
                   _median_ms(lambda: quest.select(q, per_req, num_pages, group, budget_pages,
                                                   args.sink_pages, args.local_pages),
                              args.repeats), key="score_select" if main_dtype else None)
            page_select.NATIVE_SIMD = False     # the portable scoring (its AVX-512 clone here)
            try:
                report("  (same, its portable scoring)",
                       _median_ms(lambda: quest.select(q, per_req, num_pages, group,
                                                       budget_pages, args.sink_pages,
                                                       args.local_pages), args.repeats))
            finally:
                page_select.NATIVE_SIMD = True
    sel = select_pages(scores, num_pages, budget_pages, args.sink_pages, args.local_pages)
    report("build_head_page_table",
           _median_ms(lambda: build_head_page_table(sel.indptr, sel.page_indices, slot_table,
                                                    kv_lens, ps), args.repeats), key="table")
    table = build_head_page_table(sel.indptr, sel.page_indices, slot_table, kv_lens, ps)

    # 3. sparse attention over the selection (planned per layer: each layer selects its own)
    # (the store's kernel on the CPU is the C one; the torch one plans, gathers and pads)
    sparse = TorchSparseDecode()
    report("sparse attention plan, torch kernel (per layer)",
           _median_ms(lambda: sparse.plan(table, pools[0].shape), args.repeats))
    sparse.plan(table, pools[0].shape)
    report(f"sparse attention forward, torch kernel ({budget_pages} pages per head)",
           _median_ms(lambda: sparse.forward(q, pool(), table, group, scale), args.repeats))
    native = make_sparse_decode("cpu")
    report(f"sparse attention forward, {type(native).__name__} (the store's)",
           _median_ms(lambda: native.forward(q, pool(), table, group, scale), args.repeats),
           key="sparse")
    portable = None
    if isinstance(native, NativeSparseDecode):
        portable = NativeSparseDecode()
        portable.simd = False               # the portable rows (their AVX-512 clone here)
        report("  (same, its portable rows)",
               _median_ms(lambda: portable.forward(q, pool(), table, group, scale),
                          args.repeats))

    # 4. dense paged attention over every page (planned once per step)
    dense = TorchPagedAttention()
    batch = AttentionBatch.build(slot_table.tolist(), kv_lens, [1] * b, ps)
    report("dense plan (once per step)", _median_ms(lambda: dense.plan(batch), args.repeats),
           per="step", key="dense_plan")
    dense.plan(batch)
    report(f"dense attention forward ({n_pages} pages)",
           _median_ms(lambda: dense.forward(q, pool(), batch, scale), max(3, args.repeats // 3)),
           key="dense")
    per_head = batch.page_table.per_head(kvh)
    report(f"dense attention forward, {type(native).__name__} over every page (the store's "
           f"decodes)",
           _median_ms(lambda: native.forward(q, pool(), per_head, group, scale),
                      max(3, args.repeats // 3)))
    if portable is not None:
        report("  (same, its portable rows)",
               _median_ms(lambda: portable.forward(q, pool(), per_head, group, scale),
                          max(3, args.repeats // 3)))

    print(f"threads={args.threads} batch={b} context={args.context} pages/seq={n_pages} "
          f"page={ps} heads={args.heads}/{kvh} hd={d} kv={args.dtype} budget={budget_pages} "
          f"pages (sink {args.sink_pages}, local {args.local_pages}) layers={args.layers}")
    width = max(len(r[0]) for r in rows)
    print(f"{'op':<{width}}  {'ms/layer':>9}  {'ms/step':>9}")
    for name, per_layer, step in rows:
        print(f"{name:<{width}}  {per_layer:9.3f}  {step:9.2f}")
    # the store selects in C where it can (kernels/_select.c), else scores then select_pages
    choose = ("score_select",) if "score_select" in step_ms else ("score", "select")
    sparse_total = sum(step_ms[k] for k in ("update", *choose, "table", "sparse"))
    dense_total = step_ms["dense"] + step_ms["dense_plan"]
    kv_bytes = torch.tensor([], dtype=dtype).element_size() * 2 * d
    print(f"attention-side total per step: sparse {sparse_total:.1f} ms "
          f"(update + quest + select + table + forward, {args.summary_dtype[0]} "
          f"summaries) vs dense {dense_total:.1f} ms: {dense_total / sparse_total:.2f}x")
    print(f"K/V bytes read per layer: sparse {b * kvh * budget_pages * ps * kv_bytes / 1e6:.1f} MB "
          f"vs dense {b * kvh * n_pages * ps * kv_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
