"""A request as the scheduler sees it: token ids and progress, no tensors."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the KV store. Catches up to num_tokens under the token budget
    # (chunked prefill); reset to 0 on preemption (recompute).
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # prompt tokens whose KV came from the prefix cache when first admitted (None: not yet)
    num_cached_tokens: int | None = None
    # what the prefix cache keys this request's pages under besides its tokens (its
    # cache_salt, and its LoRA adapter's digest: that KV is the adapter's); None: shared
    prefix_salt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """all_token_ids[start:end] without copying the whole prompt (long contexts)."""
        prompt, outputs = self.prompt_token_ids, self.output_token_ids
        n = len(prompt)
        if end <= n:
            return tuple(prompt[start:end])
        if start >= n:
            return tuple(outputs[start - n:end - n])
        return tuple(prompt[start:]) + tuple(outputs[:end - n])

    @property
    def finished(self) -> bool:
        return self.status.finished
