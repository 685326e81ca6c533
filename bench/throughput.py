"""Decode throughput, TTFT and inter-token latency over context x concurrency, through the HTTP
API, for Strata's KV configurations and for peers on the same machine and model.

    .venv/bin/python bench/throughput.py                  # contexts 1K 4K 7K x concurrency 1 4 8 16
    .venv/bin/python bench/throughput.py --quick          # 1K x 1 4, dense and sparse-tiered
    .venv/bin/python bench/throughput.py --configs dense sparse-tiered --contexts 7000 \
        --concurrency 1 8 --burst 8                       # the ramp, then 8 requests at once
    .venv/bin/python bench/throughput.py --configs --peers llama.cpp   # the llama.cpp peer alone
    .venv/bin/python bench/throughput.py --replot bench/results/throughput.json

Strata configurations, one `strata serve` each on loopback with its default `--dtype auto
--weights auto` (what it logs it chose goes into settings.strata_weights): dense (all KV on the
device tier); flexgen (dense attention, every page pushed to disk after each step,
`--kv-force-tier disk`); sparse-tiered (sparse decode, budget 1024, over device 0.5 GB + host
1 GB + disk); sparse-sfc (the same with `--pipeline sfc`).

The ramp ("mode": "ramp" cells), one per context and configuration: start 1 request, wait until
it decodes (Strata: 12 more steps, while the engine times how to split the cores for the new
step shape), time --steps decode steps; add 3 more (4 in flight), wait until all decode (with
`--pipeline sfc` also until its micro-batch calibration is done, or 40 steps), time --steps
steps; then 8, then 16. A level's decode tokens/s counts every token streamed while all its
requests decode (one logprobs entry per token); its TTFT is that of the requests added at that
level (arriving while the earlier ones decode); its inter-token latency every gap between two
tokens of one request in the timed window. Prompts: Paul Graham essays cut to the context and a
question; greedy, ignore_eos; cancelled (client disconnect) after the last level.

The burst (--burst N, "mode": "burst" cells), per context after the ramp, on the same Strata
server once the ramp's requests are gone (its prefix cache may still hold the prompts the ramp
sent: with a ramp of N or more requests a burst's prefills are cache hits): N streamed requests sent
at once on the ramp's first N prompts, --burst-tokens tokens each. wall_s: from the first send
until the last request ends; TTFT stats; decode tokens/s over the window while all N decode (from
the last first token until the first request's last token); N x tokens / wall_s.

Peers (levels: --peer-concurrency, default --concurrency): `transformers` (bf16) and
`transformers-fp32` `generate`, one batch per cell (bench/peers/hf_transformers.py); llama.cpp's
`llama-server` (bench/peers/llamacpp.py, built by `make peers` or $LLAMA_SERVER, else skipped)
on the bundled Q4_1 GGUF with -np = the largest level: the same ramp, one server per context, and
each burst on a fresh `-np N` server with `cache_prompt: false`; its tokens are counted from
`timings.predicted_n`. Results: bench/results/throughput.json, .png and _stages.png
(bench/throughput_report.py); the Strata ramp cells carry the KV bytes moved per decode step per
tier pair (/metrics) for bench/roofline.py.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (KV_TMP, LOGS, add_out_arg, add_replot_arg, essay_texts,  # noqa: E402
                          parser, pct, read_json, result_header, result_path, tokenizer,
                          use_checkout_cache, write_json)
from bench.servers import async_openai, start_server, stop  # noqa: E402
from bench.streams import Stream, consume, wait_for  # noqa: E402
from bench.peers import hf_transformers, llamacpp  # noqa: E402
from bench.throughput_report import burst_row, plot, table, weight_lines  # noqa: E402
from engine.core_split import CoreSplit  # noqa: E402

use_checkout_cache()
MODEL_LEN = 8192
MAX_SEQS = 16           # Strata's --max-num-seqs: the largest level or burst
CONFIGS: dict[str, list[str]] = {
    "dense": ["--kv-device-gb", "4"],
    "flexgen": ["--kv-device-gb", "1", "--kv-disk-gb", "8", "--kv-force-tier", "disk"],
    "sparse-tiered": ["--sparse-budget", "1024", "--kv-device-gb", "0.5", "--kv-host-gb", "1",
                      "--kv-disk-gb", "8"],
    "sparse-sfc": ["--sparse-budget", "1024", "--kv-device-gb", "0.5", "--kv-host-gb", "1",
                   "--kv-disk-gb", "8", "--pipeline", "sfc"],
    # the GPU shape of issue 30: ~10% of 8 x 7K tokens' KV (1.3 GB for SmolLM2) on the device
    "sparse-tiered-10": ["--sparse-budget", "1024", "--kv-device-gb", "0.13", "--kv-host-gb",
                         "1", "--kv-disk-gb", "8"],
    "sparse-sfc-10": ["--sparse-budget", "1024", "--kv-device-gb", "0.13", "--kv-host-gb", "1",
                      "--kv-disk-gb", "8", "--pipeline", "sfc"],
}
DEFAULT_CONFIGS = ["dense", "flexgen", "sparse-tiered", "sparse-sfc"]
PEERS = ("llama.cpp", "transformers-fp32", "transformers")
DEFAULT_PEERS = ["llama.cpp", "transformers-fp32"]
CALIBRATION_WAIT = 40   # decode steps at most before timing, for sfc's micro-batch calibration
# decode steps before timing a level: the core split's timing of a new step shape, and two
SPLIT_WAIT = CoreSplit(2, 1).timing_steps + 2


# ------------------------------------------------------------------------------ servers
def start_strata(config: str, disk_dir: Path, log: Path,
                 device: str | None = None) -> tuple[subprocess.Popen, str]:
    return start_server(["--max-model-len", str(MODEL_LEN), "--max-num-seqs", str(MAX_SEQS),
                         "--kv-disk-path", str(disk_dir), *CONFIGS[config],
                         *(["--device", device] if device else [])], log)


def scrape(base: str) -> dict[str, float]:
    """KV transfer bytes per tier pair, stage busy and stall seconds, and the running-requests
    gauge, from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    text = httpx.get(base + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "strata_kv_transfer_bytes_total":
                out[f"{s.labels['src']}->{s.labels['dst']}"] = s.value
            elif s.name == "strata_stage_busy_seconds_total":
                out[f"busy:{s.labels['stage']}"] = s.value
            elif s.name == "strata_pipeline_stall_seconds_total":
                out[f"stall:{s.labels['stage']}"] = s.value
            elif s.name == "strata_requests_running":
                out["running"] = s.value
            elif s.name == "strata_pipeline_micro_batch":
                out["micro_batch"] = s.value
            elif s.name == "strata_generation_tokens_total":
                out["generated"] = s.value
    return out


# ------------------------------------------------------------------------------ the ramp
async def ramp(base: str, model: str, texts: list[str], prompt_tokens: list[int],
               levels: list[int], steps: int, bar=None, metrics: bool = True,
               timeout: float = 1800, extra_body: dict | None = None) -> list[dict]:
    """Grow the number of requests in flight through `levels`; time `steps` decode steps at
    each level (see the module docstring). One row per level. `extra_body`: the request's
    extra fields (default {"ignore_eos": True})."""
    client = async_openai(base + "/v1", timeout)
    streams: list[Stream] = []
    tasks: list[asyncio.Task] = []
    rows = []
    try:
        for level in levels:
            new = []
            for i in range(len(streams), level):
                st = Stream()
                streams.append(st)
                new.append(st)
                max_tokens = MODEL_LEN - prompt_tokens[i] - 16   # never runs out in the ramp
                tasks.append(asyncio.create_task(
                    consume(client, model, texts[i], max_tokens, st, extra_body)))
            # every request decodes, and has streamed a token after the newest one's first
            await wait_for(lambda: all(s.times for s in streams), streams, timeout)
            last_first = max(s.times[0] for s in new)
            await wait_for(lambda: all(s.times[-1] > last_first for s in streams), streams, timeout)
            if metrics:
                # a new decode shape times how to split the cores over its first 10 steps
                # (engine/core_split.py): time the split it settles on
                c0 = [len(s.times) for s in streams]
                await wait_for(lambda: min(len(s.times) - c for s, c in zip(streams, c0))
                            >= SPLIT_WAIT, streams, timeout)
            if metrics and level >= 2:
                # --pipeline sfc calibrates its micro-batch over its first ~30 decode steps with
                # two or more sparse sequences: time the size it settles on, not the candidates
                # (contexts within the budget decode dense and never calibrate: 40 steps at most)
                c0 = [len(s.times) for s in streams]
                await wait_for(lambda: scrape(base).get("micro_batch", 1) > 0 or min(
                    len(s.times) - c for s, c in zip(streams, c0)) >= CALIBRATION_WAIT,
                            streams, timeout, poll=0.25, on_tokens=False)
            # NOTE: scraped on a thread: the event loop keeps stamping tokens meanwhile (a
            # scrape blocking it for the ~50 ms /metrics takes while the server decodes would
            # put that time into the window's first step)
            m0 = await asyncio.to_thread(scrape, base) if metrics else {}
            c0 = [len(s.times) for s in streams]
            await wait_for(lambda: min(len(s.times) - c for s, c in zip(streams, c0)) >= steps,
                         streams, timeout)
            m1 = await asyncio.to_thread(scrape, base) if metrics else {}
            tokens = sum(len(s.times) - c for s, c in zip(streams, c0))
            # each request's own window: `steps` gaps between its token timestamps
            windows = [(s.times[c - 1 + steps] - s.times[c - 1]) / steps
                       for s, c in zip(streams, c0)]
            step = statistics.fmean(windows)
            itl = [b - a for s, c in zip(streams, c0) for a, b in zip(s.times[c - 1:],
                                                                      s.times[c:])]
            ttft = [s.times[0] - s.start for s in new]
            decode_steps = tokens / level
            row = {"mode": "ramp", "concurrency": level, "decode_tokens_per_s": level / step,
                   "step_s": step, "timed_tokens": tokens,
                   "ttft_s": {"mean": statistics.fmean(ttft), "p50": pct(ttft, 50),
                              "max": max(ttft)},
                   "itl_s": {"mean": statistics.fmean(itl), "p50": pct(itl, 50),
                             "p99": pct(itl, 99)},
                   "prompt_tokens": statistics.fmean(prompt_tokens[len(streams) - len(new):
                                                                   len(streams)])}
            if metrics:
                # the steps between the scrapes (more than the window's: tokens go on
                # streaming while /metrics answers)
                scraped = (m1.get("generated", 0.0) - m0.get("generated", 0.0)) / level
                per_step = {k: (m1.get(k, 0.0) - m0.get(k, 0.0)) / (scraped or decode_steps)
                            for k in m1 if k != "generated"}
                row["kv_bytes_per_step"] = {k: v for k, v in per_step.items() if "->" in k}
                row["stage_busy_s_per_step"] = {k[5:]: v for k, v in per_step.items()
                                                if k.startswith("busy:")}
                row["stage_stall_s_per_step"] = {k[6:]: v for k, v in per_step.items()
                                                 if k.startswith("stall:")}
            rows.append(row)
            if bar is not None:
                bar.update(1)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    return rows


def _drain(base: str, timeout: float = 120) -> None:
    """Wait until the server has aborted every cancelled request."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if scrape(base).get("running", 0) == 0:
            return
        time.sleep(0.2)
    raise RuntimeError("cancelled requests are still running")


async def burst(base: str, model: str, texts: list[str], prompt_tokens: list[int], n: int,
                tokens: int, timeout: float = 1800, extra_body: dict | None = None) -> dict:
    """Send n requests at once (the first n texts), `tokens` tokens each, and wait for all of
    them; one "mode": "burst" row (see the module docstring)."""
    client = async_openai(base + "/v1", timeout)
    streams = [Stream() for _ in range(n)]
    t0 = time.perf_counter()
    tasks = []
    for text, st in zip(texts[:n], streams):
        st.start = t0
        tasks.append(asyncio.create_task(consume(client, model, text, tokens, st, extra_body)))
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    errs = [s.error for s in streams if s.error]
    if errs:
        raise RuntimeError(f"burst request failed: {errs[0]}")
    return burst_row([s.times for s in streams], [s.end for s in streams], t0, tokens,
                     statistics.fmean(prompt_tokens[:n]))


def run_server_cells(name: str, base: str, model: str, texts: dict[int, list[str]],
                     lens: dict[int, list[int]], levels: list[int], steps: int, bar,
                     metrics: bool, extra_body: dict | None = None, bursts: list[int] = (),
                     burst_tokens: int = 64) -> list[dict]:
    """The ramp for each context, then (Strata: metrics=True) its bursts on the same server once
    the ramp's cancelled requests are gone."""
    cells = []
    for context, ts in texts.items():
        bar.set_description(f"{name} {context // 1000}K")
        rows = asyncio.run(ramp(base, model, ts, lens[context], levels, steps, bar=bar,
                                metrics=metrics, extra_body=extra_body))
        if metrics:
            _drain(base)
        for n in bursts:
            bar.set_description(f"{name} {context // 1000}K burst {n}")
            rows.append(asyncio.run(burst(base, model, ts, lens[context], n, burst_tokens,
                                          extra_body=extra_body)))
            bar.update(1)
        cells += [{"engine": name, "context": context, **r} for r in rows]
    return cells


# ------------------------------------------------------------------------------ main
def run(args) -> dict:
    from tqdm import tqdm
    import torch
    tok = tokenizer()
    bursts = list(getattr(args, "burst", None) or [])
    burst_tokens = getattr(args, "burst_tokens", 64)
    max_level = max(args.concurrency + args.peer_concurrency + bursts)
    texts = {c: essay_texts(tok, max_level, c) for c in args.contexts}
    ids_by_ctx = {c: [tok.encode_chat([{"role": "user", "content": t}]) for t in ts]
                  for c, ts in texts.items()}
    lens = {c: [len(i) for i in ids] for c, ids in ids_by_ctx.items()}
    peers = list(args.peers)
    skipped = {}
    if "llama.cpp" in peers and llamacpp.find_binary() is None:
        skipped["llama.cpp"] = llamacpp.missing_message()
        print(f"skipping llama.cpp: {skipped['llama.cpp']}")
        peers.remove("llama.cpp")
    n_ctx = len(args.contexts)
    total = (n_ctx * (len(args.concurrency) + len(bursts)) * len(args.configs)
             + n_ctx * len(args.peer_concurrency) * len(peers)
             + n_ctx * len(bursts) * ("llama.cpp" in peers))
    bar = tqdm(total=total, desc="throughput", unit="cell")
    cells: list[dict] = []
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    strata_weights = {}
    t_start = time.perf_counter()
    for config in args.configs:
        disk_dir = Path(args.kv_disk_path) / config
        shutil.rmtree(disk_dir, ignore_errors=True)
        disk_dir.mkdir(parents=True)
        bar.set_description(f"{config} (starting)")
        log = logs / f"throughput-{config}.log"
        proc, base = start_strata(config, disk_dir, log, args.device)
        strata_weights[config] = weight_lines(log)
        try:
            cells += run_server_cells(config, base, "SmolLM2-135M-Instruct", texts, lens,
                                      args.concurrency, args.steps, bar, metrics=True,
                                      bursts=bursts, burst_tokens=burst_tokens)
        finally:
            stop(proc)
            shutil.rmtree(disk_dir, ignore_errors=True)
    peer_info = {}
    if "llama.cpp" in peers:
        llama_cells, peer_info["llama.cpp"] = llamacpp.run(
            texts, lens, args.peer_concurrency, args.steps, bar, logs, bursts, burst_tokens)
        cells += llama_cells
    for name in (p for p in PEERS if p in peers and p in hf_transformers.DTYPES):
        torch.set_num_threads(os.cpu_count() or 1)
        cells += hf_transformers.run(name, ids_by_ctx, args.peer_concurrency, args.steps, bar)
    bar.close()
    return {**result_header("throughput"),
            "settings": {"contexts": args.contexts, "concurrency": args.concurrency,
                         "peer_concurrency": args.peer_concurrency, "steps": args.steps,
                         "burst": bursts, "burst_tokens": burst_tokens,
                         "configs": {c: CONFIGS[c] for c in args.configs}, "peers": peers,
                         "device": args.device or "auto",
                         "model": "SmolLM2-135M-Instruct", "strata_weights": strata_weights,
                         "peer_dtypes": {p: hf_transformers.DTYPES[p] for p in peers
                                         if p in hf_transformers.DTYPES}, **peer_info},
            "skipped": skipped, "wall_s": time.perf_counter() - t_start, "cells": cells}


def build_parser() -> argparse.ArgumentParser:
    ap = parser(__doc__, paragraph=True)
    ap.add_argument("--configs", nargs="*", choices=list(CONFIGS), default=DEFAULT_CONFIGS,
                    help="Strata configurations (none: `--configs` alone, peers only); "
                         "sparse-*-10: the device tier ~10%% of 8 x 7K tokens' KV (a GPU run)")
    ap.add_argument("--device", default=None,
                    help="Strata's --device (default: its own, auto)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 7000])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--peers", nargs="*", choices=PEERS, default=list(DEFAULT_PEERS),
                    help="transformers is bf16 (~5x slower than fp32 without AVX-512 bf16)")
    ap.add_argument("--peer-concurrency", type=int, nargs="+", default=None,
                    help="transformers batch sizes and llama.cpp ramp levels "
                         "(default: --concurrency)")
    # NOTE: 8 steps made one-stream cells swing by 15-30% between runs (dense 1 x 1K: 89 tok/s
    # in one run; 104.7 over 64 steps, llama.cpp 118.6 against 101.0): a step's noise on a
    # shared 2-core box is ms, the step itself 10-20 ms
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per level")
    ap.add_argument("--burst", type=int, nargs="+", default=[],
                    help="after each ramp, send N requests at once (Strata configs and "
                         "llama.cpp), for each N given")
    ap.add_argument("--burst-tokens", type=int, default=64,
                    help="output tokens of each burst request")
    ap.add_argument("--kv-disk-path", default=str(KV_TMP))
    ap.add_argument("--log-dir", default=str(LOGS))
    ap.add_argument("--quick", action="store_true",
                    help="1K context, 1 and 4 in flight, dense and sparse-tiered, transformers")
    add_out_arg(ap, "throughput", quick=True)
    add_replot_arg(ap, "plots")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.replot:
        plot(read_json(args.replot), Path(args.replot).with_suffix(".png"))
        return
    if args.quick:
        args.configs, args.contexts, args.concurrency = ["dense", "sparse-tiered"], [1000], [1, 4]
        args.steps = min(args.steps, 4)
        args.peers = [p for p in args.peers if p in hf_transformers.DTYPES]
    args.concurrency = sorted(set(args.concurrency))
    args.peer_concurrency = sorted(set(args.peer_concurrency or args.concurrency))
    args.burst = sorted(set(args.burst))
    if any(n < 1 or n > MAX_SEQS for n in args.burst):
        ap.error(f"--burst: between 1 and {MAX_SEQS} requests (the servers' --max-num-seqs)")
    if args.burst_tokens < 2:
        ap.error("--burst-tokens: at least 2 (a decode window needs a token after the first)")
    out = result_path(args.out, "throughput", args.quick)
    report = run(args)
    write_json(out, report)
    plot(report, out.with_suffix(".png"))
    print(table(report))
    print(f"wrote {out} and {out.with_suffix('.png')} ({report['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
