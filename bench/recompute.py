"""KV recompute (KVPR, --kv-recompute): decode step time and disk bytes per step against the
share of each fill's disk pages rebuilt from their layer inputs, on a multi-head model.

    .venv/bin/python bench/recompute.py                 # 4 x 4K tokens, dense, 8 steps
    .venv/bin/python bench/recompute.py --shape small   # a narrow model (hidden 128), 8 x 4K
    .venv/bin/python bench/recompute.py --quick         # 2 x 2K tokens, 4 steps
    .venv/bin/python bench/recompute.py --replot bench/results/recompute.json

KVPR pays where a page's layer inputs are smaller than its K/V, i.e. on multi-head attention
(the bundled SmolLM2 is GQA: 576 input values a token against 384 of K/V, so `auto` stores no
inputs and recomputes nothing; tests/test_recompute.py checks that). So the bench builds a
random-weight Llama of SmolLM2's shape with 9 KV heads instead of 3 (MHA: 1152 K/V values a
token and layer against 576 inputs; `--shape smollm2`) or a narrow one (hidden 128, 2 heads of
64, 8 layers; `--shape small`: recomputing a page costs ~2 x hidden FLOPs per byte it saves,
so only a narrow model's K/V recompute is cheap enough on a CPU) and runs bench/throughput.py's
FlexGen-style row on it: dense decode, every page on disk, a small device pool, so each step reads
every page of every layer: KVPR's setting. Arms (each its own process, bench/kv_ab.py's, in turns
for --rounds): --kv-recompute off, auto and fixed shares. Per arm: median step, disk bytes per step,
pages recomputed per step, and the time the start-up cost model predicts for a fill of the step's
size at that share (relative to reading every page). Results: bench/results/recompute.json
(`--shape small`: recompute_small.json) and .png.
"""
from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (ROOT, add_out_arg, add_replot_arg, code_version,  # noqa: E402
                          cpu_line, machine, parser, pyplot, replot_or_run, save_figure)
from bench.kv_ab import run_arm  # noqa: E402

MODES = ("off", "auto", "0.1", "0.25", "0.5")
TIERS = dict(kv_device_gb=0.1, kv_host_gb=0.0, kv_disk_gb=8, sparse_budget=0,
             kv_force_tier="disk", prefix_cache="off", max_model_len=8192)


# multi-head (as many KV heads as heads) random-weight Llamas: SmolLM2-135M's shape with 9 KV
# heads instead of 3, and a narrow one
SHAPES = {"smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9),
          "small": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=8,
                        num_attention_heads=2)}


def mha_model(folder: Path, shape: str) -> Path:
    """A random-weight multi-head Llama of `shape`; built once (~30 s)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    dims = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=49152, **dims, num_key_value_heads=dims["num_attention_heads"],
                      max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
                      torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return folder


def predicted_extra_ms(cost: dict, pages: int, share: float | None, layers: int) -> float:
    """What the cost model (as the arm left it: its recompute time follows the measured
    rebuilds) predicts the step gains (< 0) or loses by recomputing `share` of each layer's
    fill of `pages` pages (None: its own split)."""
    from kvstore.recompute import RecomputeCost
    c = RecomputeCost(**cost)
    s = c.split(pages) if share is None else round(share * pages)
    # NOTE: a dense sequential step fills once per layer
    return 1e3 * layers * (c.seconds(pages, s) - c.seconds(pages, 0))


def run(args) -> dict:
    model = mha_model(ROOT / ".cache" / "bench" / f"mha-{args.shape}", args.shape)  # ignored
    layers = SHAPES[args.shape]["num_hidden_layers"]
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            print(f"round {r + 1}/{args.rounds}: --kv-recompute {mode} ...", flush=True)
            over = {**TIERS, "model": str(model), "kv_recompute": mode}
            res = run_arm(f"recompute-{mode}", Path(__file__).resolve().parents[1], over, args)
            shutil.rmtree(res["engine"]["kv_disk_path"], ignore_errors=True)
            runs[mode].append(res)
            print(f"  step {res['step_ms_median']:.0f} ms, disk -> device "
                  f"{res['bytes_per_step'].get('disk->device', 0) / 2**20:.1f} MiB/step, "
                  f"recomputed {res.get('recomputed_per_step', 0):.0f} pages/step", flush=True)
    pages = args.batch * -(-args.context // 16)         # a layer's fill: every page
    rows = {}
    for mode, rs in runs.items():
        cost = next((x["recompute_cost"] for x in rs if "recompute_cost" in x), None)
        rows[mode] = {
            "step_ms_median": statistics.median(s for x in rs for s in x["step_ms"]),
            "disk_to_device_bytes_per_step": statistics.median(
                x["bytes_per_step"].get("disk->device", 0) for x in rs),
            "recomputed_per_step": statistics.median(x.get("recomputed_per_step", 0)
                                                     for x in rs),
            "cost": cost,
            "predicted_extra_ms": 0.0 if cost is None else predicted_extra_ms(
                cost, pages, None if mode == "auto" else float(mode), layers),
            "rounds": len(rs)}
    base = rows.get("off")
    for row in rows.values():
        if base is not None:
            row["step_vs_off"] = row["step_ms_median"] / base["step_ms_median"]
            row["predicted_step_ms"] = base["step_ms_median"] + row["predicted_extra_ms"]
    return {"bench": "recompute", "machine": machine(), "code": code_version(),
            "model": f"random-weight MHA, {args.shape}: hidden "
                     f"{SHAPES[args.shape]['hidden_size']}, {layers} layers",
            "shape": args.shape, "batch": args.batch,
            "context": args.context, "steps": args.steps, "tiers": TIERS,
            "pages_per_fill": pages, "modes": rows}


def report(res: dict) -> str:
    lines = [f"{cpu_line(res['machine'])}; {res['model']}; {res['batch']} x {res['context']} "
             f"tokens, dense, every page on disk ({res['pages_per_fill']} pages a layer's fill)",
             "| --kv-recompute | pages recomputed/step | disk -> device MiB/step | decode step "
             "ms | step vs off | cost model's step ms | recompute us/page (model) |",
             "|---|---|---|---|---|---|---|"]
    for mode, row in res["modes"].items():
        c = "-" if row["cost"] is None else f"{row['cost']['compute_page_s'] * 1e6:.0f}"
        lines.append(f"| {mode} | {row['recomputed_per_step']:.0f} | "
                     f"{row['disk_to_device_bytes_per_step'] / 2**20:.1f} | "
                     f"{row['step_ms_median']:.0f} | {row.get('step_vs_off', 1.0):.3f} | "
                     f"{row.get('predicted_step_ms', row['step_ms_median']):.0f} | "
                     f"{c} |")
    cost = next((r["cost"] for r in res["modes"].values() if r["cost"]), None)
    if cost:
        lines.append(f"disk probe at start-up: a page's inputs {cost['input_page_s'] * 1e6:.1f} "
                     f"us, its K/V {cost['kv_page_s'] * 1e6:.1f} us")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    modes = list(res["modes"])
    steps = [res["modes"][m]["step_ms_median"] for m in modes]
    ax.bar(range(len(modes)), steps, color=["#888" if m == "off" else "#3a7" for m in modes])
    for i, m in enumerate(modes):
        r = res["modes"][m]
        ax.annotate(f"{r['recomputed_per_step']:.0f} pages\n"
                    f"{r['disk_to_device_bytes_per_step'] / 2**20:.0f} MiB", (i, steps[i]),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(modes)), [f"--kv-recompute {m}" for m in modes], rotation=15,
                  fontsize=7)
    ax.set_ylabel("decode step, ms (median)")
    ax.set_title(f"KV recompute, {res['model']}, {res['batch']} x {res['context']} tokens, "
                 f"dense from disk\n{cpu_line(res['machine'])}", fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    ap.add_argument("--batch", type=int, default=None, help="default 4 (smollm2), 8 (small)")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=None, help="default 8 (smollm2), 16 (small)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--quick", action="store_true", help="2 x 2K tokens, 4 steps")
    add_out_arg(ap, "recompute", quick=True)
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    small = args.shape == "small"
    args.batch = args.batch or (8 if small else 4)
    args.steps = args.steps or (16 if small else 8)
    if args.quick:
        args.batch, args.context, args.steps = 2, 2000, 4
    replot_or_run(args, "recompute" + ("_small" if small else ""), run, plot, report)


if __name__ == "__main__":
    main()
