"""A/B of the decode step with the KV spilling to disk: configurations and checkouts side by side.

    .venv/bin/python bench/kv_ab.py                                   # separate vs auto host pool
    .venv/bin/python bench/kv_ab.py --arm old=/path/to/old/checkout: --arm new=.:kv_host_pool=auto

Each arm is NAME=CHECKOUT:FIELD=VALUE,... (EngineArgs fields; numbers as numbers) and runs in
its own process with that checkout first on sys.path (so an older commit can be measured in the
same run). Every arm prefills `--batch` random prompts of `--context` tokens, then times
`--steps` decode steps after 3 untimed ones; arms run in turns for `--rounds`. The default
workload is bench/throughput.py's sparse-tiered row with smaller memory tiers, so that the KV
(8 x 7K tokens: ~1.3 GB in bf16) spills to disk. Prints a table; writes JSON (--out).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (KV_TMP, add_out_arg, cpu_line, machine,  # noqa: E402
                          parser, use_checkout_cache, write_json)

BASE = dict(max_model_len=8192, sparse_budget=1024, kv_device_gb=0.25, kv_host_gb=0.5,
            kv_disk_gb=8)
DEFAULT_ARMS = ["separate=.:kv_host_pool=separate", "auto=.:kv_host_pool=auto"]


def parse_arm(text: str) -> tuple[str, Path, dict]:
    name, _, rest = text.partition("=")
    checkout, _, fields = rest.partition(":")
    over = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        try:
            over[key] = json.loads(value)
        except ValueError:
            over[key] = value
    return name, Path(checkout or ".").resolve(), over


def child(root: str, spec: str) -> None:
    """In the arm's process: one engine, prefill, timed decode steps; prints JSON."""
    sys.path.insert(0, root)
    import torch
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams
    cfg = json.loads(spec)
    args = EngineArgs(**cfg["engine"])
    prefill_threads, decode_threads = args.torch_threads()
    engine = LLMEngine(args)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=cfg["steps"] + 16 + cfg["batch"] * 16, temperature=0,
                            ignore_eos=True)
    torch.set_num_threads(prefill_threads)
    t0 = time.perf_counter()
    # serial: each prompt added once the one before has its first token (the earlier ones
    # decode meanwhile), so that prefills do not evict each other's pages from small tiers
    serial = cfg.get("serial_prefill", False)
    prompts = None
    if cfg.get("prompts") == "essay":       # bench/pipeline.py's: essays and a question
        from bench.common import essay_prompts
        from server.tokenizer import Tokenizer
        prompts = essay_prompts(Tokenizer.from_folder(engine.model_folder), cfg["batch"],
                                cfg["context"])
    for i in range(cfg["batch"]):
        ids = prompts[i] if prompts else \
            torch.randint(100, 40000, (cfg["context"],), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, params)
        while serial and not engine.scheduler.get_request(f"r{i}").output_token_ids:
            engine.step()
    while not all(engine.scheduler.get_request(f"r{i}").output_token_ids
                  for i in range(cfg["batch"])):
        engine.step()
    prefill = time.perf_counter() - t0
    torch.set_num_threads(decode_threads)
    first = engine.store.stats.snapshot().transfer_bytes
    for _ in range(3):
        engine.step()
    disk = engine.store.tiers.disk_tier
    snap = engine.store.stats.snapshot()
    per_path0 = disk.per_path() if hasattr(disk, "per_path") else {}
    # the first decode steps after the prefills: what the placement left to read
    first_disk = (snap.transfer_bytes.get(("disk", "device"), 0)
                  - first.get(("disk", "device"), 0)) / 3
    before, before_rec = snap.transfer_bytes, getattr(snap, "recomputed", {})
    reads0 = (disk.bytes_read, disk.preadv_calls) if disk is not None else (0, 0)
    walls = []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    st = engine.store.stats.snapshot()
    moved = {f"{a}->{b}": (v - before.get((a, b), 0)) / cfg["steps"]
             for (a, b), v in st.transfer_bytes.items()}
    reads = (disk.bytes_read, disk.preadv_calls) if disk is not None else (0, 0)
    rec = getattr(engine.store.tiers, "recompute", None)      # KV recompute (older: none)
    extra = {} if rec is None else {
        "recompute_cost": dataclasses.asdict(rec.cost),
        "recomputed_per_step": (st.recomputed.get("disk", 0)
                                - before_rec.get("disk", 0)) / cfg["steps"]}
    extra["first_steps_disk_bytes_per_step"] = first_disk
    if per_path0:           # a disk set: what each folder read per timed step
        extra["per_path_read_bytes_per_step"] = {
            p: (c["bytes_read"] - per_path0[p]["bytes_read"]) / cfg["steps"]
            for p, c in disk.per_path().items()}
    extra["hits"] = {t: st.hits.get(t, 0) - snap.hits.get(t, 0) for t in st.lookups}
    extra["lookups"] = {t: st.lookups.get(t, 0) - snap.lookups.get(t, 0) for t in st.lookups}
    print(json.dumps({**extra, "prefill_s": prefill, "step_ms": [1e3 * w for w in walls],
                      "tiers": engine.store.tier_usage(),
                      "transfer_bytes": {f"{a}->{b}": v for (a, b), v
                                         in st.transfer_bytes.items()},
                      # per timed step: what the store moved between tiers (pages x their
                      # bytes), and what the disk reads asked of the drive (gap pages too)
                      "bytes_per_step": moved,
                      "disk_read_bytes_per_step": (reads[0] - reads0[0]) / cfg["steps"],
                      "disk_reads_per_step": (reads[1] - reads0[1]) / cfg["steps"],
                      "disk_page_bytes": disk.page_bytes if disk is not None else 0,
                      "disk_coded_layers": getattr(engine.store.tiers, "coded_layers", None),
                      "max_pages": engine.store.max_pages}))


def run_arm(name: str, root: Path, over: dict, args) -> dict:
    disk = KV_TMP / f"kv_ab-{name}"
    over = dict(over)
    folders = int(over.pop("disk_folders", 1))      # several: a disk set (one folder per drive)
    path = ",".join(str(disk / f"d{i}") for i in range(folders)) if folders > 1 else str(disk)
    engine = {**BASE, "kv_disk_path": path, **over}
    spec = json.dumps({"engine": engine, "batch": args.batch, "context": args.context,
                       "steps": args.steps,
                       "serial_prefill": getattr(args, "serial_prefill", False),
                       "prompts": getattr(args, "prompts", "random")})
    env = dict(os.environ, PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, __file__, "--child", str(root), spec], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"arm {name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {"arm": name, "checkout": str(root), "engine": engine, **res,
            "step_ms_median": statistics.median(res["step_ms"])}


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3])
    ap = parser(__doc__)
    ap.add_argument("--arm", action="append", help="NAME=CHECKOUT:FIELD=VALUE,...")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=7000)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    add_out_arg(ap, "kv_ab")
    args = ap.parse_args(argv)
    use_checkout_cache()
    arms = [parse_arm(a) for a in (args.arm or DEFAULT_ARMS)]
    rows = []
    for r in range(args.rounds):
        for name, root, over in arms:
            print(f"round {r + 1}/{args.rounds}: {name} ({root}) ...", flush=True)
            rows.append(run_arm(name, root, over, args))
            print(f"  step {rows[-1]['step_ms_median']:.0f} ms (median), prefill "
                  f"{rows[-1]['prefill_s']:.0f} s", flush=True)
    m = machine()
    print(f"\n{cpu_line(m)}; {args.batch} x {args.context} tokens")
    print("| arm | tiers (GiB) | decode step ms (median) |\n|---|---|---|")
    for row in rows:
        tiers = ", ".join(f"{t} {cap / 2**30:.2f}" for t, (_, cap) in row["tiers"].items())
        print(f"| {row['arm']} | {tiers} | {row['step_ms_median']:.0f} |")
    write_json(args.out, {"bench": "kv_ab", "machine": m, "batch": args.batch,
                          "context": args.context, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
