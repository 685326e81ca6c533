"""One GGUF file served by Strata and by llama.cpp's llama-server: prefill and decode speed,
one stream and four.

    .venv/bin/python bench/gguf_peer.py --shape llama-3.2-1b --quant Q4_K_M   # ~10 min
    .venv/bin/python bench/gguf_peer.py --shape qwen3-30b-a3b --layers 6      # = bench/moe.py
    .venv/bin/python bench/gguf_peer.py --replot bench/results/gguf-llama-3.2-1b-q4_k_m.json

The file (bench/gguf_random.py, written once under /tmp/strata-bench): a public model's shape
(--layers of its layers, default all) with random weights in --quant blocks, the bundled
tokenizer's 49,152-token vocabulary. Each server in turn, alone on the machine and on every
core (two cores: never both at once), with distinct random-token prompts every request (no
prompt cache hit), greedy, ignore_eos:
- prefill: a --prompt-token prompt, max_tokens 1 (the answer's time);
- decode: the same prompt length with max_tokens 1 + --decode; (t - prefill t) / --decode a
  token;
- four requests of that at once: their tokens over the time the last one took.
--rounds rounds, the servers in turns; the median of each measure over the rounds. Results:
bench/results/gguf-<shape>-<quant>.json and .png (--name: another name).
"""
from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (RESULTS, add_replot_arg, bar_panels, cpu_line,  # noqa: E402
                          machine, parser, read_json, write_json)

FILES = Path("/tmp/strata-bench")
MODEL_LEN = 4096
STREAMS = 4


class Server:
    """One engine's server on the file: its base URL, model name and request extras."""

    def __init__(self, engine: str, gguf: Path, logs: Path):
        from bench.peers import llamacpp
        from bench.servers import start_server
        self.engine, self.gguf = engine, gguf
        log = logs / f"gguf-peer-{engine}.log"
        if engine == "llama.cpp":
            srv = llamacpp.start(log, STREAMS, MODEL_LEN, model=gguf)
            self.proc, self.base, self.name = srv.proc, srv.base, llamacpp.MODEL_NAME
            self.extra = {"cache_prompt": False}
            self.version = srv.version
        else:
            self.proc, self.base = start_server(["--model", str(gguf), "--max-model-len",
                                                 str(MODEL_LEN)], log)
            self.name, self.extra, self.version = gguf.stem, {}, "this checkout"

    def complete(self, prompt: list[int], tokens: int) -> float:
        """Seconds for one request of `prompt` generating `tokens`."""
        import httpx
        t0 = time.perf_counter()
        r = httpx.post(f"{self.base}/v1/completions", timeout=900, json={
            "model": self.name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, **self.extra})
        r.raise_for_status()
        if r.json()["usage"]["completion_tokens"] != tokens:
            raise RuntimeError(f"{self.engine}: {r.json()['usage']}")
        return time.perf_counter() - t0

    def stop(self) -> None:
        from bench.servers import stop
        stop(self.proc)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def measure(srv: Server, args, rng: random.Random) -> dict:
    """One round of the three measures (after one untimed request)."""
    srv.complete(_prompt(rng, 64), 4)
    prefill = statistics.median(srv.complete(_prompt(rng, args.prompt_tokens), 1)
                                for _ in range(2))
    whole = srv.complete(_prompt(rng, args.prompt_tokens), 1 + args.decode)
    with ThreadPoolExecutor(STREAMS) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda p: srv.complete(p, 1 + args.decode),
                      [_prompt(rng, args.prompt_tokens) for _ in range(STREAMS)]))
        together = time.perf_counter() - t0
    return {"prefill_tok_s": args.prompt_tokens / prefill,
            "decode_ms": 1e3 * (whole - prefill) / args.decode,
            "streams_tok_s": STREAMS * (1 + args.decode) / together}


def run(args, gguf: Path) -> dict:
    rng, rounds = random.Random(0), {"strata": [], "llama.cpp": []}
    logs = RESULTS / "logs"
    versions = {}
    for r in range(args.rounds):
        for engine in (list(rounds) if r % 2 == 0 else list(rounds)[::-1]):
            print(f"round {r + 1}/{args.rounds}: {engine} (starting)", file=sys.stderr)
            srv = Server(engine, gguf, logs)
            versions[engine] = srv.version
            try:
                rounds[engine].append(measure(srv, args, rng))
            finally:
                srv.stop()
            print(f"  {rounds[engine][-1]}", file=sys.stderr)
    return {engine: {"version": versions[engine], "rounds": rows,
                     **{k: round(statistics.median(row[k] for row in rows), 2)
                        for k in rows[0]}} for engine, rows in rounds.items()}


def plot(rep: dict, path: Path) -> None:
    measures = [("prefill_tok_s", "prefill (tokens/s)"),
                ("decode_tok_s", "decode, 1 stream (tokens/s)"),
                ("streams_tok_s", f"{STREAMS} streams (tokens/s)")]
    names = list(rep["engines"])
    panels = [(label, [rep["engines"][n].get(key) or 1e3 / rep["engines"][n]["decode_ms"]
                       for n in names]) for key, label in measures]
    bar_panels(names, panels, f"{rep['model']}\n{cpu_line(rep['machine'])}", path,
               ["tab:blue", "tab:gray"], fmt=".1f")


def gguf_file(shape: str, layers: int, quant: str) -> Path:
    """The random GGUF of `shape` (written the first time)."""
    from bench.gguf_random import SHAPES, write
    whole = layers == SHAPES[shape][1]["layers"]
    gguf = FILES / f"{shape}{'' if whole else f'-{layers}l'}-{quant.lower()}.gguf"
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {gguf}", file=sys.stderr)
        write(shape, layers, quant, gguf)
    return gguf


def main(argv: list[str] | None = None) -> None:
    from bench.gguf_random import QUANTS, SHAPES
    ap = parser(__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--quant", choices=QUANTS, default="Q4_K_M")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default=None, help="results name (default gguf-<shape>-<quant>)")
    ap.add_argument("--out", default=None, metavar="JSON",
                    help="JSON path (default bench/results/<name>.json)")
    add_replot_arg(ap)
    args = ap.parse_args(argv)
    if args.replot:
        plot(read_json(args.replot), Path(args.replot).with_suffix(".png"))
        return
    arch, shape = SHAPES[args.shape]
    layers = args.layers or shape["layers"]
    gguf = gguf_file(args.shape, layers, args.quant)
    top = subprocess.run(["top", "-bn1"], capture_output=True, text=True).stdout
    rep = {"model": f"random {args.shape} shape ({arch}), {layers} of {shape['layers']} "
                    f"layers, {args.quant} GGUF",
           "prompt_tokens": args.prompt_tokens, "decode": args.decode,
           "machine": machine(), "load_before": top.splitlines()[:1],
           "engines": run(args, gguf)}
    for row in rep["engines"].values():
        row["decode_tok_s"] = round(1e3 / row["decode_ms"], 2)
    name = args.name or f"gguf-{args.shape}-{args.quant.lower()}"
    out = write_json(args.out or RESULTS / f"{name}.json", rep)
    plot(rep, out.with_suffix(".png"))
    print(f"{cpu_line(rep['machine'])}; {rep['model']}; {args.prompt_tokens}-token prompts, "
          f"{args.decode} decoded")
    print("| engine | prefill (tokens/s) | decode (ms a token) | "
          f"{STREAMS} streams (tokens/s) |")
    print("|---|---|---|---|")
    for engine, row in rep["engines"].items():
        print(f"| {engine} | {row['prefill_tok_s']} | {row['decode_ms']} | "
              f"{row['streams_tok_s']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
