"""One engine's decode step with the step-level fast paths switched on one at a time, in turns.

    .venv/bin/python bench/decode_ab.py --context 1000 7000 --batch 1 8

One engine in this process with the server's defaults and its threads (`use_threads`, as
`strata serve` runs it); `--batch` random-token prompts of `--context` tokens prefilled, then
`--rounds` rounds of the variants below, `--steps` timed decode steps each (medians, ms a step):
  general      every layer through the KV store's stages (resolve, fetch, bookkeeping), the
               layer's small ops as torch ops, torch on one fewer thread than the cores and the
               C attention on every core
  +resident    decode steps whose pages are all on the device tier take kvstore/resident.py
  +layer ops   RMSNorm, RoPE, SiLU x up and the K/V scatter in C (kernels/layer_ops.py)
  +core split  each step shape timed with torch, or the C attention, on every core
               (engine/core_split.py): the server's default
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

VARIANTS = ("general", "+resident", "+layer ops", "+core split")
# untimed steps a variant: the core split's timing of a new step shape, and two
WARMUP = CoreSplit(2, 1).timing_steps + 2


def switch(engine, variant: str, split) -> None:
    """Turn the fast paths up to `variant` on (the ones after it off)."""
    from kernels.layer_ops import LayerOps
    from kvstore.resident import ResidentDecode

    on = VARIANTS.index(variant)
    ResidentDecode.enabled = on >= 1
    LayerOps.enabled = on >= 2
    engine.core_split = split if on >= 3 else None
    if on < 3:          # the fixed threads: torch's decode count, the attention every core
        engine.store.attention_threads = engine.threads[0]


def measure(context: int, batch: int, steps: int, rounds: int) -> dict:
    # the throughput bench's dense configuration: every page stays on the device tier
    tokens = rounds * len(VARIANTS) * (steps + WARMUP)
    engine, ids = decoding_engine(context, batch, tokens, kv_device_gb=4.0)
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
    return {"context": context, "batch": batch, "ms": {v: [1e3 * t for t in ts]
                                                       for v, ts in times.items()},
            "splits": {str(k): v for k, v in (split.decided() if split else {}).items()}}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--context", type=int, nargs="+", default=[1000, 7000])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    add_out_arg(ap, "decode_ab")
    args = ap.parse_args(argv)
    m = machine()
    print(f"{cpu_line(m)}; ms a decode step, median of {args.steps} steps, "
          f"the fastest of {args.rounds} rounds (slowest)")
    print("| context x batch | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS), flush=True)
    rows = []
    for c in args.context:
        for b in args.batch:
            r = measure(c, b, args.steps, args.rounds)
            rows.append(r)
            cells = [f"{min(r['ms'][v]):.1f} ({max(r['ms'][v]):.1f})" for v in VARIANTS]
            print(f"| {r['context']} x {r['batch']} | " + " | ".join(cells) + " |", flush=True)
    write_json(args.out, {**result_header("decode_ab"), "machine": m, "rows": rows})


if __name__ == "__main__":
    main()
