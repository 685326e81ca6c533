"""One GGUF served with and without a dense copy of its weights (`--prefill-weights dense`
against `staged`): memory, start-up, prefill and decode, in-process, one process a run.

    .venv/bin/python bench/prefill_weights.py                         # 1B Q4_K_M, ~4 min
    .venv/bin/python bench/prefill_weights.py --shape llama-3.1-8b --modes staged
    .venv/bin/python bench/prefill_weights.py --replot bench/results/<its json>
    .venv/bin/python bench/prefill_weights.py --matmuls        # one matmul of each form, ~1 min

The file: bench/gguf_peer.py's (a public model's shape, random weights, written once under
/tmp/strata-bench). Each mode runs in a child process of its own (its memory counted from a
clean start), --rounds rounds in turns: an LLMEngine with the server's defaults and
`--prefill-weights <mode>`; its RSS and peak RSS once built, and the seconds it took; one
--prompt-tokens random-token prompt prefilled (its steps until the first token); then
--decode decode steps (median). Medians over the rounds. Results:
bench/results/prefill-weights-<shape>-<quant>.json and .png.

--matmuls: the three matmuls of a Llama-3.1-8B layer (q|k|v, gate|up, down) at --rows rows
(default 512), random weights in q4: our integer kernel, the staged bf16 form, and its
dequantization alone; the best of 3 each, on the torch threads (2 unless --threads).
bench/results/prefill-weights-matmuls.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (RESULTS, add_replot_arg, bar_panels, cpu_line,  # noqa: E402
                          machine, parser, proc_memory, read_json, time_calls, write_json)

MEASURES = [("rss_gb", "RSS once built (GB)"), ("start_s", "start-up (s)"),
            ("prefill_tok_s", "prefill (tokens/s)"), ("decode_ms", "decode (ms a token)")]


def child(model: str, mode: str, prompt_tokens: int, decode: int) -> dict:
    """One run in this process (the engine's own imports: after the parent's parsing)."""
    import torch
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    t0 = time.perf_counter()
    args = EngineArgs(model=model, prefill_weights=mode, max_model_len=4096)
    engine = LLMEngine(args)
    engine.use_threads(*args.torch_threads())
    start, mem = time.perf_counter() - t0, proc_memory()
    ids = torch.randint(100, 40000, (prompt_tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r0", ids, SamplingParams(max_tokens=decode + 2, temperature=0,
                                                 ignore_eos=True))
    t0 = time.perf_counter()
    while not engine.scheduler.get_request("r0").output_token_ids:
        engine.step()
    prefill = time.perf_counter() - t0
    steps = time_calls(engine.step, decode, warmup=0)
    return {"keep_dense": engine.weight_plan.keep_dense, "rss_gb": mem["VmRSS"] / 1e9,
            "peak_gb": proc_memory()["VmHWM"] / 1e9, "start_s": start,
            "prefill_tok_s": prompt_tokens / prefill,
            "decode_ms": 1e3 * statistics.median(steps)}


def matmuls(rows: int, threads: int) -> list[dict]:
    """Seconds of each form of the 8B's matmuls at `rows` rows (best of 3)."""
    import torch
    from kernels.packed_linear import PackedWeight, StagedWeight
    from kernels.threads import share_torch_openmp
    share_torch_openmp()
    torch.set_num_threads(threads)
    gen, out = torch.Generator().manual_seed(0), []
    for name, (n, k) in {"q|k|v": (6144, 4096), "gate|up": (28672, 4096),
                         "down": (4096, 14336)}.items():
        packed = PackedWeight.from_dense(torch.randn(n, k, generator=gen) * 0.02, "q4")
        staged, x = StagedWeight(packed, "bf16"), torch.randn(rows, k, generator=gen)
        best = {}
        for form, fn in (("packed", lambda: packed.mm(x)), ("staged", lambda: staged.mm(x)),
                         ("dequantize", staged.dense)):
            best[form] = min(time_calls(fn, 3))
        out.append({"matmul": name, "shape": [n, k], **{f: round(1e3 * t, 2)
                                                        for f, t in best.items()}})
        print(f"| {name} ({n} x {k}) | " + " | ".join(f"{1e3 * t:.1f} ms"
                                                       for t in best.values()) + " |")
    return out


def run(args, gguf: Path) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
            print(f"round {r + 1}/{args.rounds}: {mode}", file=sys.stderr)
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--model", str(gguf),
                 "--prompt-tokens", str(args.prompt_tokens), "--decode", str(args.decode)],
                capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  {runs[mode][-1]}", file=sys.stderr)
    return {m: {"rounds": rows, **{k: round(statistics.median(x[k] for x in rows), 3)
                                    for k in rows[0] if k != "keep_dense"}}
            for m, rows in runs.items()}


def plot(rep: dict, path: Path) -> None:
    names = list(rep["modes"])
    bar_panels(names, [(label, [rep["modes"][n][key] for n in names]) for key, label in MEASURES],
               f"--prefill-weights: {rep['model']}, {rep['prompt_tokens']}-token prompt\n"
               f"{cpu_line(rep['machine'])}", path, ["tab:gray", "tab:blue"])


def main(argv: list[str] | None = None) -> None:
    from bench.gguf_random import QUANTS, SHAPES
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--quant", choices=QUANTS, default="Q4_K_M")
    ap.add_argument("--modes", nargs="+", choices=("dense", "staged"),
                    default=["dense", "staged"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--matmuls", action="store_true")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=("dense", "staged"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.child, args.prompt_tokens, args.decode)))
        return
    if args.matmuls:
        print(f"| matmul ({args.rows} rows) | packed q4 | staged bf16 | dequantization |")
        print("|---|---|---|---|")
        rows = matmuls(args.rows, args.threads)
        write_json(RESULTS / "prefill-weights-matmuls.json",
                   {"rows": args.rows, "threads": args.threads, "machine": machine(),
                    "ms": rows})
        return
    name = f"prefill-weights-{args.shape}-{args.quant.lower()}"
    if args.replot:
        plot(read_json(args.replot), Path(args.replot).with_suffix(".png"))
        return
    from bench.gguf_peer import gguf_file
    gguf = gguf_file(args.shape, SHAPES[args.shape][1]["layers"], args.quant)
    rep = {"model": f"random {args.shape} shape, {args.quant} GGUF",
           "prompt_tokens": args.prompt_tokens, "decode": args.decode, "machine": machine(),
           "modes": run(args, gguf)}
    out = write_json(RESULTS / f"{name}.json", rep)
    plot(rep, out.with_suffix(".png"))
    print(f"{cpu_line(rep['machine'])}; {rep['model']}; {args.prompt_tokens}-token prompt")
    print("| mode | " + " | ".join(label for _, label in MEASURES) + " |")
    print("|---" * (len(MEASURES) + 1) + "|")
    for mode, row in rep["modes"].items():
        print(f"| {mode} | " + " | ".join(f"{row[k]:.2f}" for k, _ in MEASURES) + " |")


if __name__ == "__main__":
    main()
