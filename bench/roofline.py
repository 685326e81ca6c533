"""Roofline: this machine's DRAM and random-read disk bandwidth, and the fraction of each that a
Strata decode step achieves.

    .venv/bin/python bench/roofline.py                        # measure, then read throughput.json
    .venv/bin/python bench/roofline.py --quick                # 256 MiB buffers, 1 s per disk point
    .venv/bin/python bench/roofline.py --throughput bench/results/throughput.json

Measured here:
- DRAM: streaming read bandwidth (a sum and an fp32 matrix-vector product over a buffer many
  times the last-level cache) on one thread and on all cores; the best of --repeats.
- Disk: random reads with O_DIRECT (the page cache bypassed, as the disk tier reads) from a
  --disk-gib file under --path, at 64 KiB, 256 KiB and 1 MiB per read, from 1 and 8 threads,
  for --seconds each.

Achieved, per Strata cell of bench/throughput.py's JSON (one decode step at a context and a
number of requests in flight):
- DRAM bytes a step must read: the bf16 weights once (the lm-head included) plus the KV each
  request attends: every token of every layer for dense configurations; for sparse ones the dense
  layers' tokens plus, in the other layers, min(context, sparse budget) tokens per KV head;
  divided by the step time, and by the measured all-core read bandwidth;
- disk bytes per step (the disk->device and disk->host counters of /metrics) divided by the
  step time, and by the best measured random-read bandwidth.
Results: bench/results/roofline.json and .png.
"""
from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (KV_TMP, RESULTS, ROOT, add_out_arg, add_replot_arg,  # noqa: E402
                          model_folder, parser, pyplot, read_json, result_header, result_path,
                          save_figure, use_checkout_cache, write_json)

use_checkout_cache()
KIB = 1024


# ------------------------------------------------------------------------------ DRAM
def measure_dram(gib: float, repeats: int) -> dict:
    import torch
    n = int(gib * 2**30) // 4 // 4096 * 4096
    buf = torch.ones(n, dtype=torch.float32)          # touched: no first-touch faults timed
    mat, vec = buf.view(-1, 4096), torch.ones(4096)
    out = {}
    threads = torch.get_num_threads()
    for label, t in (("1 thread", 1), (f"{os.cpu_count()} threads", os.cpu_count() or 1)):
        torch.set_num_threads(t)
        best = 0.0
        for _ in range(repeats):
            # a reduction and a matrix-vector product (what decode streams); the faster counts
            for fn in (buf.sum, lambda: mat @ vec):
                t0 = time.perf_counter()
                fn()
                best = max(best, n * 4 / (time.perf_counter() - t0))
        out[label] = best / 1e9
    torch.set_num_threads(threads)
    return {"read_gbps": out, "buffer_gib": gib}


# ------------------------------------------------------------------------------ disk
def _make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    chunk = os.urandom(16 * 2**20)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _reader(path: Path, size: int, block: int, seconds: float, seed: int) -> tuple[int, int]:
    import random
    rnd = random.Random(seed)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:                                  # a filesystem without O_DIRECT
        fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(-1, block)                       # page-aligned, as O_DIRECT needs
    n_blocks = size // block
    done = reads = 0
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            done += os.preadv(fd, [buf], rnd.randrange(n_blocks) * block)
            reads += 1
    finally:
        os.close(fd)
        buf.close()
    return done, reads


def measure_disk(folder: Path, gib: float, seconds: float, blocks: list[int],
                 threads: list[int]) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "roofline.bin"
    size = int(gib * 2**30) // (16 * 2**20) * (16 * 2**20)
    _make_file(path, size)
    rows = []
    try:
        for block in blocks:
            for t in threads:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(t) as ex:
                    res = list(ex.map(lambda i: _reader(path, size, block, seconds, i), range(t)))
                wall = time.perf_counter() - t0
                total = sum(r[0] for r in res)
                rows.append({"block_kib": block // KIB, "threads": t, "gbps": total / wall / 1e9,
                             "reads_per_s": sum(r[1] for r in res) / wall})
    finally:
        path.unlink(missing_ok=True)
    return {"file_gib": size / 2**30, "seconds": seconds, "random_read": rows,
            "best_gbps": max(r["gbps"] for r in rows)}


# ------------------------------------------------------------------------------ achieved
def model_bytes() -> dict:
    """bf16 bytes of the bundled model's weights and of one token's KV in one layer."""
    cfg = read_json(model_folder() / "config.json")
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kvh) * d + heads * d * h + 3 * h * inter + 2 * h
    embed = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return {"weights": 2 * (layers * per_layer + embed + h), "kv_token_layer": 2 * 2 * kvh * d,
            "layers": layers, "kv_heads": kvh}


def _flag(flags: list[str], name: str, default: float) -> float:
    return float(flags[flags.index(name) + 1]) if name in flags else default


def achieved(throughput: dict, dram_gbps: float, disk_gbps: float,
             mb: dict | None = None) -> list[dict]:
    mb = mb or model_bytes()
    configs = throughput["settings"]["configs"]
    rows = []
    for c in throughput["cells"]:
        flags = configs.get(c["engine"])
        if flags is None or c.get("mode", "ramp") != "ramp":    # peers (no /metrics), bursts
            continue
        budget = int(_flag(flags, "--sparse-budget", 0))
        dense_layers = int(_flag(flags, "--dense-layers", 2)) if budget else mb["layers"]
        ctx = c["prompt_tokens"]
        sparse_tokens = min(ctx, budget) if budget else ctx
        kv = c["concurrency"] * mb["kv_token_layer"] * (
            dense_layers * ctx + (mb["layers"] - dense_layers) * sparse_tokens)
        dram = mb["weights"] + kv
        io = c.get("kv_bytes_per_step", {})
        disk = sum(v for k, v in io.items() if k.startswith("disk->"))
        step = c["step_s"]
        rows.append({"engine": c["engine"], "context": c["context"],
                     "concurrency": c["concurrency"], "step_s": step,
                     "dram_bytes_per_step": dram, "dram_gbps": dram / step / 1e9,
                     "dram_fraction": dram / step / 1e9 / dram_gbps,
                     "disk_bytes_per_step": disk, "disk_gbps": disk / step / 1e9,
                     "disk_fraction": disk / step / 1e9 / disk_gbps})
    return rows


def plot(report: dict, png: Path) -> None:
    rows = report.get("achieved", [])
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 3.8))
    dram = report["dram"]["read_gbps"]
    disk = report["disk"]
    ax = axes[0]
    labels = [f"{k}" for k in dram]
    ax.bar(labels, list(dram.values()), color="#bbb", label="measured read bandwidth")
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    top = max((r["context"], r["concurrency"]) for r in rows) if rows else None
    if rows:
        sel = [r for r in rows if (r["context"], r["concurrency"]) == top]
        ax.bar([r["engine"] for r in sel], [r["dram_gbps"] for r in sel], color="#4a7",
               label=f"decode step, {top[0] // 1000}K x {top[1]}")
    ax.set_ylabel("GB/s")
    ax.set_title("DRAM")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    ax = axes[1]
    for t in sorted({r["threads"] for r in disk["random_read"]}):
        pts = [(r["block_kib"], r["gbps"]) for r in disk["random_read"] if r["threads"] == t]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"O_DIRECT random reads, {t} thread{'s' if t > 1 else ''}")
    for eng in engines:
        sel = [r for r in rows if r["engine"] == eng and r["disk_bytes_per_step"] > 0]
        if sel:
            best = max(sel, key=lambda r: r["disk_gbps"])
            ax.axhline(best["disk_gbps"], linestyle="--", linewidth=1,
                       label=f"{eng}: {best['context'] // 1000}K x {best['concurrency']}",
                       color="C3" if "flexgen" in eng else "C2")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("read size (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_title("Disk")
    ax.legend(fontsize=7)
    m = report.get("machine", {})
    fig.suptitle(f"Roofline ({m.get('cores', '?')} cores, {m.get('cpu', '')})", fontsize=10)
    save_figure(fig, png, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    ap = parser(__doc__, paragraph=True)
    ap.add_argument("--dram-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--path", default=str(KV_TMP))
    ap.add_argument("--disk-gib", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--blocks-kib", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--throughput", default=str(RESULTS / "throughput.json"))
    ap.add_argument("--quick", action="store_true")
    add_out_arg(ap, "roofline", quick=True)
    add_replot_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.replot:
        plot(read_json(args.replot), Path(args.replot).with_suffix(".png"))
        return
    if args.quick:
        args.dram_gib, args.repeats, args.disk_gib, args.seconds = 0.25, 3, 0.5, 0.5
    from tqdm import tqdm
    bar = tqdm(total=2, desc="roofline: DRAM", unit="part")
    dram = measure_dram(args.dram_gib, args.repeats)
    bar.update(1)
    bar.set_description("roofline: disk")
    disk = measure_disk(Path(args.path), args.disk_gib, args.seconds,
                        [b * KIB for b in args.blocks_kib], args.threads)
    bar.update(1)
    bar.close()
    report = {**result_header("roofline"), "dram": dram, "disk": disk, "achieved": [],
              "throughput": None}
    tp = Path(args.throughput)
    if tp.exists():
        report["throughput"] = str(tp.relative_to(ROOT) if tp.is_relative_to(ROOT) else tp)
        report["achieved"] = achieved(read_json(tp), max(dram["read_gbps"].values()),
                                      disk["best_gbps"])
    out = write_json(result_path(args.out, "roofline", args.quick), report)
    plot(report, out.with_suffix(".png"))
    for k, v in dram["read_gbps"].items():
        print(f"DRAM read, {k}: {v:.1f} GB/s")
    for r in disk["random_read"]:
        print(f"disk random read {r['block_kib']:>5} KiB x {r['threads']} threads: "
              f"{r['gbps']:.2f} GB/s")
    for r in report["achieved"]:
        print(f"{r['engine']:14} {r['context']:>5} x {r['concurrency']:>2}: DRAM "
              f"{r['dram_gbps']:5.1f} GB/s ({r['dram_fraction']:.0%}), disk {r['disk_gbps']:.2f} "
              f"GB/s ({r['disk_fraction']:.0%})")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
