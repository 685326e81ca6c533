"""Fill-in-the-middle: the prompt a code model completes the gap between two texts from.

A FIM-trained model (Qwen2.5-Coder, StarCoder, CodeLlama, DeepSeek-Coder) reads the text
before the cursor and the text after it between its own marker tokens, in the order llama.cpp
and the models' papers use (prefix, suffix, middle: "PSM"):

    [repo context] <PRE> prefix <SUF> suffix <MID>          -> the model writes the middle

Where the model has repo tokens (Qwen2.5-Coder, StarCoder) the prompt opens as llama.cpp's
does, `<REPO>myproject\n <SEP>file\ntext ... <SEP>filename\n`, with llama.cpp's `input_extra`
(other files, the editor's recent snippets) as the files; a model without them reads each
chunk after a "--- snippet ---" line, before the prefix marker. The markers are found
by their spelling in the tokenizer; a model without them has no FIM (a 400 naming the field).
The middle ends at EOS or at the tokens that end an infill (pad, file separator, CodeLlama's
<EOT>), which the engine stops at and leaves out of the text.

Used by /v1/completions' `suffix` (OpenAI's) and llama.cpp's /infill (server/serving_infill.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from server.errors import invalid_request
from server.tokenizer import Tokenizer

# each family's spelling of (prefix, suffix, middle, pad, repo name, file separator, end)
_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
     "<|file_sep|>", None),                                                  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>", "<reponame>", "<file_sep>",
     None),                                                                  # StarCoder
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None, None, "▁<EOT>"),              # CodeLlama
    ("<PRE>", "<SUF>", "<MID>", None, None, None, "<EOT>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None, None, None),  # DeepSeek
)
REPO_NAME = "myproject"        # what llama.cpp names the repo before the files
SNIPPET = "\n\n--- snippet ---\n\n"  # before a chunk where the model has no file separator


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None        # before the repo's name (needs `separator` too)
    separator: int | None = None   # before each file of the repo context
    ends: tuple[int, ...] = ()     # tokens that end a middle besides EOS


def fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """The model's FIM markers, or None when its vocabulary has none."""
    for spelling in _SPELLINGS:
        pre, suf, mid, pad, repo, sep, end = (
            None if s is None else tokenizer.token_id(s) for s in spelling)
        if None in (pre, suf, mid):
            continue
        ends = tuple(t for t in (pad, sep, repo, end) if t is not None)
        return FimTokens(pre, suf, mid, repo if sep is not None else None, sep, ends)
    return None


def require_fim(tokenizer: Tokenizer, param: str) -> FimTokens:
    fim = fim_tokens(tokenizer)
    if fim is None:
        raise invalid_request("This model has no fill-in-the-middle tokens (<fim_prefix>, "
                              "<|fim_prefix|>, <PRE>, ...): serve a FIM-trained code model "
                              "to complete between a prefix and a suffix.", param=param)
    return fim


@dataclass(frozen=True)
class FimFit:
    """llama.cpp's fit of an /infill prompt to the context: the prefix's last 3/4 of a batch
    of tokens, the suffix's first 1/4 (less two markers and the cursor line), and of the repo
    context the last tokens that leave the context a batch and twice the tokens to write.
    The batch is llama.cpp's default (2048 tokens), or half a smaller context."""
    n_ctx: int
    n_predict: int                  # -1: as many as fit
    n_batch: int = 2048

    def trim(self, pre: list[int], n_cursor: int, suf: list[int], context: list[int]
             ) -> tuple[list[int], list[int], list[int]]:
        """(prefix with the cursor line: its last tokens, suffix: its first, context: its
        last) within the budget."""
        batch = min(self.n_batch, self.n_ctx // 2)
        take_pre = min(len(pre) - n_cursor, 3 * (batch // 4)) + n_cursor
        take_suf = min(len(suf), max(0, batch // 4 - (2 + n_cursor)))
        # (NOTE: 4 more than llama.cpp's budget: BOS and the three markers, so the prompt
        # always leaves room for the tokens to write)
        room = self.n_ctx - batch - 2 * max(self.n_predict, 1) - 4
        take_ctx = min(len(context), max(0, room))
        return pre[len(pre) - take_pre:], suf[:take_suf], context[len(context) - take_ctx:]


def fim_prompt_ids(tokenizer: Tokenizer, fim: FimTokens, prefix: str, suffix: str,
                   extra: list[tuple[str, str]] = (), fit: FimFit | None = None,
                   cursor: str = "") -> tuple[list[int], bool]:
    """(the prompt (PSM order) whose completion is the text between `prefix` + `cursor` and
    `suffix`, whether `fit` cut it); `extra`: (file name, text) pairs of repo context, before
    the rest; `cursor`: the cursor line's start, which `fit` keeps whole."""
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    head = tokenizer.encode("", add_special_tokens=True)       # BOS where the model has one
    context = [fim.repo] + enc(f"{REPO_NAME}\n") if fim.repo is not None else []
    for name, text in extra:
        context += ([fim.separator] + enc(f"{name}\n") if fim.separator is not None
                    else enc(SNIPPET)) + enc(text)
    if fim.separator is not None:
        context += [fim.separator] + enc("filename\n")          # the file being edited
    pre, suf = enc(prefix + cursor), enc(suffix)
    cut = False
    if fit is not None:
        sizes = len(pre), len(suf), len(context)
        pre, suf, context = fit.trim(pre, len(enc(cursor)) if cursor else 0, suf, context)
        cut = (len(pre), len(suf), len(context)) != sizes
    return head + context + [fim.prefix] + pre + [fim.suffix] + suf + [fim.middle], cut
