"""Helpers that run the real server (`python -m server serve`) as a subprocess and talk to it.

Plain functions and constants, imported by name (``from tests.server_helpers import
running_server, MODEL``); the fixtures built on them (`server`, `server_url`, `client`, `http`)
live in tests/server_fixtures.py, which tests/conftest.py registers, so tests only name them.
Extra server flags for every launch can be given in ``STRATA_TEST_SERVER_ARGS`` (shell syntax),
e.g. ``--model /path/to/folder``; the start-up timeout in ``STRATA_TEST_STARTUP_TIMEOUT_S``.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("STRATA_TEST_MODEL_NAME", "SmolLM2-135M-Instruct")
STARTUP_TIMEOUT_S = float(os.environ.get("STRATA_TEST_STARTUP_TIMEOUT_S", "600"))
REQUEST_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `strata serve` subprocess on a free port; its output goes to a temporary log."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="strata-server-", suffix=".log")[1])
        extra = shlex.split(os.environ.get("STRATA_TEST_SERVER_ARGS", ""))
        command = [sys.executable, "-m", "server", "serve", "--port", str(self.port),
                   *extra, *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def first_response(self, path: str = "/health", timeout_s: float = 60.0) -> httpx.Response:
        """Poll until the server answers at all (the socket may not be bound yet)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                return httpx.get(self.url + path, timeout=5.0)
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout_s} s; log:\n{self.log_tail()}")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n"
                               f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_path.unlink(missing_ok=True)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from /metrics, e.g. metric("strata_kv_tier_used_bytes", 'tier="device"')."""
        return read_metric(httpx.get(self.url + "/metrics", timeout=10.0).text, name, labels)


def fresh_salt() -> dict:
    """extra_body for a request computed whole: a `cache_salt` no other request has, so its
    prompt reads no cached page. Two greedy requests of one prompt, each salted so, run the
    same kernels on the same rows and give the same tokens; a second request that read the
    first's pages would compute its last prompt token alone, rounding a little differently,
    and could part from the first at a near-tie (seen in fresh-clone runs)."""
    import uuid
    return {"cache_salt": uuid.uuid4().hex}


def read_metric(text: str, name: str, labels: str = "") -> float:
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{wanted} not in /metrics")


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None,
                   wait: bool = True) -> Iterator[ServerProcess]:
    server = ServerProcess(*args, env=env)
    try:
        if wait:
            server.wait_ready()
        yield server
    finally:
        server.stop()


def sse_payloads(lines: Iterator[str]) -> Iterator[dict | str]:
    """Parsed `data:` payloads of an event stream; the last one is the string "[DONE]"."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            yield data
            return
        yield json.loads(data)


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0,
                         timeout=REQUEST_TIMEOUT_S)



def completion_tokens(url: str, prompt: list[int], n_predict: int) -> list[int]:
    """The greedy token ids llama.cpp's /completion (return_tokens) answers for `prompt`."""
    import httpx
    r = httpx.post(url + "/completion", timeout=REQUEST_TIMEOUT_S, json={
        "prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "ignore_eos": True,
        "return_tokens": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]
