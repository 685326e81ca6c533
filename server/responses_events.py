"""ResponseEvents: one answer's engine deltas turned into the Responses API's output items and
the stream events that build them, in the order the OpenAI SDK's stream accumulator checks.

    response.created, response.in_progress
    per output item: response.output_item.added, then
        a message:       response.content_part.added, response.output_text.delta ...,
                         response.output_text.done, response.content_part.done
        a function call: response.function_call_arguments.delta ...,
                         response.function_call_arguments.done
        reasoning:       response.reasoning_text.delta ..., response.reasoning_text.done
    response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

A reasoning model's <think> text is a reasoning item before the rest (server/reasoning.py);
text and tool calls are split as chat streams them (server/tool_parser.StreamedCalls). Without
tools (or with tool_choice "none") the message item opens at once, so an empty answer is an
empty message; with tools whitespace waits for the text after it: a message opens at text
that is not whitespace (and starts there), and the whitespace before a call (or between
calls) is no text. A non-streamed response is built by
the same object from one delta holding the whole answer, so both paths give the same items.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from server.choice_stream import ChoiceDelta, Logprobs
from server.protocol_tools import DeltaToolCall
from server.responses_protocol import new_id
from server.reasoning import ReasoningSplitter
from server.responses_wire import (FunctionCallOutput, IncompleteDetails, LogprobEntry,
                                   OutputMessage, OutputText, ReasoningOutput, ReasoningText,
                                   ResponseErrorInfo, ResponseObject, ResponseUsage)
from server.tool_parser import StreamedCalls

Event = dict[str, Any]
LogprobFormat = Callable[[Logprobs], list[LogprobEntry]]


class ResponseEvents:
    def __init__(self, response: ResponseObject, plan, logprobs: LogprobFormat | None = None,
                 reasoning: str | None = None):
        """response: the object so far (no output); plan: server/tools.ToolPlan or None;
        logprobs: formats a delta's token logprobs (None: not asked for); reasoning: the
        reasoning style (server/reasoning.py; None: none)."""
        self.response = response
        self._calls = StreamedCalls(plan)
        self._thinking = ReasoningSplitter(reasoning) if reasoning else None
        self._eager = plan is None or plan.mode == "none"
        self._logprobs = logprobs
        self._seq = 0
        self._open: OutputMessage | FunctionCallOutput | None = None
        self._held = ""                      # whitespace before any message text (tools)
        self._pending: list[LogprobEntry] = []  # logprobs of tokens not yet written as text

    def start(self) -> list[Event]:
        events = [self._event("response.created", response=self._dump()),
                  self._event("response.in_progress", response=self._dump())]
        if self._eager and self._thinking is None:    # (a reasoning item may come first)
            events += self._open_message()
        return events

    def push(self, delta: ChoiceDelta) -> list[Event]:
        if self._logprobs is not None and delta.logprobs:
            self._pending += self._logprobs(delta.logprobs)
        thinking, text = self._thinking, delta.text
        parts = ([("content", text)] if thinking is None else thinking.push(text)) if text else []
        if delta.finish_reason and thinking is not None:
            parts += thinking.flush()
        events: list[Event] = []
        for kind, part in parts:
            if kind == "reasoning":
                events += self._think(part)
            else:
                events += self._pieces(self._calls.push(part))
        if delta.finish_reason:
            events += self._pieces(self._calls.flush())
        return events

    def _pieces(self, pieces) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if piece.content:
                events += self._text(piece.content)
            for call in piece.tool_calls or ():
                events += self._call(call)
        return events

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[Event]:
        """Close the open item; the final event, with the whole response."""
        cut = finish_reason == "length"
        held, self._held = self._held, ""
        events = self._write(held) if held and isinstance(self._open, OutputMessage) else []
        if self._eager and not any(isinstance(i, OutputMessage) for i in self.response.output):
            events += self._close("completed") + self._open_message()   # an empty answer
        events += self._close("incomplete" if cut else "completed")
        r = self.response
        r.status = "incomplete" if cut else "completed"
        r.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        r.usage = usage
        r.completed_at = int(time.time())
        return events + [self._event(f"response.{r.status}", response=self._dump())]

    def fail(self, message: str) -> list[Event]:
        self.response.status = "failed"
        self.response.error = ResponseErrorInfo(code="server_error", message=message)
        return [self._event("response.failed", response=self._dump())]

    # ------------------------------------------------------------------------------ items
    def _text(self, text: str) -> list[Event]:
        if self._eager:
            return self._write(text)
        # with tools, whitespace waits for text: none opens a message, none ends one before
        # a call (what the model writes between and around its calls)
        text = self._held + text
        if not isinstance(self._open, OutputMessage):
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        return self._write(body) if body else []

    def _write(self, text: str) -> list[Event]:
        """`text` appended to the open message (a new one when a call is open, or nothing)."""
        events: list[Event] = []
        if not isinstance(self._open, OutputMessage):
            events += self._close("completed") + self._open_message()
        message = self._open
        part = message.content[0]
        part.text += text
        logprobs, self._pending = self._pending, []
        if part.logprobs is not None:
            part.logprobs += logprobs
        events.append(self._event("response.output_text.delta", item_id=message.id,
                                  output_index=self._index(), content_index=0, delta=text,
                                  logprobs=[e.model_dump() for e in logprobs]))
        return events

    def _think(self, text: str) -> list[Event]:
        """`text` appended to the open reasoning item (a new one after any other item)."""
        events: list[Event] = []
        item = self._open
        if not isinstance(item, ReasoningOutput):
            events += self._close("completed")
            item = ReasoningOutput(id=new_id("rs"), content=[ReasoningText()])
            self.response.output.append(item)
            self._open = item
            events.append(self._event("response.output_item.added", output_index=self._index(),
                                      item=item.model_dump()))
        item.content[0].text += text
        self._pending = []                      # logprobs go with the message's text only
        events.append(self._event("response.reasoning_text.delta", item_id=item.id,
                                  output_index=self._index(), content_index=0, delta=text))
        return events

    def _call(self, call: DeltaToolCall) -> list[Event]:
        events: list[Event] = []
        if call.id is not None:                  # a new call (its name comes with its id)
            events += self._close("completed")
            self._held, self._pending = "", []   # tokens of the call: not message text
            item = FunctionCallOutput(id=new_id("fc"), call_id=call.id,
                                      name=call.function.name if call.function else "")
            self.response.output.append(item)
            self._open = item
            events.append(self._event("response.output_item.added",
                                      output_index=self._index(), item=item.model_dump()))
        item = self._open
        arguments = call.function.arguments if call.function else None
        if arguments and isinstance(item, FunctionCallOutput):
            item.arguments += arguments
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item.id, output_index=self._index(),
                                      delta=arguments))
        return events

    def _open_message(self) -> list[Event]:
        part = OutputText(logprobs=[] if self._logprobs is not None else None)
        message = OutputMessage(id=new_id("msg"), content=[part])
        self.response.output.append(message)
        self._open = message
        index = self._index()
        empty = OutputMessage(id=message.id)
        return [self._event("response.output_item.added", output_index=index,
                            item=empty.model_dump()),
                self._event("response.content_part.added", item_id=message.id,
                            output_index=index, content_index=0, part=part.model_dump())]

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.response.output) - 1
        item.status = status
        events: list[Event] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events += [self._event("response.output_text.done", item_id=item.id,
                                   output_index=index, content_index=0, text=part.text,
                                   logprobs=[e.model_dump() for e in part.logprobs or ()]),
                       self._event("response.content_part.done", item_id=item.id,
                                   output_index=index, content_index=0,
                                   part=part.model_dump())]
        elif isinstance(item, ReasoningOutput):
            events.append(self._event("response.reasoning_text.done", item_id=item.id,
                                      output_index=index, content_index=0,
                                      text=item.content[0].text))
        else:
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item.id, output_index=index, name=item.name,
                                      arguments=item.arguments))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=item.model_dump()))
        return events

    def _index(self) -> int:
        return len(self.response.output) - 1

    def _dump(self) -> dict[str, Any]:
        return self.response.model_dump()

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
