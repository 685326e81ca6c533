"""What the engine hands back to the server, per request per step (plain data)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]                    # tokens sampled since the last output
    # one entry per new token when logprobs were asked: (sampled, top-k alternatives)
    new_logprobs: tuple[tuple[TokenLogprob, tuple[TokenLogprob, ...]], ...] = ()
    finished: bool = False
    finish_reason: str | None = None                  # "stop" | "length" | "abort" | "error"
    error: str | None = None                          # message when finish_reason == "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0                        # prompt tokens the prefix cache held
    num_output_tokens: int = 0
    # timestamps (time.monotonic) for metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
