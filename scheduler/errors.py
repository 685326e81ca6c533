"""Scheduler errors (the engine maps them to engine.protocol errors)."""
from __future__ import annotations


class QueueFull(Exception):
    """The waiting queue holds max_waiting requests already (engine: QueueFullError, HTTP 429)."""


class PriorityNotEnabled(ValueError):
    """A request with a priority under the fcfs policy (engine: PriorityNotEnabledError, 400)."""


class RequestTooLarge(ValueError):
    """prompt + max_tokens can never fit: beyond max_model_len, or more KV pages than exist
    (engine: RequestTooLargeError, HTTP 400)."""
