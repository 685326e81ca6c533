"""What the engine hands back to the server, per request per step (plain data)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int | None = None         # 1 + how many tokens are likelier (prompt logprobs only)


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
    # prompt_logprobs: on the request's first output, one entry per prompt token (None for
    # the first): (the prompt token, top-k alternatives) as new_logprobs has them
    prompt_logprobs: tuple[tuple[TokenLogprob, tuple[TokenLogprob, ...]] | None, ...] | None = None
    # an embedding request's pooled hidden state, on the output that ends it
    embedding: tuple[float, ...] | None = None
    # timestamps (time.monotonic) for metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
