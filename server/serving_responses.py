"""ResponsesServing: the OpenAI Responses API (POST /v1/responses, and GET / DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items for stored responses).

A response request is answered as the chat completion it means: its instructions, the stored
conversation behind `previous_response_id` and its input items become chat messages
(server/responses_protocol.py), its other fields the chat request's (tools, text.format as
response_format, max_output_tokens as max_tokens, ...), and the chat path's tool plan,
grammar, template and generation run unchanged; only the answer's shape differs (output
items, usage, named stream events: server/responses_events.py). Errors name the Responses
API's fields (`input`, `text.format`, `max_output_tokens`). `truncation: "auto"` drops the
oldest turns (never the instructions) until the prompt leaves room for the answer.
`background: true` runs the response as a task (server/background_runs.py): the request is
answered at once (status `queued`, or the events as they come with `stream`), GET polls it or
follows its events (`stream=true&starting_after=N`), POST .../cancel stops it.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import anyio
from fastapi import Request
from pydantic import TypeAdapter
from starlette.responses import JSONResponse, Response

from server.background_runs import BackgroundRun, BackgroundRuns
from server.choice_stream import ChoiceDelta, Logprobs
from server.errors import APIError, invalid_request
from server.generation import ChoiceResult, Generation
from server.protocol import ChatCompletionRequest, ChatMessage
from server.response_store import MissingResponse, ResponseStore, StoredResponse
from server.responses_events import Event, ResponseEvents
from server.responses_protocol import (InputItem, ResponsesRequest, chat_messages_of,
                                       item_records, new_id)
from server.responses_wire import (DeletedResponse, InputItemList, InputTokensDetails,
                                   LogprobEntry, ResponseObject, ResponseUsage,
                                   TopLogprobEntry)
from server.serving import OpenAIServing, clamp_logprob, json_response, to_api_error
from server.serving_chat import chat_prompt_ids, chat_request, constraints
from server.sse import EventStreamResponse, sse_named_event

_ITEMS = TypeAdapter(list[InputItem])
# the chat request's parameter names in errors -> the Responses API's
_PARAMS = (("response_format.json_schema.schema", "text.format.schema"),
           ("response_format", "text.format"), ("messages", "input"),
           ("max_tokens", "max_output_tokens"))
MAX_LISTED_ITEMS = 100


class ResponsesServing(OpenAIServing):
    named_events = True

    def __init__(self, ctx, store: ResponseStore, runs: BackgroundRuns | None = None):
        super().__init__(ctx)
        self.store = store
        self.runs = runs if runs is not None else BackgroundRuns()

    async def create(self, request: ResponsesRequest, raw: Request) -> Response:
        try:
            return await self._create(request, raw)
        except APIError as exc:
            raise _renamed(exc) from None

    async def _create(self, request: ResponsesRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        tokenizer = self.ctx.require_ready()
        if request.background and not (request.store is not False and self.store.enabled):
            raise invalid_request("background responses are stored: they need store: true "
                                  "and the response store (--responses-store-mb > 0).",
                                  param="background")
        items = request.input_items()
        chat = _chat_request(request, self._history(request.previous_response_id) + items)
        # NOTE: compiling a large schema takes milliseconds: not on the event loop
        plan, grammar = await anyio.to_thread.run_sync(constraints, chat,
                                                       self.ctx.tool_format)
        chat, prompt_ids = await self._prompt(request, chat, tokenizer)
        response_id = new_id("resp")
        generation = self.generation(chat, [prompt_ids], response_id, "input", grammar,
                                     chat=True)
        base = self._base(request, response_id)
        records = item_records(items)
        k = request.top_logprobs or 0
        logprobs = (lambda entries: self._logprobs(entries, k)) if request.logprobs else None

        style = self.ctx.reasoning_style

        def fresh() -> ResponseEvents:
            return ResponseEvents(base.model_copy(deep=True), plan, logprobs, style)

        if request.background:
            return self._start(request, generation, fresh(), records)
        return await self.respond(
            raw, generation, stream=bool(request.stream),
            events=lambda: self._events(fresh(), generation, request, records),
            build=lambda results: self._build(fresh(), generation, results, request, records))

    # ------------------------------------------------------------------ background
    def _start(self, request: ResponsesRequest, generation: Generation, events: ResponseEvents,
               records: list[dict]) -> Response:
        """Run the response as a task; answer it queued, or follow its events (stream)."""
        queued = events.response.model_copy(update={"status": "queued"})
        self.store.put(StoredResponse(queued.model_dump(), records,
                                      request.previous_response_id))
        run = self.runs.start(queued.id, events.response.model_dump,
                              lambda run: self._run(run, events, generation, request, records))
        if request.stream:
            return EventStreamResponse(_sse(run, None), on_close=_nothing)
        return json_response(queued)

    async def _run(self, run: BackgroundRun, events: ResponseEvents, generation: Generation,
                   request: ResponsesRequest, records: list[dict]) -> None:
        """A background response's work: its events into the run, the response into the
        store however it ends (completed, incomplete, failed, refused or cancelled)."""
        try:
            try:
                await generation.start()
            except Exception as exc:  # noqa: BLE001 - refused (429, 503, ...): it fails
                for event in events.start() + events.fail(to_api_error(exc).message):
                    run.add(event)
                return
            async for event in self._events(events, generation, request, records):
                run.add(event)
        except asyncio.CancelledError:
            events.response.status = "cancelled"
            raise
        finally:
            await generation.close()
            self._keep(request, events.response, records)

    async def cancel(self, response_id: str) -> Response:
        """Stop a background response (idempotent: an ended one is answered as it is)."""
        if await self.runs.cancel(response_id):
            return JSONResponse(self.runs.get(response_id).snapshot())
        stored = self._stored(response_id)
        if not stored.response.get("background"):
            raise invalid_request("Only responses created with background: true can be "
                                  "cancelled.", param="response_id")
        return JSONResponse(stored.response)

    # ------------------------------------------------------------------ stored responses
    def retrieve(self, response_id: str, stream: bool = False,
                 starting_after: int | None = None) -> Response:
        """The response (a running background one as built so far); with `stream`, a
        background response's events after `starting_after`, as they come."""
        run = self.runs.get(response_id)
        if stream:
            if run is None:
                self._stored(response_id)                   # 404 for an unknown id
                raise invalid_request("Only background responses can be streamed again "
                                      f"(the events of the last {self.runs.keep_ended} "
                                      "ended ones are kept).", param="stream")
            return EventStreamResponse(_sse(run, starting_after), on_close=_nothing)
        if run is not None and not run.ended:
            return JSONResponse(run.snapshot())
        return JSONResponse(self._stored(response_id).response)

    def delete(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return json_response(DeletedResponse(id=response_id))

    def input_items(self, response_id: str, limit: int, order: str,
                    after: str | None) -> Response:
        """A page of the response's input items (newest first unless order is asc), after
        the item `after` when given."""
        data = list(self._stored(response_id).input_items)
        if order == "desc":
            data.reverse()
        if after is not None:
            ids = [item["id"] for item in data]
            if after not in ids:
                raise invalid_request(f"No input item with id '{after}' in this response.",
                                      param="after")
            data = data[ids.index(after) + 1:]
        page = data[:limit]
        return json_response(InputItemList(
            data=page, first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None, has_more=len(data) > limit))

    def _stored(self, response_id: str) -> StoredResponse:
        try:
            return self.store.get(response_id)
        except MissingResponse:
            raise _not_found(response_id) from None

    def _history(self, previous_id: str | None) -> list:
        if previous_id is None:
            return []
        if not self.store.enabled:
            raise invalid_request("previous_response_id needs the response store, which this "
                                  "server runs without (--responses-store-mb 0).",
                                  param="previous_response_id")
        try:
            return _ITEMS.validate_python(self.store.conversation(previous_id))
        except MissingResponse as exc:
            raise invalid_request(f"Previous response with id '{exc.response_id}' not found.",
                                  param="previous_response_id",
                                  code="previous_response_not_found") from None

    def _keep(self, request: ResponsesRequest, response: ResponseObject,
              records: list[dict]) -> None:
        if response.store:
            self.store.put(StoredResponse(response.model_dump(), records,
                                          request.previous_response_id))

    # ------------------------------------------------------------------ the prompt
    async def _prompt(self, request: ResponsesRequest, chat: ChatCompletionRequest,
                      tokenizer) -> tuple[ChatCompletionRequest, list[int]]:
        """The prompt's token ids; with truncation "auto", of the latest turns that leave
        room for the answer (the chat request without the dropped ones)."""
        room = request.max_output_tokens or 1
        while True:
            ids = await chat_prompt_ids(self, chat, tokenizer, "input",
                                        truncated=request.truncation == "auto")
            fits = len(ids) + room <= self.ctx.max_model_len
            shorter = None if fits or request.truncation != "auto" else _drop_oldest(
                chat.messages)
            if shorter is None:
                return chat, ids
            chat = chat.model_copy(update={"messages": shorter})

    def _base(self, request: ResponsesRequest, response_id: str) -> ResponseObject:
        choice = request.tool_choice
        defaults = self.ctx.sampling_defaults
        text = (request.text.model_dump(by_alias=True, exclude_none=True)
                if request.text is not None and request.text.format is not None else None)
        return ResponseObject(
            id=response_id, created_at=int(time.time()), model=self.ctx.model_name(request.model),
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id,
            store=request.store is not False and self.store.enabled,
            # the values sampling used, as OpenAI echoes them: the model's default where the
            # request set none (--generation-config), else the API's
            temperature=_used(request.temperature, "temperature", defaults, 1.0),
            top_p=_used(request.top_p, "top_p", defaults, 1.0),
            top_logprobs=request.top_logprobs,
            tool_choice=(choice.model_dump() if hasattr(choice, "model_dump")
                         else choice or "auto"),
            tools=[t.model_dump(exclude_none=True) for t in request.tools or ()],
            **({"text": text} if text else {}), truncation=request.truncation or "disabled",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            metadata=request.metadata or {}, user=request.user,
            background=bool(request.background))

    # ------------------------------------------------------------------ the answer
    async def _events(self, events: ResponseEvents, generation: Generation,
                      request: ResponsesRequest, records: list[dict]) -> AsyncIterator[Event]:
        for event in events.start():
            yield event
        reason = None
        try:
            async for delta in generation.deltas():
                for event in events.push(delta):
                    yield event
                reason = delta.finish_reason or reason
        except Exception as exc:                 # mid-stream: response.failed ends it
            for event in events.fail(to_api_error(exc).message):
                yield event
            return
        for event in events.finish(reason, _usage(generation)):
            yield event
        self._keep(request, events.response, records)

    def _build(self, events: ResponseEvents, generation: Generation,
               results: list[ChoiceResult], request: ResponsesRequest,
               records: list[dict]) -> ResponseObject:
        (r,) = results
        events.start()
        events.push(ChoiceDelta(r.index, r.text, tuple(r.logprobs), r.finish_reason))
        events.finish(r.finish_reason, _usage(generation))
        self._keep(request, events.response, records)
        return events.response

    def _logprobs(self, entries: Logprobs, k: int) -> list[LogprobEntry]:
        return [LogprobEntry(
            token=self.token_text(sampled), logprob=clamp_logprob(sampled.logprob),
            bytes=self.token_bytes(sampled),
            top_logprobs=[TopLogprobEntry(token=self.token_text(t),
                                          logprob=clamp_logprob(t.logprob),
                                          bytes=self.token_bytes(t)) for t in top[:k]])
            for sampled, top in entries]


def _chat_request(request: ResponsesRequest, items: list) -> ChatCompletionRequest:
    """The chat completion request that means `request` over the conversation `items`."""
    messages = chat_messages_of(items)
    if not messages:
        raise invalid_request("The input has no message to answer.", param="input")
    if request.instructions:
        messages.insert(0, {"role": "system", "content": request.instructions})
    return chat_request({**request.chat_fields(), "messages": messages}, "input", "input")


def _drop_oldest(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """The messages without the oldest turn after the system ones (and the tool outputs that
    answered its calls), or None when only the last turn is left."""
    head = 0
    while head < len(messages) and messages[head].role in ("system", "developer"):
        head += 1
    end = head + 1
    while end < len(messages) and messages[end].role == "tool":
        end += 1
    if end >= len(messages):
        return None
    return messages[:head] + messages[end:]


def _usage(generation: Generation) -> ResponseUsage:
    u = generation.usage()
    return ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                         input_tokens_details=InputTokensDetails(
                             cached_tokens=u.prompt_tokens_details.cached_tokens),
                         total_tokens=u.total_tokens)


def _renamed(exc: APIError) -> APIError:
    """`exc` with the chat request's parameter names replaced by the Responses API's."""
    param = exc.param or ""
    for old, new in _PARAMS:
        if param == old or param.startswith((old + ".", old + "[")):
            exc.param = new + param[len(old):]
            exc.message = exc.message.replace(old, new)
            break
    if param.startswith("tools[") and ".function." in param:
        exc.param = param.replace(".function.", ".")
        exc.message = exc.message.replace(param, exc.param)
    return exc


async def _sse(run: BackgroundRun, starting_after: int | None) -> AsyncIterator[str]:
    async for event in run.follow(starting_after):
        yield sse_named_event(event["type"], event)


async def _nothing() -> None:
    """A follower leaving stops nothing (the run goes on)."""


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.",
                    type="invalid_request_error", param="response_id", code="not_found")


def _used(value: float | None, field: str, defaults: dict, api_default: float) -> float:
    return value if value is not None else defaults.get(field, api_default)
