"""Stepping an in-process engine, for the benches that time its steps without a server
(bench/decode_ab.py, step_time.py, sparse_decode.py, pipeline.py): an engine with its requests
prefilled until each decodes (`decoding_engine`), whether they all still do (`all_decoding`),
and a stepper that counts each request's tokens and keeps its errors (`EngineSteps`).

Imported like bench/common.py (a script run as `.venv/bin/python bench/<name>.py` puts the
checkout first on sys.path before it imports this); the engine, torch and tqdm are imported
inside the functions that need them, so importing this costs nothing.
"""
from __future__ import annotations


def decoding_engine(context: int, batch: int, max_tokens: int, **engine_kw):
    """An in-process LLMEngine with the server's defaults (torch threads, core split;
    `engine_kw`: EngineArgs fields), `batch` random-token prompts of `context` tokens added
    (r0, r1, ...) and stepped until each has its first token -> (engine, request ids). Each
    request may then decode `max_tokens` more (the earlier ones also decode while the later
    ones prefill): the caller's steps have `batch` rows (`all_decoding` checks).
    max_model_len unless given: 8192, or more where the prompt and those tokens need it.
    Imports the engine when called (step_time.py puts another checkout first on sys.path)."""
    import torch
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    args = EngineArgs(**{"max_model_len": 8192, **engine_kw})
    prefill_steps = -(-batch * context // args.max_num_batched_tokens) + batch
    if "max_model_len" not in engine_kw and context + max_tokens + prefill_steps > 8192:
        args = EngineArgs(**engine_kw, max_model_len=context + max_tokens + prefill_steps)
    engine = LLMEngine(args)
    engine.use_threads(*args.torch_threads())
    gen = torch.Generator().manual_seed(0)
    ids = [f"r{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens + prefill_steps, temperature=0,
                            ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, torch.randint(100, 40000, (context,), generator=gen).tolist(),
                           params)
    while not all(engine.scheduler.get_request(r).output_token_ids for r in ids):
        engine.step()
    return engine, ids


def all_decoding(engine, ids: list[str]) -> bool:
    """Whether every request of `ids` is in `engine` unfinished (each step had them all)."""
    return all((r := engine.scheduler.get_request(i)) is not None and not r.finished
               for i in ids)


class EngineSteps:
    """Steps an in-process LLMEngine, counting each request's tokens (`produced`) and keeping
    its errors (`errors`); with `raise_errors`, a step that sees an error raises."""

    def __init__(self, engine, raise_errors: bool = False) -> None:
        self.engine = engine
        self.raise_errors = raise_errors
        self.produced: dict[str, int] = {}
        self.errors: dict[str, str] = {}

    def step(self) -> list:
        outs = self.engine.step()
        for o in outs:
            self.produced[o.request_id] = self.produced.get(o.request_id, 0) + len(o.new_token_ids)
            if o.error:
                self.errors[o.request_id] = o.error
        if self.raise_errors and self.errors:
            raise RuntimeError(f"requests failed: {self.errors}")
        return outs

    def prefill_one_by_one(self, prompts: dict[str, list[int]], params, desc: str) -> int:
        """Add the requests one at a time, each stepped until its first token (or its error),
        so that each prompt is prefilled on its own (the earlier ones decode meanwhile)
        -> the steps taken."""
        from tqdm import tqdm
        steps = 0
        for rid, ids in tqdm(list(prompts.items()), desc=desc, leave=False):
            self.engine.add_request(rid, ids, params)
            while not self.produced.get(rid) and rid not in self.errors:
                self.step()
                steps += 1
        return steps
