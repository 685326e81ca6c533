"""Prefix reuse over the HTTP API: multi-turn chat over a long document, many clients asking
about one document, and the first repeated request after a restart; Strata with and without
its prefix cache, and llama.cpp's server (its prompt cache) where it is installed.

    .venv/bin/python bench/prefix.py                   # ~7K-token chat, 8 clients x ~6K, restart
    .venv/bin/python bench/prefix.py --quick           # ~2K and ~1.5K tokens, 3 turns, 4 clients
    .venv/bin/python bench/prefix.py --replot bench/results/prefix.json
    .venv/bin/python bench/prefix.py --systems strata --keep bench/results/prefix.json
                                                       # rerun Strata, keep the other systems

Workloads (greedy, streamed; TTFT = send to the first chunk with text):
- multi-turn: a user message of an essay cut to --context tokens and a question, then --turns
  turns, each resending the whole conversation (the document, every question and answer) and
  a new question, --answer tokens each. TTFT per turn.
- shared: --clients requests sent at once, one document of --shared-context tokens, a
  different question each: TTFT p50 / p99 and the wall time from the first send to the last
  token.
- restart: Strata with the cache on a disk tier (--kv-disk-gb, a fresh folder): one request
  cold, the server stopped (SIGTERM) and started again on the same --kv-disk-path, then the
  same request: its TTFT and the restart's time to ready.
Systems: strata (`--prefix-cache on`, the default, with `--kv-disk-gb 4` on a fresh folder),
strata-nocache (`--prefix-cache off`), llama.cpp (`llama-server -np 1`, multi-turn only:
`cache_prompt` keeps one slot's prompt; built by `make peers`). Results: bench/results/
prefix.json and prefix.png; `usage.prompt_tokens_details.cached_tokens` per request.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (KV_TMP, LOGS, add_out_arg, add_replot_arg, essay_ids,  # noqa: E402
                          parser, pct, pyplot, read_json, result_header, result_path, save_figure,
                          tokenizer, use_checkout_cache, write_json)
from bench.servers import start_server, stop  # noqa: E402
from bench.peers import llamacpp  # noqa: E402

use_checkout_cache()
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the main argument of the text?", "Which examples does it give?",
             "What would a critic say?", "Summarize it in one sentence.",
             "What is the most surprising claim?", "Who is the intended reader?",
             "What is left unsaid?", "Which part is weakest?"]
STRATA_FLAGS = ["--max-model-len", "8192", "--max-num-seqs", "16", "--kv-disk-gb", "4"]


# ------------------------------------------------------------------------------ one request
async def chat(http, base: str, messages: list[dict], max_tokens: int, extra: dict) -> dict:
    """One streamed greedy chat completion: TTFT, text, cached prompt tokens."""
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    ttft, text, usage, timings = None, [], {}, {}
    async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", timings.get("cache_n"))
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens", timings.get("prompt_n")),
            "cached_tokens": cached}


# ------------------------------------------------------------------------------ workloads
async def multi_turn(base: str, doc: str, turns: int, answer: int, extra: dict) -> list[dict]:
    import httpx
    messages = [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}]
    out = []
    async with httpx.AsyncClient(timeout=600) as http:
        for t in range(turns):
            r = await chat(http, base, messages, answer, extra)
            out.append({k: v for k, v in r.items() if k != "text"})
            print(f"  turn {t + 1}: TTFT {r['ttft_s']:.2f} s, cached {r['cached_tokens']} of "
                  f"{r['prompt_tokens']} tokens", flush=True)
            messages += [{"role": "assistant", "content": r["text"]},
                         {"role": "user", "content": QUESTIONS[(t + 1) % len(QUESTIONS)]}]
    return out


async def shared(base: str, doc: str, clients: int, answer: int) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=900) as http:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[
            chat(http, base, [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[i % 8]}"}],
                 answer, {}) for i in range(clients)])
        wall = time.perf_counter() - t0
    ttfts = [r["ttft_s"] for r in rs]
    res = {"clients": clients, "wall_s": wall, "ttft_p50_s": statistics.median(ttfts),
           "ttft_p99_s": pct(ttfts, 99), "cached_tokens": [r["cached_tokens"] for r in rs]}
    print(f"  {clients} clients: wall {wall:.1f} s, TTFT p50 {res['ttft_p50_s']:.2f} s, "
          f"p99 {res['ttft_p99_s']:.2f} s", flush=True)
    return res


async def one(base: str, doc: str, answer: int) -> dict:
    import httpx
    async with httpx.AsyncClient(timeout=600) as http:
        r = await chat(http, base, [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}],
                       answer, {})
    return {k: v for k, v in r.items() if k != "text"}


# ------------------------------------------------------------------------------ systems
def strata_flags(name: str, disk: Path) -> list[str]:
    return [*STRATA_FLAGS, "--kv-disk-path", str(disk),
            *(["--prefix-cache", "off"] if name == "strata-nocache" else [])]


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def run_strata(name: str, docs: dict, args) -> dict:
    res = {}
    for workload in ("multi_turn", "shared"):
        disk = fresh(KV_TMP / f"prefix-{name}")
        proc, base = start_server(strata_flags(name, disk), LOGS / f"prefix-{name}.log")
        try:
            print(f"{name}: {workload}", flush=True)
            if workload == "multi_turn":
                res[workload] = asyncio.run(multi_turn(base, docs["turns"], args.turns,
                                                       args.answer, {}))
            else:
                res[workload] = asyncio.run(shared(base, docs["shared"], args.clients,
                                                   args.answer))
        finally:
            stop(proc)
    return res


def run_restart(docs: dict, args) -> dict:
    disk = fresh(KV_TMP / "prefix-restart")
    flags = strata_flags("strata", disk)
    log = LOGS / "prefix-restart.log"
    proc, base = start_server(flags, log)
    try:
        cold = asyncio.run(one(base, docs["turns"], args.answer))
    finally:
        stop(proc)
    t0 = time.perf_counter()
    proc, base = start_server(flags, log)
    ready = time.perf_counter() - t0
    try:
        warm = asyncio.run(one(base, docs["turns"], args.answer))
    finally:
        stop(proc)
    shutil.rmtree(disk, ignore_errors=True)
    print(f"restart: cold TTFT {cold['ttft_s']:.2f} s; after a restart ({ready:.1f} s to "
          f"ready) {warm['ttft_s']:.2f} s, cached {warm['cached_tokens']}", flush=True)
    return {"cold": cold, "after_restart": warm, "restart_ready_s": ready}


def run_llamacpp(docs: dict, args) -> dict | None:
    if llamacpp.find_binary() is None:
        print(f"llama.cpp: skipped ({llamacpp.missing_message()})")
        return None
    server = llamacpp.start(LOGS / "prefix-llama.cpp.log", 1, 8192)
    try:
        print("llama.cpp: multi_turn", flush=True)
        turns = asyncio.run(multi_turn(server.base, docs["turns"], args.turns, args.answer,
                                       {"cache_prompt": True}))
    finally:
        stop(server.proc)
    return {"multi_turn": turns, "command": server.cmd, "version": server.version}


# ------------------------------------------------------------------------------ main
def documents(context: int, shared_context: int) -> dict:
    tok = tokenizer()
    ids = essay_ids(tok)
    return {"turns": tok.decode(ids[:context]),
            "shared": tok.decode(ids[50_000:50_000 + shared_context])}


def plot(rep: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    for name, res in rep["systems"].items():
        turns = res.get("multi_turn") if res else None
        if turns:
            ax.plot(range(1, len(turns) + 1), [t["ttft_s"] for t in turns], marker="o",
                    label=name)
    ax.set(xlabel="turn", ylabel="TTFT (s)", yscale="log",
           title=f"multi-turn chat over ~{rep['settings']['context']} tokens")
    ax.legend()
    ax = axes[1]
    names = [n for n, r in rep["systems"].items() if r and r.get("shared")]
    x = range(len(names))
    for k, (key, label) in enumerate((("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"),
                                      ("wall_s", "total"))):
        ax.bar([i + 0.27 * (k - 1) for i in x],
               [rep["systems"][n]["shared"][key] for n in names], 0.27, label=label)
    ax.set_xticks(list(x), names)
    ax.set(ylabel="s", title=f"{rep['settings']['clients']} clients, one "
                             f"~{rep['settings']['shared_context']}-token document")
    ax.legend()
    ax = axes[2]
    r = rep.get("restart") or {}
    if r:
        ax.bar(["cold", "after restart"], [r["cold"]["ttft_s"], r["after_restart"]["ttft_s"]])
    ax.set(ylabel="TTFT (s)", title="the same request, before and after a restart")
    fig.suptitle(f"Prefix reuse ({rep['machine'].get('cpu', '?')}, "
                 f"{rep['machine'].get('cores', '?')} cores)")
    save_figure(fig, path)


def build_parser():
    ap = parser(__doc__)
    ap.add_argument("--context", type=int, default=7000, help="multi-turn document tokens")
    ap.add_argument("--shared-context", type=int, default=6000,
                    help="shared document tokens")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--answer", type=int, default=32, help="tokens per answer")
    ap.add_argument("--systems", nargs="*", default=["strata", "strata-nocache", "llama.cpp"],
                    choices=["strata", "strata-nocache", "llama.cpp"])
    ap.add_argument("--no-restart", action="store_true", help="skip the restart workload")
    ap.add_argument("--keep", default=None, metavar="JSON",
                    help="take the systems not run from this result (each keeps the code "
                         "version it was measured with)")
    ap.add_argument("--quick", action="store_true",
                    help="~2K / ~1.5K tokens, 3 turns, 4 clients, 16-token answers")
    add_out_arg(ap, "prefix", quick=True)
    add_replot_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.replot:
        plot(read_json(args.replot), Path(args.replot).with_suffix(".png"))
        return
    if args.quick:
        args.context, args.shared_context, args.turns, args.clients, args.answer = \
            2000, 1500, 3, 4, 16
    docs = documents(args.context, args.shared_context)
    rep = {**result_header("prefix"),
           "settings": {k: getattr(args, k) for k in ("context", "shared_context", "turns",
                                                      "clients", "answer")},
           "strata_flags": STRATA_FLAGS, "systems": {}}
    if args.keep:
        old = read_json(args.keep)
        for name, res in old["systems"].items():
            if name not in args.systems and res:
                rep["systems"][name] = {**res, "code_version": old["code_version"]}
    for name in args.systems:
        rep["systems"][name] = run_llamacpp(docs, args) if name == "llama.cpp" \
            else run_strata(name, docs, args)
    if not args.no_restart:
        rep["restart"] = run_restart(docs, args)
    out = write_json(result_path(args.out, "prefix", args.quick), rep)
    plot(rep, out.with_suffix(".png"))
    shutil.rmtree(KV_TMP, ignore_errors=True)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
