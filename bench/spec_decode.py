"""What n-gram speculation (--speculative-config) buys: the bundled GGUF in-process (as `make
serve` runs it, its threads too), one request at a time decoded without drafts and with each
configuration, in turns, on four workloads: a passage the prompt asks to be repeated
(greedy; the drafts' best case), the same sampled at temperature 0.7 (seeded), a code edit
(comments removed: mostly copied), and a free story (greedy; few matches). Per cell: decode
tokens/s (the steps after the prefill), engine steps, the share of drafted tokens kept, and
whether the tokens equal those decoded without drafts.

    .venv/bin/python bench/spec_decode.py [--tokens 128] [--rounds 2] [--passage 400]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_out_arg, cpu_line, essay_ids, parser, pyplot, result_header,
                          save_figure, tokenizer, write_json)

CONFIGS = {
    "off": "",
    "k3 n2-4": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
               '"prompt_lookup_max": 4}',
    "k3 n2-4 all": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                   '"prompt_lookup_max": 4, "draft_p_min": 0}',
    "k5 n2-4": '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
               '"prompt_lookup_max": 4}',
    "k5 n5 (vLLM's)": '{"method": "ngram", "num_speculative_tokens": 5}',
}


def workloads(tok, passage: int) -> dict[str, tuple[list[int], dict]]:
    """name -> (chat prompt ids, SamplingParams fields)."""
    text = tok.decode(essay_ids(tok)[:passage])
    code = (Path(__file__).resolve().parents[1] / "scheduler" / "request.py").read_text()
    repeat = tok.encode_chat([{"role": "user", "content": "Repeat the following passage word "
                               f"for word.\n\n{text}"}])
    edit = tok.encode_chat([{"role": "user", "content": "Rewrite this Python code with every "
                             f"comment removed:\n\n{code[:1500]}"}])
    story = tok.encode_chat([{"role": "user", "content": "Write a short story about a "
                              "lighthouse keeper who finds a message in a bottle."}])
    return {"repeat, greedy": (repeat, {"temperature": 0.0}),
            "repeat, t=0.7": (repeat, {"temperature": 0.7, "seed": 5}),
            "code edit, greedy": (edit, {"temperature": 0.0}),
            "story, greedy": (story, {"temperature": 0.0})}


def decode(engine, prompt: list[int], fields: dict, tokens: int) -> tuple[list[int], float, int]:
    """(tokens, decode seconds, decode steps) of one request."""
    from scheduler.sampling_params import SamplingParams
    rid = f"r{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                   **fields))
    out, seconds, steps = [], 0.0, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        got = engine.step()
        if out:                 # (the first step is the prefill)
            seconds += time.perf_counter() - t0
            steps += 1
        for o in got:
            out += o.new_token_ids
    return out, seconds, steps


def run(tokens: int, rounds: int, passage: int) -> dict:
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    tok = tokenizer()
    loads = workloads(tok, passage)
    engines = {}
    for name, spec in CONFIGS.items():
        args = EngineArgs(model="bundled", prefix_cache="off", speculative_config=spec)
        engines[name] = LLMEngine(args)
        engines[name].use_threads(*args.torch_threads())        # as the server's
    cells: dict[str, dict] = {}
    for r in range(rounds):
        for load, (prompt, fields) in loads.items():
            for name, engine in engines.items():
                before = (engine.spec.draft_tokens, engine.spec.accepted_tokens)
                out, secs, steps = decode(engine, prompt, fields, tokens)
                drafted = engine.spec.draft_tokens - before[0]
                kept = engine.spec.accepted_tokens - before[1]
                cell = cells.setdefault(f"{load}|{name}", {"tok_s": [], "steps": [],
                                                           "kept": [], "equal": []})
                cell["tok_s"].append((len(out) - 1) / secs)
                cell["steps"].append(steps)
                cell["kept"].append(kept / drafted if drafted else None)
                cell["equal"].append(out == cells.get(f"{load}|off", {}).get("out", out))
                if name == "off":
                    cell["out"] = out
                print(f"round {r + 1}/{rounds} {load} | {name}: {cell['tok_s'][-1]:.1f} tok/s, "
                      f"{steps} steps, kept {kept}/{drafted}", flush=True)
    for cell in cells.values():
        cell.pop("out", None)
    return {"cells": cells, "dtype": next(iter(engines.values())).weight_plan.dtype,
            "configs": CONFIGS, "prompts": {k: len(v[0]) for k, v in loads.items()}}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    loads = list(dict.fromkeys(k.split("|")[0] for k in result["cells"]))
    names = list(result["configs"])
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = [max(result["cells"][f"{load}|{name}"]["tok_s"]) for load in loads]
        ax.bar([i + j * width for i in range(len(loads))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))], loads)
    ax.set_ylabel("decode tokens/s (best round)")
    ax.set_title(f"n-gram speculation, 1 request; {cpu_line(result['machine'])}", fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--passage", type=int, default=400, help="tokens of the passage repeated")
    add_out_arg(ap, "spec_decode")
    args = ap.parse_args()
    result = {**result_header("spec_decode"), "tokens": args.tokens,
              **run(args.tokens, args.rounds, args.passage)}
    write_json(args.out, result)
    plot(result, Path(args.out).with_suffix(".png"))
    print(f"\n{cpu_line(result['machine'])}; activations {result['dtype']}; {args.tokens} "
          "tokens a request; per round: decode tokens/s, steps, drafted tokens kept")
    print("| workload | config | tokens/s | steps | kept | equal to off |")
    print("|---|---|---|---|---|---|")
    for key, c in result["cells"].items():
        kept = ", ".join("-" if k is None else f"{k:.0%}" for k in c["kept"])
        print(f"| {' | '.join(key.split('|'))} | "
              f"{', '.join(f'{t:.1f}' for t in c['tok_s'])} | "
              f"{', '.join(map(str, c['steps']))} | {kept} | {all(c['equal'])} |")
    print(f"(JSON: {args.out}; plot: {Path(args.out).with_suffix('.png')})")


if __name__ == "__main__":
    main()
