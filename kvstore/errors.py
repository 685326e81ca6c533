"""The KV store's errors that reach the engine (plain Python: engine/admission.py maps them)."""
from __future__ import annotations


class KVFull(Exception):
    """The backing store cannot take this request now (engine: QueueFullError, HTTP 429)."""


class KVNeverFits(ValueError):
    """The request is larger than the backing store could ever hold (engine:
    RequestTooLargeError, HTTP 400)."""


class RequestKVError(Exception):
    """KV pages of some requests were lost (corrupt page, I/O error): fail just those."""

    def __init__(self, request_ids: list[str], message: str):
        super().__init__(message)
        self.request_ids = request_ids
