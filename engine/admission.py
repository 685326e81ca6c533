"""Admission: whether a request may enter the engine, decided here, in one vocabulary.

Every refusal is one of engine/protocol.py's errors, and server/errors.py maps each of those
to one HTTP answer (its `ANSWERS` table):

| check                                             | error                 | HTTP |
|---------------------------------------------------|-----------------------|------|
| n x prompts above --max-waiting: can never queue  | TooManyChoicesError   | 400  |
| a priority without --scheduling-policy priority   | PriorityNotEnabled... | 400  |
| prompt + max_tokens above the KV store or context | RequestTooLargeError  | 400  |
| --max-waiting of this client's requests waiting,  | QueueFullError        | 429  |
| or --max-waiting-total of all clients' requests   |                       |      |
| the disk tier has no room now                     | QueueFullError        | 429  |
| the model is loading / the step loop died         | EngineNotReady / Dead | 503  |

The checks run on the caller's thread before a request is queued (`check_choices`,
`Admission.check`), so a refusal costs the engine nothing. The scheduler and the KV store
enforce their own limits again when the engine thread takes the request (a race with other
requests, or the disk filling up); `refusal` maps their errors into the same vocabulary.
Plain Python: the server imports this (the KV store's and scheduler's errors only in
`refusal`).
"""
from __future__ import annotations

from engine.protocol import (EngineError, PriorityNotEnabledError, QueueFullError,
                             RequestTooLargeError, TooManyChoicesError)


def _refusals() -> tuple:
    """The lower layers' refusals, in the engine's vocabulary (imported here: the server
    imports this module and must import neither the KV store nor the scheduler)."""
    from kvstore.errors import KVFull, KVNeverFits
    from scheduler.errors import PriorityNotEnabled, QueueFull, RequestTooLarge
    return ((QueueFull, QueueFullError), (KVFull, QueueFullError),
            (RequestTooLarge, RequestTooLargeError), (KVNeverFits, RequestTooLargeError),
            (PriorityNotEnabled, PriorityNotEnabledError))


def refusal(exc: Exception) -> EngineError:
    """The engine error for a request the scheduler or the KV store refused."""
    for kind, error in _refusals():
        if isinstance(exc, kind):
            return error(str(exc))
    return EngineError(f"request refused: {exc}")


def check_choices(choices: int, max_waiting: int) -> None:
    """A request whose choices (n x prompts, each an engine request, all waiting together)
    could never be queued: "never" (400), not "not now" (429)."""
    if choices > max_waiting:
        raise TooManyChoicesError(
            f"The request makes {choices} generations (n x prompts) but this server queues at "
            f"most {max_waiting} (--max-waiting); send fewer at a time.")


class Admission:
    """The limits one engine admits requests under."""

    def __init__(self, max_model_len: int, kv_capacity_tokens: int, kv_backing: str,
                 max_waiting: int, max_waiting_total: int, policy: str = "fcfs"):
        self.max_model_len = max_model_len
        self.policy = policy                        # the scheduler's (fcfs or priority)
        self.kv_capacity_tokens = kv_capacity_tokens
        self.kv_backing = kv_backing
        self.max_waiting = max_waiting              # per client (scheduler/scheduler.py)
        self.max_waiting_total = max_waiting_total

    def check(self, prompt_tokens: int, max_tokens: int, waiting: int,
              waiting_total: int, priority: int = 0) -> None:
        """Raises RequestTooLargeError (never fits), PriorityNotEnabledError or QueueFullError
        (not now); `waiting`: the requests of the same client waiting, `waiting_total`: all
        clients'."""
        if priority and self.policy != "priority":
            from scheduler.scheduler import PRIORITY_NOT_ENABLED
            raise PriorityNotEnabledError(PRIORITY_NOT_ENABLED)
        need = prompt_tokens + max_tokens
        if need > self.max_model_len:
            raise RequestTooLargeError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {need} exceeds "
                f"the maximum context length of {self.max_model_len} tokens")
        if need > self.kv_capacity_tokens:
            raise RequestTooLargeError(
                f"request needs KV for {need} tokens but the KV store holds "
                f"{self.kv_capacity_tokens}; raise --kv-{self.kv_backing}-gb or lower max_tokens")
        if waiting >= self.max_waiting:
            raise QueueFullError(f"{self.max_waiting} requests of this client are already "
                                 "waiting; retry later")
        if waiting_total >= self.max_waiting_total:
            raise QueueFullError(f"{self.max_waiting_total} requests are already waiting; "
                                 "retry later")
