"""IncrementalDetokenizer: token ids in, new text out, never a split character.

Follows vLLM's prefix/read offsets: the text of the new tokens is the decode of a short window
(``ids[prefix_offset:]``) minus the decode of the window's already-read part
(``ids[prefix_offset:read_offset]``). Decoding in context keeps tokenizer-specific spacing right
(SentencePiece's leading "▁"), and the window stays a few tokens long, so each step costs
O(new tokens), not O(output). A window whose decode ends in U+FFFD holds a partial UTF-8
character: nothing is emitted until the next token completes it (or the request finishes).
"""
from __future__ import annotations

from typing import Protocol

# NOTE: vLLM seeds the window with the prompt's last few tokens so the first generated token
# decodes with its left context (leading spaces are tokenizer-dependent).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Per-request state; feed every new token once, in order."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int] = (), *,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context           # the window; older tokens are dropped
        self._prefix_offset = 0
        self._read_offset = len(context)

    def push(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """Append new tokens; return the text that is now complete (may be "")."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is still held (partial characters included)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if not final and (len(full_text) <= len(prefix_text)
                          or full_text.endswith(REPLACEMENT_CHAR)):
            return ""                            # incomplete character (or nothing visible yet)
        new_text = full_text[len(prefix_text):]
        # Slide the window: the tokens just read become the next step's context.
        del self._ids[:self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""
