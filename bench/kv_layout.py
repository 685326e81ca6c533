"""Microbenchmark of the two decode attention kernels over one layer's slot pool (CPU).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.kv_layout

Measures TorchSparseDecode.forward (each (sequence, KV head) row attends to its own `--sparse-pages`
random pages: the per-head gather) and TorchPagedAttention decode (every sequence attends to its
own `--dense-pages` pages) on a pool of `--slots` pages in the store's page layout
(kvstore.tiers.base.PageShape.shape), random bf16 K/V, one torch thread. Prints medians.
The plan is built once outside the timed loop (forward only), as in bench/sparse_ops.py.
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
from kernels.page_table import PageTable  # noqa: E402
from kernels.sparse_attention import TorchSparseDecode  # noqa: E402
from kvstore.tiers.base import PageShape  # noqa: E402


def _median_ms(fn, repeats: int) -> tuple[float, float]:
    times = time_calls(fn, repeats, warmup=3)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--slots", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=8)
    add_shape_args(ap)
    ap.add_argument("--sparse-pages", type=int, default=64, help="pages per (sequence, KV head)")
    ap.add_argument("--dense-pages", type=int, default=440, help="pages per sequence")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    b, kvh, d, ps = args.batch, args.kv_heads, args.head_dim, args.page_size
    group = args.heads // kvh
    scale = d ** -0.5
    shape = PageShape(ps, kvh, d, torch.bfloat16).shape
    pool = torch.randn(args.slots, *shape).to(torch.bfloat16)
    q = torch.randn(b, args.heads, d).to(torch.bfloat16)

    # sparse: every row its own sorted random pages, the last one partial (as in serving)
    rows = b * kvh
    n = args.sparse_pages
    slots = torch.stack([torch.randperm(args.slots)[:n].sort().values for _ in range(rows)])
    indptr = torch.arange(rows + 1, dtype=torch.int32) * n
    last = torch.full((rows,), ps // 2, dtype=torch.int32)
    table = PageTable(indptr, slots.view(-1).to(torch.int32), last, ps)
    sparse = TorchSparseDecode()
    sparse.plan(table, tuple(pool.shape))
    sp_med, sp_min = _median_ms(lambda: sparse.forward(q, pool, table, group, scale),
                                args.repeats)

    # dense: sequences on disjoint shuffled slots, lengths differ by a few tokens (masked)
    perm = torch.randperm(args.slots)[:b * args.dense_pages].view(b, args.dense_pages)
    kv_lens = [args.dense_pages * ps - i for i in range(b)]
    batch = AttentionBatch.build(perm.tolist(), kv_lens, [1] * b, ps)
    dense = TorchPagedAttention()
    dense.plan(batch)
    de_med, de_min = _median_ms(lambda: dense.forward(q, pool, batch, scale), args.repeats)

    print(f"pool {tuple(pool.shape)} bf16, threads={args.threads}, B={b}, heads {args.heads}/{kvh}")
    print(f"sparse forward ({rows} rows x {n} pages):   median {sp_med:7.3f} ms  "
          f"min {sp_min:7.3f} ms")
    print(f"dense decode ({b} seqs x {args.dense_pages} pages): median {de_med:7.3f} ms  "
          f"min {de_min:7.3f} ms")


if __name__ == "__main__":
    main()
