"""Test-only drivers for the engine: greedy requests stepped to the end, outputs and errors
collected per request, and a disk-file corrupter."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams


def greedy(steps: int) -> SamplingParams:
    """Exactly `steps` greedy tokens."""
    return SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)


def drive(engine: LLMEngine, ids, on_step: Callable[[dict], None] | None = None):
    """Step the engine until every request ends. Returns (request id -> tokens, request id ->
    error of those that failed); `on_step(tokens so far)` runs after each step."""
    got = {rid: [] for rid in ids}
    errors = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            if out.finish_reason == "error":
                errors[out.request_id] = out.error
        if on_step is not None:
            on_step(got)
    return got, errors


def run(engine: LLMEngine, prompts, steps: int, ids=None):
    """Greedy `steps` tokens for each prompt (ids r0, r1, ... unless given), to the end."""
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, greedy(steps))
    return drive(engine, ids)


def flip_bytes(path: Path, nbytes: int) -> None:
    """Invert the first `nbytes` bytes of a file in place (a corrupt page on disk)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read(nbytes))
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in data))
