"""Constrained decoding's cost: decode tokens/s at batch 1 and 8, free text against a JSON
Schema (llguidance masks), in one process on the same engine settings, alternating the two
so that machine noise hits both. Target: constrained >= 90% of free.

Also times the grammar work alone per step (the bitmask fill of the constrained rows) and,
with --libraries, llguidance against xgrammar (when installed: `pip install --no-deps xgrammar
apache-tvm-ffi`) on the generated schema suite: compile time and mask time per token.

    .venv/bin/python bench/structured.py [--quick] [--libraries]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_out_arg, cpu_line, parser, result_header, result_path,
                          use_checkout_cache, write_json)

# a long answer whatever the model says: 30 records before the object may close
SCHEMA = {"type": "object", "properties": {"people": {
    "type": "array", "minItems": 30, "maxItems": 40, "items": {
        "type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["engineer", "doctor", "teacher", "artist", "farmer"]},
            "active": {"type": "boolean"}},
        "required": ["name", "age", "role", "active"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}


def run_batch(engine, prompt: list[int], batch: int, tokens: int, constrained: bool,
              tag: str) -> dict:
    """Decode tokens/s of `batch` requests after their prefill, and grammar fill time."""
    from scheduler.sampling_params import GrammarSpec, SamplingParams
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA)) if constrained else None
    fills = []
    table = engine.runner.grammars
    fill = table.fill

    def timed_fill(rows, num_rows):
        t = time.perf_counter()
        out = fill(rows, num_rows)
        fills.append(time.perf_counter() - t)
        return out

    table.fill = timed_fill
    try:
        ids = [f"{tag}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, prompt, SamplingParams(
                max_tokens=tokens, temperature=0.7, seed=i, ignore_eos=not constrained,
                grammar=grammar))
        produced = dict.fromkeys(ids, 0)
        start = None
        while engine.has_unfinished():
            for out in engine.step():
                produced[out.request_id] += len(out.new_token_ids)
            if start is None and all(produced.values()):
                start, base = time.perf_counter(), sum(produced.values())
        elapsed = time.perf_counter() - start
    finally:
        table.fill = fill
    decoded = sum(produced.values()) - base
    return {"tokens_per_s": decoded / elapsed, "tokens": decoded, "seconds": elapsed,
            "fill_ms_mean": 1e3 * statistics.mean(fills) if fills else 0.0}


def decode_rates(args) -> dict:
    from bench.common import tokenizer
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(max_model_len=4096, max_num_seqs=16))
    engine.use_threads(2, 2)
    tok = tokenizer()
    prompt = tok.encode_chat([{"role": "user", "content": "List people as JSON."}])
    engine.runner.grammars.warm()
    out = {}
    for batch in args.batches:
        rounds = {"free": [], "schema": []}
        for r in range(args.rounds):
            for mode in ("free", "schema"):
                res = run_batch(engine, prompt, batch, args.tokens, mode == "schema",
                                f"b{batch}-{mode}-{r}")
                rounds[mode].append(res)
                print(f"batch {batch} {mode:6s} round {r}: {res['tokens_per_s']:.1f} tok/s, "
                      f"fill {res['fill_ms_mean']:.3f} ms/step", flush=True)
        best = {m: max(rs, key=lambda x: x["tokens_per_s"]) for m, rs in rounds.items()}
        out[str(batch)] = {"rounds": rounds, "best": best,
                           "ratio": best["schema"]["tokens_per_s"] / best["free"]["tokens_per_s"]}
        print(f"batch {batch}: constrained / free = {out[str(batch)]['ratio']:.3f}")
    return out


def libraries(count: int) -> dict:
    """llguidance (and xgrammar when importable) on the generated schema suite."""
    from bench.common import model_folder
    from bench.schemas import generate
    folder = model_folder()
    pairs = generate(count)
    res = {"llguidance": _llguidance(folder, pairs)}
    try:
        res["xgrammar"] = _xgrammar(folder, pairs)
    except ImportError:
        res["xgrammar"] = None
    return res


def _summary(compiles: list[float], masks: list[float]) -> dict:
    compiles, masks = sorted(compiles), sorted(masks)
    return {"compile_ms_p50": 1e3 * compiles[len(compiles) // 2],
            "compile_ms_max": 1e3 * compiles[-1], "mask_ms_mean": 1e3 * statistics.mean(masks),
            "mask_ms_p99": 1e3 * masks[int(len(masks) * 0.99)], "mask_ms_max": 1e3 * masks[-1],
            "steps": len(masks)}


def _tokens(folder, instance) -> list[int]:
    from server.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    return tok.encode(json.dumps(instance, ensure_ascii=False), add_special_tokens=False)


def _llguidance(folder, pairs) -> dict:
    import torch
    from llguidance import LLMatcher, LLTokenizer

    from engine.grammar import JSON_OPTIONS
    tok = LLTokenizer((folder / "tokenizer.json").read_text(), n_vocab=49152, eos_token=[2])
    mask = torch.full((1, 49152 // 32), -1, dtype=torch.int32)
    compiles, masks = [], []
    for schema, instance in pairs:
        ids = _tokens(folder, instance) + [2]
        t = time.perf_counter()
        m = LLMatcher(tok, LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)   # includes lazy compile
        compiles.append(time.perf_counter() - t)
        assert m.consume_token(ids[0])
        for t_id in ids[1:]:
            t = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)
            masks.append(time.perf_counter() - t)
            assert m.consume_token(t_id), m.get_error()
    return _summary(compiles, masks)


def _xgrammar(folder, pairs) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=49152, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    mask = xgr.allocate_token_bitmask(1, 49152)
    compiles, masks = [], []
    for schema, instance in pairs:
        ids = _tokens(folder, instance) + [2]
        t = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        compiles.append(time.perf_counter() - t)
        m = xgr.GrammarMatcher(cg)
        for t_id in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            masks.append(time.perf_counter() - t)
            assert m.accept_token(t_id)
    return _summary(compiles, masks)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of free and schema")
    ap.add_argument("--libraries", action="store_true",
                    help="also compare the grammar libraries on the schema suite")
    ap.add_argument("--quick", action="store_true", help="64 tokens, one round")
    add_out_arg(ap, "structured", quick=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.rounds = 64, 1
    use_checkout_cache()
    import torch
    torch.set_num_threads(2)
    rep = {**result_header("structured"), "settings": {"tokens": args.tokens,
                                                      "rounds": args.rounds, "schema": SCHEMA}}
    rep["decode"] = decode_rates(args)
    if args.libraries:
        rep["libraries"] = libraries(60)
        print(json.dumps(rep["libraries"], indent=1))
    out = write_json(result_path(args.out, "structured", args.quick), rep)
    print(f"{cpu_line(rep['machine'])}: wrote {out}")


if __name__ == "__main__":
    main()
