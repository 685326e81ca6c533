"""AnswerBlocks: one answer's engine deltas as a sequence of blocks (reasoning, text, function
calls), each opened, written to and closed in order: what the Responses API's output items
(server/responses_events.py) and the Messages API's content blocks
(server/messages_events.py) are made of, whatever their wire shape.

A reasoning model's <think> text is a reasoning block (server/reasoning.py); the rest is split
into text and calls as chat streams them (server/tool_parser.StreamedCalls). Without tools
(or with tool_choice "none") text needs no waiting: it is written as it comes, and an answer
with no text at all still gets an (empty) text block. With tools, whitespace waits for the
text after it: a text block opens at text that is not whitespace (and starts there), and the
whitespace before a call (or between calls) is no text. Token logprobs (already formatted by
the caller) go with the text they wrote; those of a call's tokens are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.choice_stream import ChoiceDelta
from server.reasoning import ReasoningSplitter, pieces_of
from server.tool_parser import StreamedCalls


@dataclass
class Block:
    kind: str                           # "reasoning" | "text" | "call"
    index: int                          # its place in the answer
    text: str = ""                      # the reasoning, the text, or a call's arguments
    call_id: str | None = None          # a call's id and function name
    name: str | None = None


@dataclass(frozen=True)
class BlockEvent:
    op: str                             # "open" | "write" | "close"
    block: Block
    text: str = ""                      # what "write" appended
    logprobs: tuple = ()                # and its tokens' logprobs (text blocks)


class AnswerBlocks:
    def __init__(self, plan, reasoning: str | None = None):
        """plan: server/tools.ToolPlan or None; reasoning: the reasoning style (None: none)."""
        self.blocks: list[Block] = []
        self._calls = StreamedCalls(plan)
        self._thinking = ReasoningSplitter(reasoning) if reasoning else None
        self._eager = plan is None or plan.mode == "none"
        self._open: Block | None = None
        self._held = ""                     # whitespace waiting for text (tools)
        self._pending: list[Any] = []       # logprobs of tokens not yet written as text

    def start(self) -> list[BlockEvent]:
        """The text block at once where nothing can come before it."""
        return self._open_block("text") if self._eager and self._thinking is None else []

    def push(self, delta: ChoiceDelta, logprobs: list | None = None) -> list[BlockEvent]:
        """The events of one delta; `logprobs`: its tokens' (formatted), when asked for."""
        self._pending += logprobs or []
        events: list[BlockEvent] = []
        for kind, part in pieces_of(self._thinking, delta.text, bool(delta.finish_reason)):
            if kind == "reasoning":
                events += self._write("reasoning", part)
            else:
                events += self._pieces(self._calls.push(part))
        if delta.finish_reason:
            events += self._pieces(self._calls.flush())
        return events

    def finish(self) -> list[BlockEvent]:
        """The answer ended: held whitespace written where text is open, an empty text block
        where an answer without tools has none, the open block closed."""
        held, self._held = self._held, ""
        events = self._write("text", held) if held and self._is_open("text") else []
        if self._eager and not any(b.kind == "text" for b in self.blocks):
            events += self._open_block("text")
        return events + self._close()

    # ------------------------------------------------------------------------------ pieces
    def _pieces(self, pieces) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for piece in pieces:
            if piece.content:
                events += self._text(piece.content)
            for call in piece.tool_calls or ():
                if call.id is not None:          # a new call (its name comes with its id)
                    self._held, self._pending = "", []      # a call's tokens: not text
                    events += self._open_block("call", call_id=call.id, name=(
                        call.function.name if call.function else ""))
                arguments = call.function.arguments if call.function else None
                if arguments and self._is_open("call"):
                    events += self._write("call", arguments)
        return events

    def _text(self, text: str) -> list[BlockEvent]:
        if self._eager:
            return self._write("text", text)
        text = self._held + text
        if not self._is_open("text"):
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        return self._write("text", body) if body else []

    def _write(self, kind: str, text: str) -> list[BlockEvent]:
        """`text` appended to the open block of `kind` (a new one when another is open)."""
        events = [] if self._is_open(kind) else self._open_block(kind)
        block = self._open
        block.text += text
        logprobs: list = []
        if kind == "text":
            logprobs, self._pending = self._pending, []
        elif kind == "reasoning":
            self._pending = []              # logprobs go with text only
        return events + [BlockEvent("write", block, text, tuple(logprobs))]

    def _open_block(self, kind: str, **info) -> list[BlockEvent]:
        events = self._close()
        block = Block(kind, len(self.blocks), **info)
        self.blocks.append(block)
        self._open = block
        return events + [BlockEvent("open", block)]

    def _close(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [] if block is None else [BlockEvent("close", block)]

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open.kind == kind
