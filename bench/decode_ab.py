"""One engine's decode step with the step-level fast paths switched on one at a time, in turns.

    .venv/bin/python bench/decode_ab.py --context 1000 7000 --batch 1 8
    .venv/bin/python bench/decode_ab.py --context 7000 --batch 1 4 --sparse-budget 1024

One engine in this process with the server's defaults and its threads (`use_threads`, as
`strata serve` runs it); `--batch` random-token prompts of `--context` tokens prefilled, then
`--rounds` rounds of the variants below, `--steps` timed decode steps each (medians, ms a step):
  general      every layer through the KV store's stages (resolve, fetch, bookkeeping), the
               layer's small ops as torch ops, torch on one fewer thread than the cores and the
               C attention on every core
  +resident    decode steps whose pages are all on the device tier take kvstore/resident.py
  +layer ops   RMSNorm, RoPE, SiLU x up and the K/V scatter in C (kernels/layer_ops.py)
  +core split  each step shape timed with torch, or the C attention, on every core
               (engine/core_split.py)
  +C layers    a layer one C call where the weights and activations allow
               (kernels/decode_layer.py), sparse layers two around the KV store's selection
  +sparse in C sparse layers select and attend inside their one call (SparseWords): the
               server's default
`--sparse-budget N` decodes sparsely (past twice N, the default --sparse-threshold).
Prints a table naming the CPU and writes JSON (bench/results/decode_ab.json unless --out).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.core_split import CoreSplit  # noqa: E402
from bench.common import (add_out_arg, cpu_line, machine, parser, result_header,  # noqa: E402
                          time_calls, use_checkout_cache, write_json)
from bench.engine_steps import all_decoding, decoding_engine  # noqa: E402

use_checkout_cache()

VARIANTS = ("general", "+resident", "+layer ops", "+core split", "+C layers", "+sparse in C")
# untimed steps a variant: the core split's timing of a new step shape, and two
WARMUP = CoreSplit(2, 1).timing_steps + 2


def switch(engine, variant: str, split) -> None:
    """Turn the fast paths up to `variant` on (the ones after it off)."""
    from kernels.decode_layer import FusedLayers, SparseWords
    from kernels.layer_ops import LayerOps
    from kvstore.resident import ResidentDecode

    on = VARIANTS.index(variant)
    ResidentDecode.enabled = on >= 1
    LayerOps.enabled = on >= 2
    FusedLayers.enabled = on >= 4
    SparseWords.enabled = on >= 5
    engine.core_split = split if on >= 3 else None
    if on < 3:          # the fixed threads: torch's decode count, the attention every core
        engine.store.attention_threads = engine.threads[0]


def measure(context: int, batch: int, steps: int, rounds: int, budget: int = 0) -> dict:
    # the throughput bench's dense configuration: every page stays on the device tier
    tokens = rounds * len(VARIANTS) * (steps + WARMUP)
    engine, ids = decoding_engine(context, batch, tokens, kv_device_gb=4.0,
                                  sparse_budget=budget)
    split = engine.core_split
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v in VARIANTS:
            switch(engine, v, split)
            walls = time_calls(engine.step, steps, warmup=WARMUP)
            times[v].append(statistics.median(walls))
    if not all_decoding(engine, ids):
        raise RuntimeError(f"a request finished inside the timed steps: not all {batch} rows")
    switch(engine, VARIANTS[-1], split)
    return {"context": context, "batch": batch, "sparse_budget": budget,
            "ms": {v: [1e3 * t for t in ts] for v, ts in times.items()},
            "splits": {str(k): v for k, v in (split.decided() if split else {}).items()}}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--context", type=int, nargs="+", default=[1000, 7000])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sparse-budget", type=int, default=0)
    add_out_arg(ap, "decode_ab")
    args = ap.parse_args(argv)
    m = machine()
    print(f"{cpu_line(m)}; ms a decode step, median of {args.steps} steps, the fastest "
          f"of {args.rounds} rounds (slowest); --sparse-budget {args.sparse_budget}")
    print("| context x batch | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS), flush=True)
    rows = []
    for c in args.context:
        for b in args.batch:
            r = measure(c, b, args.steps, args.rounds, args.sparse_budget)
            rows.append(r)
            cells = [f"{min(r['ms'][v]):.1f} ({max(r['ms'][v]):.1f})" for v in VARIANTS]
            print(f"| {r['context']} x {r['batch']} | " + " | ".join(cells) + " |", flush=True)
    write_json(args.out, {**result_header("decode_ab"), "machine": m, "rows": rows})


if __name__ == "__main__":
    main()
