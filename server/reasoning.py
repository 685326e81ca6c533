"""ReasoningSplitter: a reasoning model's answer, as it streams, split into its reasoning (the
text between <think> and </think>) and its content (what follows), as vLLM's
`--reasoning-parser` and llama.cpp's `--reasoning-format` do.

Two styles, by the model's chat template:
  qwen3        the answer may start with <think>: reasoning until </think>; an answer that
               does not start with it (Qwen3 with enable_thinking false) is all content;
  deepseek_r1  the template opened <think> in the prompt: the answer starts inside the
               reasoning (an explicit <think> first is skipped), until </think>; an answer
               that never closes it is all reasoning.
`auto` (the server's default) is qwen3 when the chat template writes <think>, else none.
Whitespace between </think> and the content is dropped; text that may be the start of a tag is
held back until it is known not to be one (the tool parser's rule, server/tool_parser.py).
"""
from __future__ import annotations

from scheduler.sampling_params import ReasoningMarks
from server.tool_parser import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "none", "qwen3", "deepseek_r1")

Piece = tuple[str, str]             # ("reasoning" | "content", text)


def grammar_marks(style: str | None, open_id: int | None, close_id: int | None
                  ) -> ReasoningMarks | None:
    """The thinking span a grammar leaves free for `style` (vLLM's structured outputs under
    a reasoning parser), given the ids of <think> and </think> as single tokens (None where
    they are not one token: the grammar then constrains the whole answer)."""
    if style is None or close_id is None or style == "qwen3" and open_id is None:
        return None
    return ReasoningMarks(close_id, open_id if style == "qwen3" else None)


def resolve_parser(name: str, chat_template: str | None) -> str | None:
    """The style a server runs with --reasoning-parser `name` (None: no splitting)."""
    if name == "auto":
        return "qwen3" if chat_template and OPEN in chat_template else None
    return None if name == "none" else name


class ReasoningSplitter:
    def __init__(self, style: str):
        if style not in ("qwen3", "deepseek_r1"):
            raise ValueError(f"unknown reasoning style {style!r}")
        self._style = style
        self._state = "start"           # start -> reasoning -> content
        self._buf = ""

    def push(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            before = (self._state, len(self._buf))
            if self._state == "start":
                self._start()
            elif self._state == "reasoning":
                self._reasoning(out)
            else:
                self._content(out)
            if (self._state, len(self._buf)) == before:
                break                   # holding a possible tag start: wait for more text
        return out

    def flush(self) -> list[Piece]:
        """What is held at the end of the answer, as what it was inside of."""
        text, self._buf = self._buf, ""
        if self._state == "after":
            text = text.lstrip()
        if not text:
            return []
        if self._state == "start":
            kind = "reasoning" if self._style == "deepseek_r1" else "content"
            return [(kind, text)]
        return [("content" if self._state == "after" else self._state, text)]

    def _start(self) -> None:
        head = self._buf.lstrip()
        if head.startswith(OPEN):
            self._buf, self._state = head[len(OPEN):], "reasoning"
        elif not head or OPEN.startswith(head):
            return                      # maybe <think> still coming
        else:
            self._state = "reasoning" if self._style == "deepseek_r1" else "content"

    def _reasoning(self, out: list[Piece]) -> None:
        at = self._buf.find(CLOSE)
        if at >= 0:
            if at:
                out.append(("reasoning", self._buf[:at]))
            self._buf, self._state = self._buf[at + len(CLOSE):], "after"
            return
        keep = partial_suffix(self._buf, CLOSE)
        if len(self._buf) > keep:
            out.append(("reasoning", self._buf[:len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep:]

    def _content(self, out: list[Piece]) -> None:
        if self._state == "after":      # the whitespace after </think> is no content
            self._buf = self._buf.lstrip()
            if not self._buf:
                return
            self._state = "content"
        out.append(("content", self._buf))
        self._buf = ""


def pieces_of(splitter: "ReasoningSplitter | None", text: str, final: bool) -> list[Piece]:
    """A delta's text as pieces (all content without a splitter); `final`: the answer ended,
    so what the splitter holds comes out too."""
    parts = ([("content", text)] if splitter is None else splitter.push(text)) if text else []
    if final and splitter is not None:
        parts += splitter.flush()
    return parts


def split_reasoning(style: str | None, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    if style is None:
        return None, text
    splitter = ReasoningSplitter(style)
    pieces = splitter.push(text) + splitter.flush()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if any(k == "reasoning" for k, _ in pieces) else None), content
