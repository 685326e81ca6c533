"""MessageEvents: one answer's engine deltas as an Anthropic Messages API message: its content
blocks (thinking, text, tool_use: server/answer_blocks.py's blocks) and the stream events that
build them, in the order the anthropic SDK's accumulator reads them:

    message_start (the message, no content yet)
    per block: content_block_start, content_block_delta ... (text_delta, thinking_delta,
               input_json_delta), content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

An engine failure mid-stream ends with an `error` event. A non-streamed message is built by
the same object from one delta holding the whole answer.
"""
from __future__ import annotations

import json
from typing import Any

from server.answer_blocks import AnswerBlocks, BlockEvent
from server.choice_stream import ChoiceDelta

Event = tuple[str, dict[str, Any]]          # (event name, payload)
_OPEN = {"text": {"type": "text", "text": ""},
         "reasoning": {"type": "thinking", "thinking": "", "signature": ""}}
_DELTA = {"text": ("text_delta", "text"), "reasoning": ("thinking_delta", "thinking"),
          "call": ("input_json_delta", "partial_json")}


def stop_reason(finish_reason: str | None, stop_string: str | None, called: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if stop_string is not None:
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


class MessageEvents:
    def __init__(self, message: dict[str, Any], plan, reasoning: str | None = None):
        """message: the message object so far (id, model, usage; no content); plan:
        server/tools.ToolPlan or None; reasoning: the reasoning style (None: none)."""
        self.message = message
        self._blocks = AnswerBlocks(plan, reasoning)

    def start(self) -> list[Event]:
        return [("message_start", {"type": "message_start", "message": _copy(self.message)})] \
            + self._render(self._blocks.start())

    def push(self, delta: ChoiceDelta) -> list[Event]:
        return self._render(self._blocks.push(delta))

    def finish(self, finish_reason: str | None, stop_string: str | None,
               usage: dict[str, int]) -> list[Event]:
        events = self._render(self._blocks.finish())
        called = any(b["type"] == "tool_use" for b in self.message["content"])
        m = self.message
        m["stop_reason"] = stop_reason(finish_reason, stop_string, called)
        m["stop_sequence"] = stop_string
        m["usage"] = usage
        return events + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": m["stop_reason"],
                                         "stop_sequence": stop_string},
                               "usage": {"output_tokens": usage["output_tokens"]}}),
            ("message_stop", {"type": "message_stop"})]

    @staticmethod
    def fail(message: str) -> list[Event]:
        return [("error", {"type": "error", "error": {"type": "api_error", "message": message}})]

    def _render(self, events: list[BlockEvent]) -> list[Event]:
        out: list[Event] = []
        content = self.message["content"]
        for e in events:
            b = e.block
            if e.op == "open":
                block = (dict(_OPEN[b.kind]) if b.kind in _OPEN else
                         {"type": "tool_use", "id": b.call_id, "name": b.name, "input": {}})
                content.append(block)
                out.append(("content_block_start", {"type": "content_block_start",
                                                    "index": b.index,
                                                    "content_block": dict(block)}))
            elif e.op == "write":
                kind, key = _DELTA[b.kind]
                if b.kind != "call":
                    content[b.index][key] += e.text
                out.append(("content_block_delta", {"type": "content_block_delta",
                                                    "index": b.index,
                                                    "delta": {"type": kind, key: e.text}}))
            else:
                if b.kind == "call":
                    content[b.index]["input"] = _object(b.text)
                out.append(("content_block_stop", {"type": "content_block_stop",
                                                   "index": b.index}))
        return out


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments as its input object ({} where they are not one: cut by max_tokens)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _copy(message: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(message))
