"""Decode-sized matmuls by 4- and 8-bit weights: our kernel (kernels/_qmatmul.c, 16- and
8-bit rounding of x) against torch's packed int4 / int8 kernels.

    .venv/bin/python bench/qmatmul.py [--threads 1 2]

30 layers of SmolLM2-135M's shapes (q|k|v, o, gate|up, down) with random weights, and its
49152 x 576 LM head, at 1 and 8 rows: the best of 5 sweeps, the kernels taking turns.
Prints a table and writes bench/results/qmatmul.json (the CPU named).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_out_arg, cpu_line, machine, parser, write_json  # noqa: E402
from kernels.packed_linear import PackedWeight  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
# name: (format, x bits for ours, layers' weights or the head)
CASES = {"q4 (ours, 16-bit x)": ("q4", 16, "layers"), "q4 (ours, 8-bit x)": ("q4", 8, "layers"),
         "int4 (torch)": ("int4", 0, "layers"), "q8 head (ours)": ("q8", 16, "head"),
         "int8 head (torch)": ("int8", 0, "head")}


def run(threads: int, rows: int, sweeps: int = 5) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    dense = {"layers": [torch.randn(n, k, generator=gen) * 0.02
                        for _ in range(LAYERS) for n, k in SHAPES],
             "head": [torch.randn(49152, 576, generator=gen) * 0.02]}
    packed = {}
    for name, (fmt, xbits, which) in CASES.items():
        packed[name] = [PackedWeight.from_dense(w, fmt) for w in dense[which]]
        for p in packed[name]:
            p.xbits = xbits or p.xbits
    xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
    torch.set_num_threads(threads)
    best = dict.fromkeys(CASES, float("inf"))
    for i in range(sweeps + 1):
        for name, ws in packed.items():
            t0 = time.perf_counter()
            for w in ws:
                w.mm(xs[w.shape[1]])
            if i:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    add_out_arg(ap, "qmatmul")
    args = ap.parse_args(argv)
    rows = [{"threads": t, "rows": r, "ms": {k: 1e3 * v for k, v in run(t, r).items()}}
            for t in args.threads for r in (1, 8)]
    m = machine()
    print(cpu_line(m))
    print("| threads | rows | " + " | ".join(CASES) + " |")
    print("|---|---|" + "---|" * len(CASES))
    for r in rows:
        print(f"| {r['threads']} | {r['rows']} | " +
              " | ".join(f"{r['ms'][k]:.1f}" for k in CASES) + " |")
    write_json(args.out, {"bench": "qmatmul", "machine": m, "rows": rows})


if __name__ == "__main__":
    main()
