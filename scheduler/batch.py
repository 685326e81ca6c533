"""The scheduler -> engine contract for one step (ints only)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledRequest:
    request_id: str
    token_ids: tuple[int, ...]   # tokens whose K/V this step computes (a prefill chunk, or 1 for
                                 # decode)
    start_pos: int               # position of token_ids[0] == num_computed_tokens before the step
    page_ids: tuple[int, ...]    # the request's KV pages, covering [0, start_pos + len(token_ids))
    sample: bool                 # True when the chunk ends at the last known token: sample one
                                 # token
    drafts: int = 0              # the last `drafts` token_ids are speculated (a decode's pending
                                 # token, then drafts: each position is sampled and checked,
                                 # scheduler/speculative.py)


@dataclass(frozen=True)
class ScheduledBatch:
    requests: tuple[ScheduledRequest, ...]   # running requests first, then newly admitted ones
    preempted_ids: tuple[str, ...] = ()      # requests whose pages were freed for recompute this
                                             # step

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def decode_only(self) -> bool:
        """Every request decodes: one token, or one and its drafts (no prompt chunk)."""
        return self.num_tokens == len(self.requests) + sum(r.drafts for r in self.requests)
