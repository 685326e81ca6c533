"""`strata serve` processes for the benches, and their clients: a free port, waiting for
/health, starting and stopping a server, an already running one by URL, the OpenAI client."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from bench.common import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path | None = None,
               timeout: float = 900) -> None:
    """Poll `url` (a /health) until it answers 200. RuntimeError when the process exits (with
    the tail of its `log`) or after `timeout` s (the process killed)."""
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}"
                               + (f"; log: {log}\n" + log.read_text()[-3000:] if log else ""))
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become ready" + (f"; log: {log}" if log else ""))


def start_server(flags: list[str], log: Path | None = None,
                 timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """`strata serve` (python -m server serve, from the checkout) on a free loopback port with
    `flags`, its output into `log` (else this process's) -> (process, base URL without /v1) once
    /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--port", str(port), *flags]
    out = log.open("w") if log else None
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if log else None)
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, base + "/health", log, timeout)
    return proc, base


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Terminate a server; kill it if it has not exited after `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def server_or_url(url: str | None, flags: list[str], api: str = "/v1",
                  timeout: float = 600) -> Iterator[tuple[subprocess.Popen | None, str]]:
    """(None, url) for an already running server at `url`; else a fresh start_server(flags) as
    (process, its base URL + `api`), stopped on exit."""
    if url is not None:
        yield None, url
        return
    proc, base = start_server(flags, timeout=timeout)
    try:
        yield proc, base + api
    finally:
        stop(proc)


def async_openai(base_url: str, timeout: float, max_retries: int = 0):
    """An AsyncOpenAI client of `base_url` (…/v1), with $STRATA_API_KEY when set."""
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=base_url, api_key=os.environ.get("STRATA_API_KEY", "none"),
                       timeout=timeout, max_retries=max_retries)
