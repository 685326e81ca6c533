"""KV memory of a sliding-window model: its windowed layers' old pages dropped (the default)
against --swa-full (every layer's whole context kept), on a Gemma-3-1B-shaped checkpoint.

    .venv/bin/python bench/window_trim.py        # bench/results/window_trim.json and .png
    .venv/bin/python bench/window_trim.py --replot bench/results/window_trim.json

In process, one engine a variant: one request of --context prompt tokens and --decode more
(greedy, random weights from bench/random_model.py: only bytes and times mean anything), the
prompts one after the other, then the decode steps alternating; after every step the device
tier's KV bytes. Reports the longest request --kv-device-gb holds, the peak KV bytes, the
prefill's seconds and the median decode step.
"""
from __future__ import annotations

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


class Variant:
    """One engine (--swa-full or not) serving one request, its KV bytes after every step."""

    def __init__(self, model: Path, swa_full: bool, args):
        import torch

        from engine.args import EngineArgs
        from engine.llm_engine import LLMEngine
        from scheduler.sampling_params import SamplingParams

        self.engine = LLMEngine(EngineArgs(model=str(model), kv_device_gb=args.kv_device_gb,
                                           swa_full=swa_full, prefix_cache="off"))
        ids = torch.randint(3, 49152, (args.context,),
                            generator=torch.Generator().manual_seed(0)).tolist()
        self.engine.add_request("r", ids, SamplingParams(max_tokens=args.decode,
                                                         temperature=0.0, ignore_eos=True))
        self.series, self.decode_ms, self.prefill_s = [], [], None

    def step(self) -> bool:
        """One step (timed as a decode once the prompt is in); True when it gave a token."""
        t = time.perf_counter()
        outs = self.engine.step()
        if self.prefill_s is not None:
            self.decode_ms.append(1e3 * (time.perf_counter() - t))
        req = self.engine.scheduler.get_request("r")
        if req is not None:             # (its pages are gone once it ended)
            self.series.append([req.num_computed_tokens,
                                self.engine.store.tier_usage()["device"][0]])
            print(f"  {self.series[-1][0]:>6} tokens: {self.series[-1][1] / 2**20:8.1f} MiB",
                  end="\r", file=sys.stderr)
        return any(o.new_token_ids for o in outs)

    @property
    def running(self) -> bool:
        return self.engine.has_unfinished()

    def prefill(self) -> None:
        t0 = time.perf_counter()
        while not self.step():
            pass
        self.prefill_s = time.perf_counter() - t0
        print(file=sys.stderr)

    def row(self) -> dict:
        store = self.engine.store
        return {"capacity_tokens": store.capacity_tokens(),
                "peak_kv_bytes": max(b for _, b in self.series),
                "kv_bytes_per_token_all_layers": store.page_shape.nbytes * store.num_layers
                // store.page_size,
                "prefill_s": round(self.prefill_s, 2),
                "decode_ms": round(statistics.median(self.decode_ms), 1)
                if self.decode_ms else None,
                "series": self.series}


def run(model: Path, args) -> dict:
    """Each variant's prompt in turn, then their decode steps alternating (the order flipped
    every step), so the two decode columns share the machine's moment."""
    variants = {}
    for name, swa_full in VARIANTS.items():
        print(f"{name}:", file=sys.stderr)
        variants[name] = Variant(model, swa_full, args)
        variants[name].prefill()
    turn = 0
    while any(v.running for v in variants.values()):
        order = list(variants.values())
        for v in (order if turn % 2 == 0 else order[::-1]):
            if v.running:
                v.step()
        turn += 1
    print(file=sys.stderr)
    return {name: v.row() for name, v in variants.items()}


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
    rep["variants"] = run(model, args)
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
