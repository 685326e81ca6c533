"""Where a decode step's time goes: weights, attention, selection, and everything else.

    .venv/bin/python bench/decode_profile.py --context 7000 --batch 1 8
    .venv/bin/python bench/decode_profile.py --context 7000 --batch 8 --sparse-budget 1024
    .venv/bin/python bench/decode_profile.py --batch 8 --sparse-budget 1024 --kv-device-gb 0.5 \
        --set kv_host_gb=1 kv_disk_gb=8 kv_host_pool=separate     # any EngineArgs field

One engine in this process (the server's defaults: --dtype auto --weights auto), `--batch`
random-token prompts of `--context` tokens prefilled, then `--steps` decode steps timed under
cProfile. Each step's time is split by the functions that own it:
  weights     the packed and dense matmuls (our q4 / q8 kernel, torch's int4 / int8, F.linear)
  attention   the C decode attention (kernels/_decode.c)
  selection   the C page selection (kernels/_select.c), sparse decode only
  other       the rest: the model's small ops (norms, RoPE, SiLU, casts) and the KV store's
              per-layer bookkeeping (slots, page tables, residency), in Python and torch
Also the step's wall time without the profiler. Prints a table and writes JSON
(bench/results/decode_profile.json unless --out).
"""
from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (add_out_arg, cpu_line, machine, parser, time_calls,  # noqa: E402
                          use_checkout_cache, write_json)

use_checkout_cache()

OWNERS = {
    "weights": ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm", "<built-in method "
                "torch._C._nn.linear>", "kernels._qmatmul.qmm"),
    "attention": ("sparse_decode",),
    "selection": ("native_select", "select_pages"),
}


def _owner(name: str) -> str | None:
    for owner, keys in OWNERS.items():
        if any(k in name for k in keys):
            return owner
    return None


def profile(context: int, batch: int, steps: int, extra: dict) -> dict:
    import torch
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    args = EngineArgs(max_model_len=max(8192, context + 2 * steps + 40), **extra)
    prefill_threads, decode_threads = args.torch_threads()
    engine = LLMEngine(args)
    engine.use_threads(prefill_threads, decode_threads)     # as the server's (CoreSplit)
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(100, 40000, (context,), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=2 * steps + 32,
                                                        temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    while not all(engine.scheduler.get_request(f"r{i}").output_token_ids for i in range(batch)):
        engine.step()
    prefill_s = time.perf_counter() - t0
    # warm-up past the core split's timing of the shape's first steps (engine/core_split.py)
    walls = time_calls(engine.step, steps, warmup=20)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    profiled = (time.perf_counter() - t0) / steps
    split = {k: 0.0 for k in OWNERS}
    for (_, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        owner = _owner(name)
        if owner:
            split[owner] += tottime / steps
    split["other"] = max(0.0, profiled - sum(split.values()))
    walls.sort()
    plan = engine.weight_plan
    engine.store.close()                # the disk tier's folder lock, for the next --batch
    return {"context": context, "batch": batch, "flags": extra, "prefill_s": prefill_s,
            "step_s": walls[len(walls) // 2], "profiled_step_s": profiled, "split_s": split,
            "weights": f"{plan.dtype} prefill, {plan.decode_format} decode, KV {plan.kv_dtype}",
            "threads": [prefill_threads, decode_threads]}


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sparse-budget", type=int, default=0)
    ap.add_argument("--kv-device-gb", type=float, default=2.0)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="more EngineArgs fields (numbers as numbers), e.g. kv_disk_gb=8")
    add_out_arg(ap, "decode_profile")
    args = ap.parse_args(argv)
    extra = {"kv_device_gb": args.kv_device_gb, "sparse_budget": args.sparse_budget}
    for item in args.set:
        name, _, value = item.partition("=")
        try:
            extra[name] = json.loads(value)
        except ValueError:
            extra[name] = value
    rows = [profile(args.context, b, args.steps, extra) for b in args.batch]
    m = machine()
    print(f"{cpu_line(m)}, {os.cpu_count()} cores")
    print("| context x batch | weights | step ms | weights | attention | selection | other |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = {k: f"{1e3 * v:.1f}" for k, v in r["split_s"].items()}
        print(f"| {r['context']} x {r['batch']} | {r['weights']} | {1e3 * r['step_s']:.1f} | "
              f"{s['weights']} | {s['attention']} | {s['selection']} | {s['other']} |")
    write_json(args.out, {"bench": "decode_profile", "machine": m, "rows": rows})


if __name__ == "__main__":
    main()
