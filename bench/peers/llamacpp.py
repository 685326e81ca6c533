"""llama.cpp's native `llama-server` as a benchmark peer (bench/throughput.py's `llama.cpp`;
run() drives it through the bench's ramp and bursts).

`make peers` builds the binary once into .tools/llama.cpp/bin/llama-server (from the llama.cpp
tree vendored in the pinned llama-cpp-python sdist; see bench/peers/build_llamacpp.sh) and
records its version in .tools/llama.cpp/VERSION; $LLAMA_SERVER points at another binary.

The server runs the bundled GGUF (SmolLM2-135M-Instruct, Q4_1 weights, f16 KV) with `-np N`
slots, continuous batching, and `-c N * model_len` (llama-server splits -c evenly across the
slots, so each request gets model_len tokens, as with Strata's --max-model-len), on every core
(`-t` and `-tb`). ggml's threads meet at a spinning barrier after every op of the graph: when
another process takes one of the cores, `-t <cores>` slows down by orders of magnitude (2 cores
with one busy: 2.7 s a decode step against 28 ms with `-t 1`; `--poll 0` does not help), so
measure on a quiet machine, or set $LLAMA_SERVER_ARGS (recorded in the command), e.g. "-t 1 -tb 1".

Its stream differs from Strata's in two ways the bench adapts to (see REQUEST):
- `logprobs: true` alone asks it for the top 20 alternatives of every token (a softmax, a partial
  sort and 20 detokenized strings per token), so the bench asks for `top_logprobs: 1`;
- it sends no chunk for a token whose text its chat parser holds back (an incomplete UTF-8
  character, a prefix of a stop string or a template tag): that token's logprob is lost and its
  text arrives with the next token, so logprobs can undercount. With `timings_per_token` each
  chunk carries `timings.predicted_n`, the tokens generated so far, which the bench counts from.
"""
from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
from pathlib import Path

from bench.common import ROOT
from bench.servers import free_port, stop, wait_ready

DEFAULT_BINARY = ROOT / ".tools" / "llama.cpp" / "bin" / "llama-server"
MODEL_NAME = "SmolLM2-135M-Instruct"      # the alias llama-server serves the GGUF under
# extra request fields (the chat request itself is bench/throughput.py's: greedy, streamed,
# logprobs, ignore_eos)
REQUEST = {"ignore_eos": True, "top_logprobs": 1, "timings_per_token": True}


def binary_path() -> Path:
    """Where the binary is looked for: $LLAMA_SERVER, else .tools/llama.cpp/bin/llama-server."""
    env = os.environ.get("LLAMA_SERVER")
    return Path(env) if env else DEFAULT_BINARY


def find_binary() -> Path | None:
    path = binary_path()
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_message(path: Path | None = None) -> str:
    path = path or binary_path()
    return (f"llama.cpp's llama-server is not built ({path} is missing): run `make peers` to "
            "build it (~13 min), or set LLAMA_SERVER to a llama-server binary")


def version(binary: Path) -> str:
    """The build's VERSION stamp (`llama-cpp-python==V llama.cpp@COMMIT`), else what
    `llama-server --version` prints."""
    stamp = binary.parent.parent / "VERSION"
    if binary.resolve() == DEFAULT_BINARY.resolve() and stamp.is_file():
        return stamp.read_text().strip()
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__})"
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines()
             if ln.strip().startswith("version")]
    return lines[0] if lines else "unknown"


def command(binary: Path | str, model: Path | str, slots: int, model_len: int, port: int,
            threads: int | None = None, host: str = "127.0.0.1",
            extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """llama-server's command line for `slots` requests in flight of up to `model_len` tokens
    each (a pure function); `extra` flags go last, so they override."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    threads = threads or os.cpu_count() or 1
    return [str(binary), "--model", str(model), "--alias", MODEL_NAME,
            "--host", host, "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * model_len),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--cont-batching", "--no-webui", *extra]


class LlamaServer:
    """One llama-server process: `base` is its URL, `cmd` the exact command line."""

    def __init__(self, proc: subprocess.Popen, base: str, cmd: list[str], version: str):
        self.proc, self.base, self.cmd, self.version = proc, base, cmd, version


def start(log: Path, slots: int, model_len: int, threads: int | None = None,
          extra: tuple[str, ...] = (), model: Path | None = None) -> LlamaServer:
    """Start llama-server on the bundled GGUF (or `model`) on a free loopback port and wait
    for /health (503 while it loads); RuntimeError with missing_message() when there is no
    binary. `extra` flags (e.g. --embeddings), then $LLAMA_SERVER_ARGS (shell syntax), e.g.
    "--poll 0" or "-t 1" on a busy box."""
    from engine.gguf_convert import bundled_gguf_path
    binary = find_binary()
    if binary is None:
        raise RuntimeError(missing_message())
    port = free_port()
    cmd = command(binary, model or bundled_gguf_path(), slots, model_len, port, threads,
                  extra=[*extra, *shlex.split(os.environ.get("LLAMA_SERVER_ARGS", ""))])
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, base + "/health", log)
    return LlamaServer(proc, base, cmd, version(binary))


def run(texts: dict[int, list[str]], lens: dict[int, list[int]], levels: list[int], steps: int,
        bar, logs: Path, bursts: list[int] = (), burst_tokens: int = 64) -> tuple[list, dict]:
    """The peer through bench/throughput.py's ramp: one llama-server per context (a fresh prompt
    cache) with -np = the largest level; then each burst of N on a fresh -np N server, with
    `cache_prompt: false` too. Cells, and its version and command lines."""
    from bench import throughput as tp
    cells: list[dict] = []
    burst_request = {**REQUEST, "cache_prompt": False}
    info: dict = {"weights": "bundled GGUF, Q4_1", "request": REQUEST,
                  "burst_request": burst_request, "commands": {}}
    runs = [("ramp", max(levels))] + [(f"burst {n}", n) for n in bursts]
    for context, ts in texts.items():
        for what, slots in runs:
            bar.set_description(f"llama.cpp {context // 1000}K {what} (starting)")
            tail = "" if what == "ramp" else f"-burst{slots}"
            srv = start(logs / f"throughput-llama.cpp-{context}{tail}.log", slots, tp.MODEL_LEN)
            info["version"] = srv.version
            info["commands"][str(context) + ("" if what == "ramp" else f" {what}")] = srv.cmd
            try:
                if what == "ramp":
                    cells += tp.run_server_cells("llama.cpp", srv.base, MODEL_NAME, {context: ts},
                                                 lens, levels, steps, bar, metrics=False,
                                                 extra_body=REQUEST)
                    continue
                bar.set_description(f"llama.cpp {context // 1000}K {what}")
                row = asyncio.run(tp.burst(srv.base, MODEL_NAME, ts, lens[context], slots,
                                           burst_tokens, extra_body=burst_request))
                cells.append({"engine": "llama.cpp", "context": context, **row})
                bar.update(1)
            finally:
                stop(srv.proc)
    return cells, info
