"""An answer's text, as it streams, split into content and tool calls, in the format the
model writes them (server/tool_formats.py).

ToolCallParser reads the Hermes format: each call is a JSON object {"name", "arguments"}
between <tool_call> and </tool_call>. Text outside the tags is content; a tagged block that is
not a call to a known function stays content, tags and all (nothing the model wrote is lost).
Text that may be the start of a tag is held back until it is known not to be one.
TrailingCallsParser reads the formats whose calls run to the end of the answer (mistral after
[TOOL_CALLS], phi4_mini_json after functools, llama3_json an answer that opens with its
JSON): the text from there is held and read when the answer ends, calls if it parses as calls
to known functions, else content as written.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from server.protocol_responses import DeltaMessage
from server.protocol_tools import DeltaFunctionCall, DeltaToolCall
from server.tool_formats import (HERMES_CLOSE as CALL_CLOSE, HERMES_OPEN as CALL_OPEN,
                                 CALLS_START, LIST_MARKS, PYTHON_TAG, call_of, read_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str                       # JSON text of an object
    id: str = field(default_factory=new_call_id)


Event = str | ParsedCall                 # content text, or a complete call


def parse_call(body: str, names: frozenset[str]) -> ParsedCall | None:
    """A call from the JSON between the tags, or None when it is not one."""
    try:
        call = call_of(json.loads(body))
    except ValueError:
        return None
    if call is None or call.name not in names:
        return None
    return ParsedCall(call.name, json.dumps(call.arguments, ensure_ascii=False))


class ToolCallParser:
    def __init__(self, names: frozenset[str], parallel: bool = True):
        """parallel: False keeps the first call only (parallel_tool_calls: false); the
        blocks after it are dropped, as OpenAI answers with one call at most then."""
        self._names = names
        self._parallel = parallel
        self._buf = ""
        self._in_call = False
        self._space = ""               # whitespace after a call, held until text follows
        self.num_calls = 0

    def push(self, text: str) -> list[Event]:
        """The events that `text` completes, in order."""
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._in_call:
                start = self._buf.find(CALL_OPEN)
                if start < 0:
                    keep = partial_suffix(self._buf, CALL_OPEN)
                    self._content(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._content(out, self._buf[:start])
                self._buf = self._buf[start + len(CALL_OPEN):]
                self._in_call = True
            end = self._buf.find(CALL_CLOSE)
            if end < 0:
                return out
            self._call(out, self._buf[:end], closed=True)
            self._buf = self._buf[end + len(CALL_CLOSE):]
            self._in_call = False

    def flush(self) -> list[Event]:
        """The answer ended: what is held back (a call missing only its closing tag counts)."""
        out: list[Event] = []
        if self._in_call:
            self._call(out, self._buf, closed=False)
        else:
            self._content(out, self._buf)
        self._buf, self._in_call, self._space = "", False, ""
        return out

    def _call(self, out: list[Event], body: str, closed: bool) -> None:
        call = parse_call(body, self._names)
        if call is None:
            self._content(out, CALL_OPEN + body + (CALL_CLOSE if closed else ""))
            return
        if self.num_calls and not self._parallel:
            return
        self.num_calls += 1
        out.append(call)

    def _content(self, out: list[Event], text: str) -> None:
        # whitespace after a call is layout, not an answer, unless more text follows it
        if self.num_calls and not text.strip():
            self._space += text
            return
        if text:
            out.append(self._space + text)
            self._space = ""


class TrailingCallsParser:
    """mistral, phi4_mini_json / llama3_json (the module's note): content streams until the
    calls start (the marker; llama3_json: an answer opening with JSON); from there the text is
    held and read when the answer ends."""

    def __init__(self, fmt: str, names: frozenset[str], parallel: bool = True):
        self._fmt, self._names, self._parallel = fmt, names, parallel
        # where calls start: the marker (phi4's, a plain word, with its list's bracket)
        self._mark = CALLS_START.get(fmt)
        self._buf = ""
        self._held: str | None = None      # the text from the calls' start (None: not yet)
        self._content_only = False         # llama3_json: the answer did not open with a call
        self.num_calls = 0

    def push(self, text: str) -> list[Event]:
        if self._held is not None:
            self._held += text
            return []
        if self._content_only:
            return [text] if text else []
        self._buf += text
        if self._mark is not None:
            at = self._buf.find(self._mark)
            if at >= 0:
                start = at + len(LIST_MARKS[self._fmt][0])      # the list's bracket is held
                head, self._held = self._buf[:at], self._buf[start:]
                self._buf = ""
                return [head] if head else []
            keep = len(self._buf) - partial_suffix(self._buf, self._mark)
            head, self._buf = self._buf[:keep], self._buf[keep:]
            return [head] if head else []
        start = self._buf.lstrip()          # llama3_json: is the answer a call?
        if start.startswith(("{", PYTHON_TAG)):
            self._held, self._buf = self._buf, ""
            return []
        if not start or PYTHON_TAG.startswith(start):
            return []                       # not known yet
        self._content_only = True
        head, self._buf = self._buf, ""
        return [head]

    def flush(self) -> list[Event]:
        """The answer ended: the held text as calls, or as the content it is."""
        if self._held is None:
            head, self._buf = self._buf, ""
            return [head] if head else []
        body, self._held = self._held, None
        calls = read_calls(self._fmt, body)
        if calls is None or any(c.name not in self._names for c in calls):
            return [(LIST_MARKS[self._fmt][0] if self._mark else "") + body]
        calls = calls if self._parallel else calls[:1]
        self.num_calls += len(calls)
        return [ParsedCall(c.name, json.dumps(c.arguments, ensure_ascii=False))
                for c in calls]


def make_parser(fmt: str, names: frozenset[str], parallel: bool = True):
    """The parser of `fmt`'s calls (server/tool_formats.py)."""
    if fmt == "hermes":
        return ToolCallParser(names, parallel)
    return TrailingCallsParser(fmt, names, parallel)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_answer(text: str, names: frozenset[str], parallel: bool = True,
                 fmt: str = "hermes") -> tuple[str | None, list[ParsedCall]]:
    """A whole answer as (content or None, calls)."""
    parser = make_parser(fmt, names, parallel)
    events = parser.push(text) + parser.flush()
    calls = [e for e in events if isinstance(e, ParsedCall)]
    content = "".join(e for e in events if isinstance(e, str))
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls


class StreamedCalls:
    """One streamed choice: text deltas in, chat delta pieces out (content, or tool_calls
    deltas as the SDK accumulates them). `plan`: server/tools.ToolPlan or None."""

    def __init__(self, plan):
        self._plan = plan
        self._named_id: str | None = None
        self._parser = (make_parser(plan.format, plan.names, plan.parallel)
                        if plan is not None and plan.parses_calls else None)
        self.num_calls = 0

    def push(self, text: str) -> list[DeltaMessage]:
        if self._plan is not None and self._plan.mode == "named":
            return self._named(text)
        if self._parser is None:
            return [DeltaMessage(content=text)] if text else []
        return self._pieces(self._parser.push(text))

    def flush(self) -> list[DeltaMessage]:
        return self._pieces(self._parser.flush()) if self._parser is not None else []

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def _named(self, text: str) -> list[DeltaMessage]:
        if self._named_id is None:
            self._named_id = new_call_id()
            self.num_calls = 1
            return [DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, id=self._named_id, type="function",
                function=DeltaFunctionCall(name=self._plan.named, arguments=text))])]
        return [DeltaMessage(tool_calls=[DeltaToolCall(
            index=0, function=DeltaFunctionCall(arguments=text))])] if text else []

    def _pieces(self, events: list[Event]) -> list[DeltaMessage]:
        out = []
        for e in events:
            if isinstance(e, str):
                out.append(DeltaMessage(content=e))
                continue
            out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                index=self.num_calls, id=e.id, type="function",
                function=DeltaFunctionCall(name=e.name, arguments=e.arguments))]))
            self.num_calls += 1
        return out
