"""KV memory of a sliding-window model: its windowed layers' old pages dropped (the default)
against --swa-full (every layer's whole context kept), on a Gemma-3-1B-shaped checkpoint.

    .venv/bin/python bench/window_trim.py        # bench/results/window_trim.json and .png
    .venv/bin/python bench/window_trim.py --replot bench/results/window_trim.json

In process, each variant in turn: one request of --context prompt tokens and --decode more
(greedy, random weights from bench/random_model.py: only bytes and times mean anything); after
every step the device tier's KV bytes. Reports the longest request --kv-device-gb holds, the
peak KV bytes, the prefill's seconds and the median decode step.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (RESULTS, add_out_arg, add_replot_arg, cpu_line, machine,  # noqa: E402
                          parser, read_json, write_json)

VARIANTS = {"swa-full": True, "trim": False}      # name -> --swa-full
MODEL = Path("/tmp/strata-bench/gemma3-1b")


def run_variant(model: Path, swa_full: bool, args) -> dict:
    import torch

    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=str(model), kv_device_gb=args.kv_device_gb,
                                  swa_full=swa_full, prefix_cache="off"))
    store = engine.store
    ids = torch.randint(3, 49152, (args.context,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", ids, SamplingParams(max_tokens=args.decode, temperature=0.0,
                                                ignore_eos=True))
    series, decode_ms, t0 = [], [], time.perf_counter()
    prefill_s = None
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        req = engine.scheduler.get_request("r")
        if req is not None:         # (its pages are gone once it ended)
            series.append([req.num_computed_tokens, store.tier_usage()["device"][0]])
        if prefill_s is None and any(o.new_token_ids for o in outs):
            prefill_s = time.perf_counter() - t0
        elif prefill_s is not None:
            decode_ms.append(1e3 * (time.perf_counter() - t))
        print(f"  {series[-1][0]:>6} tokens: {series[-1][1] / 2**20:8.1f} MiB", end="\r",
              file=sys.stderr)
    print(file=sys.stderr)
    row = {"capacity_tokens": store.capacity_tokens(),
           "peak_kv_bytes": max(b for _, b in series),
           "kv_bytes_per_token_all_layers": store.page_shape.nbytes * store.num_layers
           // store.page_size,
           "prefill_s": round(prefill_s, 2),
           "decode_ms": round(statistics.median(decode_ms), 1) if decode_ms else None,
           "series": series}
    del engine, store
    gc.collect()
    return row


def plot(rep: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, row in rep["variants"].items():
        xs, ys = zip(*row["series"])
        ax.plot(xs, [y / 2**20 for y in ys], label=f"{name} (peak "
                f"{row['peak_kv_bytes'] / 2**20:.0f} MiB; holds {row['capacity_tokens']} "
                "tokens)")
    ax.set_xlabel("tokens computed")
    ax.set_ylabel("KV in the device tier (MiB)")
    ax.set_title(f"{rep['model']}, --kv-device-gb {rep['kv_device_gb']}\n"
                 f"{cpu_line(rep['machine'])}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, default=None,
                    help=f"an HF folder with sliding-window layers (default: a random "
                         f"Gemma-3-1B shape, written to {MODEL} if missing)")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--kv-device-gb", type=float, default=1.0)
    add_out_arg(ap, "window_trim")
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    if args.replot:
        plot(read_json(args.replot), Path(args.replot).with_suffix(".png"))
        return
    model = args.model
    if model is None:
        model = MODEL
        if not (model / "config.json").exists():
            from bench.random_model import write
            write("gemma3-1b", model)
    rep = {"model": "random Gemma-3-1B shape" if args.model is None else str(model),
           "context": args.context, "decode": args.decode, "kv_device_gb": args.kv_device_gb,
           "machine": machine(), "variants": {}}
    for name, swa_full in VARIANTS.items():
        print(f"{name}:", file=sys.stderr)
        rep["variants"][name] = run_variant(model, swa_full, args)
    out = write_json(args.out or RESULTS / "window_trim.json", rep)
    plot(rep, out.with_suffix(".png"))
    print(f"{cpu_line(rep['machine'])}; {rep['model']}, {args.context} + {args.decode} tokens, "
          f"--kv-device-gb {args.kv_device_gb}")
    print("| variant | holds (tokens) | peak KV (MiB) | prefill (s) | decode (ms a step) |")
    print("|---|---|---|---|---|")
    for name, row in rep["variants"].items():
        print(f"| {name} | {row['capacity_tokens']} | {row['peak_kv_bytes'] / 2**20:.1f} | "
              f"{row['prefill_s']} | {row['decode_ms']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
