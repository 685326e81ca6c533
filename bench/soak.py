"""Soak: many clients for minutes against one server spilling to disk, some of them hanging
up mid-stream; the server must fail no request and hold its memory and open files flat.

    .venv/bin/python bench/soak.py --clients 32 --minutes 10            # the issue's run
    .venv/bin/python bench/soak.py --clients 4 --minutes 0.5 --out /tmp/soak.json  # quick

Starts `strata serve` with a small device and host tier and a disk tier (unless --url), then
runs --clients loops until the time is up. Each loop sends a chat request of a random length
(short, medium, long), streaming or not, and with probability --disconnect streams and hangs
up after the first chunks. Every 2 s it samples the server's RSS and open files
(/proc/<pid>). Reports requests, failures (any error that is not our own hang-up), latency
percentiles, and RSS / open files after the warm-up against the end; writes JSON and a plot.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (add_out_arg, parser, pct, proc_memory, pyplot,  # noqa: E402
                          result_header, save_figure, write_json)
from bench.servers import server_or_url  # noqa: E402

SERVER_ARGS = ("--kv-device-gb 0.1 --kv-host-gb 0.05 --kv-disk-gb 2 --max-num-seqs 8 "
               "--max-waiting 512")
WORDS = ("disk page cache token layer stream memory budget request server latency queue "
         "sparse attention kernel").split()
LENGTHS = {"short": 20, "medium": 300, "long": 1500}          # words


def prompt(rng: random.Random) -> str:
    kind = rng.choice(list(LENGTHS))
    words = " ".join(rng.choice(WORDS) for _ in range(LENGTHS[kind]))
    return f"Summarize these notes in one sentence: {words}"


async def one(http: httpx.AsyncClient, rng: random.Random, disconnect: float) -> dict:
    body = {"messages": [{"role": "user", "content": prompt(rng)}],
            "max_tokens": rng.randint(4, 32), "temperature": rng.choice([0.0, 0.8])}
    hang_up = rng.random() < disconnect
    stream = hang_up or rng.random() < 0.5
    t0 = time.perf_counter()
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        return {"ok": ok, "status": r.status_code, "s": time.perf_counter() - t0,
                "kind": "json", "error": None if ok else r.text[:200]}
    chunks = 0
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "s": time.perf_counter() - t0,
                    "kind": "stream", "error": (await r.aread()).decode()[:200]}
        error = None
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"error"' in line:
                error = line[:200]
            chunks += line.startswith("data: ")
            if hang_up and chunks >= 2:
                break                                   # leave mid-stream: our own doing
    return {"ok": error is None, "status": 200, "s": time.perf_counter() - t0,
            "kind": "hang-up" if hang_up else "stream", "error": error}


def sample(pid: int | None) -> dict:
    if pid is None:
        return {}
    return {"rss_mb": proc_memory(pid)["VmRSS"] / 2**20,
            "open_files": len(os.listdir(f"/proc/{pid}/fd"))}


async def soak(base: str, pid: int | None, clients: int, seconds: float,
               disconnect: float, seed: int) -> dict:
    deadline = time.monotonic() + seconds
    results, samples = [], []
    bar = tqdm(total=int(seconds), desc=f"soak {clients} clients", unit="s")
    t_start = time.monotonic()

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            while time.monotonic() < deadline:
                try:
                    results.append(await one(http, rng, disconnect))
                except Exception as exc:  # noqa: BLE001 - a failure to count, not to crash on
                    results.append({"ok": False, "status": None, "s": float("nan"),
                                    "kind": "exception", "error": repr(exc)[:200]})

    async def sampler() -> None:
        while time.monotonic() < deadline:
            samples.append({"t": time.monotonic() - t_start, **sample(pid)})
            bar.n = min(int(time.monotonic() - t_start), int(seconds))
            bar.set_postfix(requests=len(results), failed=sum(not r["ok"] for r in results))
            await asyncio.sleep(2)

    await asyncio.gather(sampler(), *(client(i) for i in range(clients)))
    bar.close()
    samples.append({"t": time.monotonic() - t_start, **sample(pid)})
    return {"results": results, "samples": samples}


def report(run: dict, args) -> dict:
    results, samples = run["results"], run["samples"]
    done = [r["s"] for r in results if r["ok"] and r["kind"] != "hang-up"]
    failed = [r for r in results if not r["ok"]]
    warm = [s for s in samples if s["t"] >= min(60.0, args.minutes * 60 / 3)] or samples
    flat = {}
    for key in ("rss_mb", "open_files"):
        if warm and key in warm[0]:
            flat[key] = {"after_warmup": warm[0][key], "end": samples[-1][key],
                         "max": max(s[key] for s in warm)}
    return {**result_header("soak"), "clients": args.clients,
            "minutes": args.minutes, "disconnect": args.disconnect,
            "server_args": args.server_args, "requests": len(results),
            "hang_ups": sum(r["kind"] == "hang-up" for r in results),
            "failed": len(failed), "failures": failed[:20],
            "latency_s": {"p50": pct(done, 50), "p99": pct(done, 99)}, "flat": flat,
            "samples": samples}


def plot(summary: dict, path: Path) -> None:
    samples = [s for s in summary["samples"] if "rss_mb" in s]
    if not samples:
        return
    fig, ax = pyplot().subplots(figsize=(7, 3.2))
    t = [s["t"] / 60 for s in samples]
    ax.plot(t, [s["rss_mb"] for s in samples], label="RSS (MB)")
    ax2 = ax.twinx()
    ax2.plot(t, [s["open_files"] for s in samples], color="tab:orange", label="open files")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (MB)")
    ax2.set_ylabel("open files")
    ax.set_title(f"soak: {summary['clients']} clients, {summary['requests']} requests, "
                 f"{summary['failed']} failed")
    fig.legend(loc="lower right")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--disconnect", type=float, default=0.1,
                    help="share of requests that hang up mid-stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None, help="an already running server (no RSS sampling)")
    ap.add_argument("--server-args", default=SERVER_ARGS,
                    help="flags of the server it starts, one string (--server-args='...')")
    add_out_arg(ap, "soak")
    args = ap.parse_args(argv)
    with server_or_url(args.url, shlex.split(args.server_args), api="") as (proc, base):
        run = asyncio.run(soak(base, proc.pid if proc else None, args.clients,
                               args.minutes * 60, args.disconnect, args.seed))
    summary = report(run, args)
    out = write_json(args.out, summary)
    plot(summary, out.with_suffix(".png"))
    print(f"{summary['requests']} requests ({summary['hang_ups']} hung up on purpose), "
          f"{summary['failed']} failed; latency p50 {summary['latency_s']['p50']:.2f} s, "
          f"p99 {summary['latency_s']['p99']:.2f} s; {json.dumps(summary['flat'])}")
    for f in summary["failures"][:5]:
        print("  failed:", f)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
