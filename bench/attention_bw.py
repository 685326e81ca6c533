"""The C decode attention's K/V bandwidth over every page of a context, against slot order.

    .venv/bin/python bench/attention_bw.py --batch 1 8 --context 7000 --threads 1 2

SmolLM2 shapes by default (9 query / 3 KV heads, head_dim 64, page 16, bf16 KV): one
NativeSparseDecode call a layer over `--batch` sequences of `--context` tokens, each
sequence's pages on slots in ascending order (what the KV pools hand out), descending, or
shuffled; the pools of enough layers cycled (up to 30, ~400 MB) that the KV comes from DRAM,
not the caches. Prints ms a layer and GB/s of K/V read, per slot order, batch and threads;
compare with bench/roofline.py's DRAM read bandwidth. Writes JSON
(bench/results/attention_bw.json unless --out).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from bench.common import (add_out_arg, add_shape_args, cpu_line, machine, parser,  # noqa: E402
                          result_header, write_json)
from kernels.page_table import PageTable  # noqa: E402
from kernels.sparse_attention import NativeSparseDecode  # noqa: E402

ORDERS = ("ascending", "descending", "random")


def slot_order(order: str, n: int) -> torch.Tensor:
    if order == "ascending":
        return torch.arange(n)
    if order == "descending":
        return torch.arange(n - 1, -1, -1)
    return torch.randperm(n, generator=torch.Generator().manual_seed(0))


def measure(args, batch: int, order: str) -> list[dict]:
    ps, kvh, d = args.page_size, args.kv_heads, args.head_dim
    pages = -(-args.context // ps)
    page_bytes = 2 * kvh * ps * d * 2
    layers = max(3, min(30, int(400e6 // (batch * pages * page_bytes))))
    pools = [torch.randn(batch * pages, 2, kvh, ps, d).to(torch.bfloat16) for _ in range(layers)]
    slots = slot_order(order, batch * pages).view(batch, pages)
    table = PageTable(torch.arange(batch * kvh + 1, dtype=torch.int32) * pages,
                      slots.repeat_interleave(kvh, 0).reshape(-1).to(torch.int32),
                      torch.full((batch * kvh,), args.context - (pages - 1) * ps,
                                 dtype=torch.int32), ps)
    q = torch.randn(batch, args.heads, d)
    kernel = NativeSparseDecode()
    rows = []
    for threads in args.threads:
        kernel.threads = threads
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for pool in pools:
                kernel.forward_partial(q, pool, table, args.heads // kvh, d ** -0.5)
            rounds.append((time.perf_counter() - t0) / layers)
        ms = 1e3 * statistics.median(rounds)
        rows.append({"batch": batch, "context": args.context, "order": order,
                     "threads": threads, "ms_per_layer": round(ms, 4),
                     "gb_s": round(batch * pages * page_bytes / ms / 1e6, 2)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    ap.add_argument("--rounds", type=int, default=5)
    add_shape_args(ap)
    add_out_arg(ap, "attention_bw")
    args = ap.parse_args(argv)
    m = machine()
    print(f"{cpu_line(m)}; ms a layer (median of {args.rounds} rounds) and GB/s of K/V")
    print("| slots | batch | threads | ms a layer | GB/s |\n|---|---|---|---|---|")
    rows = []
    for order in args.orders:
        for b in args.batch:
            for r in measure(args, b, order):
                rows.append(r)
                print(f"| {order} | {b} | {r['threads']} | {r['ms_per_layer']:.3f} | "
                      f"{r['gb_s']:.1f} |", flush=True)
    write_json(args.out, {**result_header("attention_bw"), "rows": rows})


if __name__ == "__main__":
    main()
