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


def _run_logprobs(engine: LLMEngine, prompts, steps: int):
    """As `run`, with each greedy token's logprob entries (the token's, the top two):
    (request id -> tokens, request id -> entries)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    got, entries = {rid: [] for rid in ids}, {rid: [] for rid in ids}
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(max_tokens=steps, temperature=0.0,
                                                  ignore_eos=True, logprobs=2))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id].extend(out.new_token_ids)
            entries[out.request_id].extend(out.new_logprobs)
    return got, entries


def run_scored(engine: LLMEngine, prompts, steps: int):
    """As `run`, with each greedy token's margin over the runner-up (its logprob minus the
    second best's): (request id -> tokens, request id -> margins)."""
    got, entries = _run_logprobs(engine, prompts, steps)
    return got, {rid: [top[0].logprob - top[1].logprob for _, top in e]
                 for rid, e in entries.items()}


def run_logprobs(engine: LLMEngine, prompts, steps: int):
    """As `run`, with each greedy token's logprob: (request id -> tokens, -> logprobs)."""
    got, entries = _run_logprobs(engine, prompts, steps)
    return got, {rid: [chosen.logprob for chosen, _ in e] for rid, e in entries.items()}


def assert_same_greedy(got: dict, ref: dict, margins: dict, tie: float = 0.2) -> None:
    """Two runs of the same requests through different float paths (kernels that round
    differently) give the same greedy tokens up to the first near-tie: where they differ, the
    reference's two best tokens were within `tie` (logprob) of each other, and from there on
    the two texts go their own ways, both correct."""
    assert got.keys() == ref.keys()
    for rid in ref:
        a, b = got[rid], ref[rid]
        assert len(a) == len(b), rid
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is not None:
            assert margins[rid][first] < tie, \
                f"{rid}: token {first} differs where the reference's margin was " \
                f"{margins[rid][first]:.3f} (not a near-tie)"


def code_prompt(model_dir) -> list[int]:
    """A ~700-token chat prompt with one fact to recall (a code amid filler): sparse budgets
    of 128 tokens select within it, 4096 cover it."""
    from server.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(model_dir)
    text = ("The lighthouse keeper wrote in his log every night. " * 30
            + "The secret code is 4921. Remember it. " + "Waves hit the rocks. " * 30)
    return tok.encode_chat([{"role": "user", "content": text + " What is the code?"}])


def run_code_prompt(model_dir, **engine_args) -> tuple[LLMEngine, list[int]]:
    """A fresh engine (EngineArgs `engine_args`, 0.1 GB of device KV, no prefix cache)
    decoding code_prompt greedily for 24 tokens: (the engine, its tokens)."""
    from engine.args import EngineArgs
    engine = LLMEngine(EngineArgs(model=str(model_dir), page_size=16, kv_device_gb=0.1,
                                  prefix_cache="off", **engine_args))
    got, errors = run(engine, [code_prompt(model_dir)], 24)
    assert not errors
    return engine, got["r0"]


def flip_bytes(path: Path, nbytes: int) -> None:
    """Invert the first `nbytes` bytes of a file in place (a corrupt page on disk)."""
    with open(path, "r+b") as f:
        data = bytearray(f.read(nbytes))
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in data))
