"""IncrementalDetokenizer with the real SmolLM2 tokenizer: same text as one full decode, no U+FFFD
for characters split across tokens, and a decode window that stays small."""
from __future__ import annotations

import pytest

from server.detokenizer import IncrementalDetokenizer
from server.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "Émojis 😀🎉 and accents: naïve café, Ça va? — “quotes”",
    "日本語のテキストと中文文本, 한국어 텍스트.",
    "  leading spaces\n\nnew lines\ttabs  ",
    "🧑‍🚀 zero-width joiners 👩🏽‍💻",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_folder(smollm2_dir)


def stream_text(tokenizer, ids, prompt=()):
    detok = IncrementalDetokenizer(tokenizer, list(prompt))
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_join_to_the_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream_text(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS[1:3] + TEXTS[4:])
def test_characters_split_across_tokens_never_emit_replacement_char(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.token_text(t) for t in ids), "no split character here"
    assert all("\ufffd" not in piece for piece in stream_text(tokenizer, ids))


def test_several_tokens_at_once_give_the_same_text(tokenizer):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert text == TEXTS[1]


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == "\ufffd"


def test_first_token_keeps_its_leading_space_after_a_prompt(tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    ids = tokenizer.encode(" world", add_special_tokens=False)
    assert "".join(stream_text(tokenizer, ids, prompt)) == " world"


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Done", add_special_tokens=False) + [2]      # 2 = <|im_end|>
    assert "".join(stream_text(tokenizer, ids)) == "Done"


class CountingDecoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_bounded_window(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    assert len(ids) > 1000
    counting = CountingDecoder(tokenizer)
    detok = IncrementalDetokenizer(counting, ids[:5])
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert counting.longest <= 16
