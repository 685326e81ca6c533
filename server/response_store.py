"""ResponseStore: the responses created with `store: true`, kept in memory so that a later
request can continue one (`previous_response_id`) and a client can read or delete it
(GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items).

Each entry keeps its own turn only: the input items it was sent, its output items and the id
of the response it continued; a conversation is rebuilt by walking those links back, so a
long chat costs memory once per turn, not once per turn per turn. The store is bounded in
bytes (`--responses-store-mb`, the JSON size of the entries): the least recently used entries
go first; a conversation one of whose turns was evicted cannot be continued (400 naming the
missing id). Lost on restart, as vLLM's; 0 MB stores nothing.
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_RESPONSES_STORE_MB = 64.0


class MissingResponse(KeyError):
    """A response id the store does not hold (never stored, deleted or evicted)."""

    def __init__(self, response_id: str):
        super().__init__(response_id)
        self.response_id = response_id


@dataclass
class StoredResponse:
    response: dict[str, Any]                 # the response object, as answered
    input_items: list[dict[str, Any]]        # this turn's input items (with ids)
    previous_id: str | None = None
    size: int = field(default=0, compare=False)

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response.get("output", [])


class ResponseStore:
    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def put(self, entry: StoredResponse) -> bool:
        """Keep `entry` (its response's id is its key), evicting the least recently used
        entries past the byte budget. False when it alone is over the budget (not kept)."""
        entry.size = len(json.dumps([entry.response, entry.input_items], ensure_ascii=False))
        if entry.size > self.max_bytes:
            if self.enabled:
                logger.warning("response %s (%d bytes) is over --responses-store-mb: not "
                               "stored", entry.response.get("id"), entry.size)
            return False
        self.delete(entry.response["id"])
        self._entries[entry.response["id"]] = entry
        self._bytes += entry.size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size
        return True

    def get(self, response_id: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise MissingResponse(response_id)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every item of the conversation up to and including `response_id`'s output, oldest
        first (input items, then output items, turn by turn). MissingResponse names the
        first turn that is gone."""
        turns: list[StoredResponse] = []
        current: str | None = response_id
        while current is not None and len(turns) <= len(self._entries):
            entry = self.get(current)
            turns.append(entry)
            current = entry.previous_id
        items: list[dict[str, Any]] = []
        for entry in reversed(turns):
            items += entry.input_items + entry.output
        return items
