"""/v1/embeddings against llama.cpp's (`llama-server --embeddings --pooling last`, the same
bundled GGUF), in turns on one box: a batch of short texts and a batch of long ones per
request, the median request time of each, and how far apart the two servers' vectors are
(cosine: both pool the last token's normed hidden state and L2-normalize it). Strata runs
with --prefix-cache off, as every round resends the same texts.

    .venv/bin/python bench/embeddings.py [--rounds 5] [--short 64] [--long 8 --long-tokens 1000]

Needs `make peers` for llama.cpp; without it, Strata alone (`--no-peer`).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_out_arg, add_replot_arg, cpu_line, essay_ids, parser, pyplot,
                          replot_or_run, result_header, save_figure, tokenizer)
from bench.servers import server_or_url, stop

MODEL = "SmolLM2-135M-Instruct"


def workloads(n_short: int, n_long: int, long_tokens: int) -> dict[str, list[str]]:
    """Short texts (a sentence each) and long ones (essay passages of `long_tokens`)."""
    tok = tokenizer()
    ids = essay_ids(tok)
    short = [tok.decode(ids[i * 37:i * 37 + 24]) for i in range(n_short)]
    long = [tok.decode(ids[i * 9_973 % (len(ids) - long_tokens):][:long_tokens])
            for i in range(n_long)]
    return {"short": short, "long": long}


def embed(base: str, texts: list[str]) -> tuple[float, list[list[float]], int]:
    """(seconds, vectors, prompt tokens) of one request embedding `texts`."""
    import httpx
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/embeddings", json={"model": MODEL, "input": texts,
                                                  "encoding_format": "float"}, timeout=600)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    body = r.json()
    data = sorted(body["data"], key=lambda d: d["index"])
    return elapsed, [d["embedding"] for d in data], body["usage"]["prompt_tokens"]


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    import torch
    x, y = torch.tensor(a), torch.tensor(b)
    return torch.nn.functional.cosine_similarity(x, y, dim=-1).tolist()


def run(rounds: int, loads: dict[str, list[str]], peer: bool, long_tokens: int,
        slots: int) -> dict:
    from bench.peers import llamacpp
    servers: dict[str, str] = {}
    procs = []
    # the same texts every round: Strata's prefix cache would answer a resent text from its
    # cached pages (only the last token computed), so it is off here: compute against compute
    flags = ["--max-model-len", str(long_tokens + 64), "--prefix-cache", "off"]
    with server_or_url(None, flags, api="") as (_, base):
        servers["strata"] = base
        if peer:
            log = Path(tempfile.mkdtemp()) / "llama-server.log"
            ll = llamacpp.start(log, slots=slots, model_len=long_tokens + 64, threads=2, extra=(
                "--embeddings", "--pooling", "last", "--ubatch-size", str(long_tokens + 64),
                "--batch-size", str(long_tokens + 64)))
            procs.append(ll.proc)
            servers["llama.cpp"] = ll.base
        try:
            return _measure(servers, loads, rounds)
        finally:
            for p in procs:
                stop(p)


def _measure(servers: dict[str, str], loads: dict[str, list[str]], rounds: int) -> dict:
    times: dict[str, dict[str, list[float]]] = {s: {w: [] for w in loads} for s in servers}
    vectors: dict[str, dict[str, list]] = {s: {} for s in servers}
    tokens: dict[str, int] = {}
    for name, base in servers.items():           # warm-up: start-up timings, caches
        embed(base, loads["short"][:2])
    for _ in range(rounds):
        for w, texts in loads.items():
            for name, base in servers.items():
                elapsed, vecs, n = embed(base, texts)
                times[name][w].append(elapsed)
                vectors[name][w] = vecs
                if name == "strata":
                    tokens[w] = n
    out = {"servers": {}, "agreement": {}}
    for name in servers:
        out["servers"][name] = {w: {"request_s": statistics.median(ts),
                                    "inputs_per_s": len(loads[w]) / statistics.median(ts),
                                    "tokens_per_s": tokens[w] / statistics.median(ts)}
                                for w, ts in times[name].items()}
    if "llama.cpp" in servers:
        for w in loads:
            c = cosines(vectors["strata"][w], vectors["llama.cpp"][w])
            out["agreement"][w] = {"cosine_mean": statistics.fmean(c), "cosine_min": min(c)}
    return out


def report(result: dict) -> str:
    lines = [cpu_line(result["machine"]),
             "| texts | server | request s | inputs/s | tokens/s |", "|---|---|---|---|---|"]
    for name, ws in result["servers"].items():
        for w, r in ws.items():
            n = result["inputs"][w]
            lines.append(f"| {n} x {w} | {name} | {r['request_s']:.2f} | "
                         f"{r['inputs_per_s']:.1f} | {r['tokens_per_s']:.0f} |")
    for w, a in result["agreement"].items():
        lines.append(f"\n{w}: cosine(Strata, llama.cpp) mean {a['cosine_mean']:.4f}, "
                     f"min {a['cosine_min']:.4f}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Tokens embedded per second, per workload and server (bars)."""
    fig, ax = pyplot().subplots(figsize=(6, 3.2))
    servers = list(result["servers"])
    loads = list(result["inputs"])
    width = 0.8 / len(servers)
    for k, name in enumerate(servers):
        ax.bar([i + k * width for i in range(len(loads))],
               [result["servers"][name][w]["tokens_per_s"] for w in loads], width, label=name)
    ax.set_xticks([i + width * (len(servers) - 1) / 2 for i in range(len(loads))],
                  [f"{result['inputs'][w]} x {w}" for w in loads])
    ax.set_ylabel("tokens embedded / s")
    ax.set_title(f"/v1/embeddings, {cpu_line(result['machine'])}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--short", type=int, default=64, help="short texts per request")
    ap.add_argument("--long", type=int, default=8, help="long texts per request")
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--no-peer", action="store_true", help="Strata alone (no llama.cpp)")
    ap.add_argument("--peer-slots", type=int, default=8,
                    help="llama.cpp's --parallel (inputs it embeds at once)")
    add_out_arg(ap, "embeddings")
    add_replot_arg(ap)

    def run_all(args) -> dict:
        loads = workloads(args.short, args.long, args.long_tokens)
        return {**result_header("embeddings"), "rounds": args.rounds,
                "inputs": {w: len(t) for w, t in loads.items()},
                "long_tokens": args.long_tokens, "peer_slots": args.peer_slots,
                **run(args.rounds, loads, not args.no_peer, args.long_tokens, args.peer_slots)}
    replot_or_run(ap.parse_args(argv), "embeddings", run_all, plot, report)


if __name__ == "__main__":
    main()
