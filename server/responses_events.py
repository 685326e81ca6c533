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

Each of the answer's blocks (server/answer_blocks.py: reasoning, text, calls) is one output
item: a reasoning item, a message with one output_text part, a function call. A non-streamed
response is built by the same object from one delta holding the whole answer, so both paths
give the same items.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from server.answer_blocks import AnswerBlocks, BlockEvent
from server.choice_stream import ChoiceDelta, Logprobs
from server.responses_protocol import new_id
from server.responses_wire import (FunctionCallOutput, IncompleteDetails, LogprobEntry,
                                   OutputMessage, OutputText, ReasoningOutput, ReasoningText,
                                   ResponseErrorInfo, ResponseObject, ResponseUsage)

Event = dict[str, Any]
LogprobFormat = Callable[[Logprobs], list[LogprobEntry]]


class ResponseEvents:
    def __init__(self, response: ResponseObject, plan, logprobs: LogprobFormat | None = None,
                 reasoning: str | None = None):
        """response: the object so far (no output); plan: server/tools.ToolPlan or None;
        logprobs: formats a delta's token logprobs (None: not asked for); reasoning: the
        reasoning style (server/reasoning.py; None: none)."""
        self.response = response
        self._blocks = AnswerBlocks(plan, reasoning)
        self._logprobs = logprobs
        self._closing = "completed"         # the status of the items closed from here on
        self._seq = 0

    def start(self) -> list[Event]:
        events = [self._event("response.created", response=self._dump()),
                  self._event("response.in_progress", response=self._dump())]
        return events + self._render(self._blocks.start())

    def push(self, delta: ChoiceDelta) -> list[Event]:
        entries = self._logprobs(delta.logprobs) if self._logprobs and delta.logprobs else None
        return self._render(self._blocks.push(delta, entries))

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[Event]:
        """Close the open item; the final event, with the whole response."""
        cut = finish_reason == "length"
        self._closing = "incomplete" if cut else "completed"
        events = self._render(self._blocks.finish())
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
    def _render(self, events: list[BlockEvent]) -> list[Event]:
        out: list[Event] = []
        for e in events:
            out += (self._opened if e.op == "open" else
                    self._written if e.op == "write" else self._closed)(e)
        return out

    def _opened(self, e: BlockEvent) -> list[Event]:
        block = e.block
        if block.kind == "text":
            part = OutputText(logprobs=[] if self._logprobs is not None else None)
            item = OutputMessage(id=new_id("msg"), content=[part])
            self.response.output.append(item)
            return [self._event("response.output_item.added", output_index=block.index,
                                item=OutputMessage(id=item.id).model_dump()),
                    self._event("response.content_part.added", item_id=item.id,
                                output_index=block.index, content_index=0,
                                part=part.model_dump())]
        if block.kind == "reasoning":
            item = ReasoningOutput(id=new_id("rs"), content=[ReasoningText()])
        else:
            item = FunctionCallOutput(id=new_id("fc"), call_id=block.call_id, name=block.name)
        self.response.output.append(item)
        return [self._event("response.output_item.added", output_index=block.index,
                            item=item.model_dump())]

    def _written(self, e: BlockEvent) -> list[Event]:
        index = e.block.index
        item = self.response.output[index]
        if isinstance(item, OutputMessage):
            part = item.content[0]
            part.text += e.text
            if part.logprobs is not None:
                part.logprobs += e.logprobs
            return [self._event("response.output_text.delta", item_id=item.id,
                                output_index=index, content_index=0, delta=e.text,
                                logprobs=[entry.model_dump() for entry in e.logprobs])]
        if isinstance(item, ReasoningOutput):
            item.content[0].text += e.text
            return [self._event("response.reasoning_text.delta", item_id=item.id,
                                output_index=index, content_index=0, delta=e.text)]
        item.arguments += e.text
        return [self._event("response.function_call_arguments.delta", item_id=item.id,
                            output_index=index, delta=e.text)]

    def _closed(self, e: BlockEvent) -> list[Event]:
        index = e.block.index
        item = self.response.output[index]
        item.status = self._closing
        events: list[Event] = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events += [self._event("response.output_text.done", item_id=item.id,
                                   output_index=index, content_index=0, text=part.text,
                                   logprobs=[x.model_dump() for x in part.logprobs or ()]),
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
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=item.model_dump())]

    def _dump(self) -> dict[str, Any]:
        return self.response.model_dump()

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
