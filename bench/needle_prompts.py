"""bench/needle.py's prompts: an essay haystack with a needle sentence at a depth, asked for
in one of FORMATS (also read by bench/needle_selection.py and bench/selector_recall.py)."""
from __future__ import annotations

import dataclasses
import random
import re

# needle sentence, question, answer prefix (the assistant turn starts with it; "" for none)
FORMATS = {
    "passcode": ("The secret passcode is {v}.",
                 "What is the secret passcode?",
                 "The secret passcode is"),
    "passcode_noprefix": ("The secret passcode is {v}.",
                          "What is the secret passcode? Answer with the number only.", ""),
    "magic": ("One of the special magic numbers is: {v}.",
              "What is the special magic number mentioned in the provided text?",
              "The special magic number mentioned in the provided text is"),
}
DEFAULT_FORMAT = "passcode_noprefix"


# ------------------------------------------------------------------------------ prompts
@dataclasses.dataclass
class Prompt:
    rid: str
    length: int          # target context length (tokens)
    depth: float
    value: str
    ids: list[int]


def build_prompt(tok, essay_ids: list[int], fmt: str, length: int, depth: float,
                 value: str, offset: int, max_len: int = 8192) -> list[int]:
    """The chat prompt (ids) of ~`length` tokens; ValueError past `max_len` - 64."""
    needle_t, question, prefix = FORMATS[fmt]
    needle = needle_t.format(v=value)

    def render(hay: str) -> list[int]:
        msg = f"{hay}\n\n{question}"
        ids = tok.encode_chat([{"role": "user", "content": msg}])
        return ids + (tok.encode(prefix, add_special_tokens=False) if prefix else [])

    overhead = len(render("")) + len(tok.encode(" " + needle, add_special_tokens=False)) + 8
    n = length - overhead
    start = offset % max(1, len(essay_ids) - n)
    hay = tok.decode(essay_ids[start:start + n])
    hay = hay[hay.find(" ") + 1:]                       # drop a partial first word
    cut = hay.rfind(".")
    hay = hay[:cut + 1] if cut > len(hay) // 2 else hay
    # insert after the sentence end nearest to the depth (by characters)
    pos = int(depth * len(hay))
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s)", hay)] or [len(hay)]
    at = min(ends, key=lambda e: abs(e - pos))
    if depth <= 0.0:
        at = 0
    hay = hay[:at] + " " + needle + hay[at:]
    ids = render(hay)
    if len(ids) > max_len - 64:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit")
    return ids


def make_prompts(tok, essay_ids, fmt, lengths, depths, per_depth, seed,
                 max_len: int = 8192) -> list[Prompt]:
    prompts = []
    for length in lengths:
        for d in depths:
            for i in range(per_depth):
                rng = random.Random(f"{seed}-{length}-{d}-{i}")
                value = str(rng.randrange(10000, 100000))
                offset = i * 37_003 + int(d * 10_007)
                ids = build_prompt(tok, essay_ids, fmt, length, d, value, offset, max_len)
                prompts.append(Prompt(f"n{length}-d{d}-{i}", length, d, value, ids))
    return prompts
