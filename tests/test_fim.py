"""Fill-in-the-middle prompts (server/fim.py): the markers found by their spelling, the PSM
layout, repo context with and without file-separator tokens."""
from __future__ import annotations

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HF
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from server.errors import APIError
from server.fim import FimFit, FimTokens, fim_prompt_ids, fim_tokens, require_fim
from server.tokenizer import Tokenizer
from tests.fim_helpers import fim_model_folder


def word_tokenizer(specials: list[str]) -> Tokenizer:
    words = ["[UNK]", "a", "b", "c", "x", "y", "f.py", "myproject", "filename"]
    hf = HF(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = Whitespace()
    hf.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return Tokenizer(hf)


def test_psm_layout_and_codellamas_end_token():
    tok = word_tokenizer(["<PRE>", "<SUF>", "<MID>", "<EOT>"])
    pre, suf, mid, eot = (tok.token_id(s) for s in ("<PRE>", "<SUF>", "<MID>", "<EOT>"))
    fim = fim_tokens(tok)
    assert fim == FimTokens(pre, suf, mid, None, None, (eot,))
    ids, cut = fim_prompt_ids(tok, fim, "a b", "c")
    assert ids == [pre, 1, 2, suf, 3, mid] and not cut
    # no file separators: each chunk after a snippet line, before the prefix marker
    snippet = tok.encode("\n\n--- snippet ---\n\n", add_special_tokens=False)
    assert fim_prompt_ids(tok, fim, "a", "c", [("f.py", "x y")])[0] == [
        *snippet, 4, 5, pre, 1, suf, 3, mid]


def test_a_prompt_over_the_context_is_cut_as_llama_cpp_cuts_it():
    """The prefix keeps its end (the cursor line whole), the suffix its start, the snippets
    their end; the batch is half of a small context: prefix 3/4 of it, suffix 1/4 less two
    markers and the cursor line; the rest of the context, less twice the tokens to write,
    holds snippets."""
    tok = word_tokenizer(["<PRE>", "<SUF>", "<MID>"])
    pre, suf, mid = (tok.token_id(s) for s in ("<PRE>", "<SUF>", "<MID>"))
    fim = fim_tokens(tok)
    snippet = tok.encode("\n\n--- snippet ---\n\n", add_special_tokens=False)
    prefix, cursor, suffix = " ".join(["a"] * 30 + ["b"] * 10), " x", " ".join(["c"] * 20)
    extra = [("f.py", " ".join(["y"] * 40))]
    fit = FimFit(n_ctx=64, n_predict=4)         # batch 32: prefix 24, suffix 8 - 2 - 1
    ids, cut = fim_prompt_ids(tok, fim, prefix, suffix, extra, fit, cursor)
    room = 64 - 32 - 2 * 4 - 4                  # 20 tokens of context
    assert cut and ids == [*([*snippet, *[5] * 40][-room:]), pre, *[1] * 14, *[2] * 10, 4,
                           suf, *[3] * 5, mid]
    assert len(ids) + 4 <= 64                   # the tokens to write still fit
    whole, cut = fim_prompt_ids(tok, fim, "a b", "c", extra, FimFit(4096, 16), " x")
    assert not cut and whole == fim_prompt_ids(tok, fim, "a b x", "c", extra)[0]


def test_repo_context_between_file_separators(smollm2_dir, tmp_path):
    tok = Tokenizer.from_folder(fim_model_folder(smollm2_dir, tmp_path))
    fim = fim_tokens(tok)
    ids = {s: tok.token_id(s) for s in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>",
                                        "<fim_pad>", "<reponame>", "<file_sep>")}
    assert (fim.prefix, fim.suffix, fim.middle, fim.repo, fim.separator) == (
        ids["<fim_prefix>"], ids["<fim_suffix>"], ids["<fim_middle>"], ids["<reponame>"],
        ids["<file_sep>"])
    assert set(fim.ends) == {ids["<fim_pad>"], ids["<file_sep>"], ids["<reponame>"]}
    got, _ = fim_prompt_ids(tok, fim, "def f():\n", "\n\nf()", [("util.py", "X = 1")])
    text = tok.decode(got, skip_special_tokens=False)
    assert text == ("<reponame>myproject\n<file_sep>util.py\nX = 1<file_sep>filename\n"
                    "<fim_prefix>def f():\n<fim_suffix>\n\nf()<fim_middle>")
    bare = tok.decode(fim_prompt_ids(tok, fim, "a", "b")[0], skip_special_tokens=False)
    assert bare == ("<reponame>myproject\n<file_sep>filename\n<fim_prefix>a<fim_suffix>b"
                    "<fim_middle>")                             # as llama.cpp lays it out


def test_a_model_without_markers_has_no_fim(smollm2_dir):
    tok = Tokenizer.from_folder(smollm2_dir)
    assert fim_tokens(tok) is None
    with pytest.raises(APIError) as info:
        require_fim(tok, "suffix")
    assert info.value.status == 400 and info.value.param == "suffix"


def pushes(stops, pieces):
    kept, ended = "", False
    for piece in pieces:
        text, ended = stops.push(piece)
        kept += text
        if ended:
            break
    return kept, ended


def test_n_indent_ends_the_middle_at_a_less_indented_line():
    from server.llamacpp_native import EditorStops
    body = ["x = 1", "\n", "    ", "y = 2\n", "  ", "z", " = 3\n"]
    assert pushes(EditorStops(4, 0), body) == ("x = 1\n    y = 2\n  ", True)
    # the first line is never checked; a blank line is a line with no indentation
    assert pushes(EditorStops(4, 0), ["a\n", "\n", "b"]) == ("a\n", True)
    assert pushes(EditorStops(0, 0), body) == ("".join(body), False)
    # several lines in one piece (a step of several tokens) are checked one by one
    assert pushes(EditorStops(2, 0), ["a\n  b\n  c\nd\n  e"]) == ("a\n  b\n  c\n", True)


def test_t_max_predict_ms_ends_it_after_a_newline_once_late():
    from server.llamacpp_native import EditorStops
    now = [0.0]
    stops = EditorStops(0, 100, clock=lambda: now[0])
    assert stops.push("a") == ("a", False)
    now[0] = 0.5                                  # late, but no line has ended yet
    assert stops.push("b") == ("b", False)
    assert stops.push("    half(") == ("    half(", False)   # never half a line
    assert stops.push(")\nc") == (")\nc", True)
    early = EditorStops(0, 100, clock=lambda: 0.0)
    assert pushes(early, ["a\n", "b\n", "c"]) == ("a\nb\nc", False)
