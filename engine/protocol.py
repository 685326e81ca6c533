"""EngineClient: the only door between the HTTP server and the engine (token ids and
dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams


class EngineError(Exception):
    """Base for errors the server maps to HTTP statuses."""


class EngineNotReadyError(EngineError):
    """The model is still loading (HTTP 503)."""


class EngineDeadError(EngineError):
    """The step loop died; nothing more can be served (HTTP 503)."""


class QueueFullError(EngineError):
    """Too many waiting requests (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLargeError(EngineError):
    """The request can never fit (HTTP 400)."""


class PriorityNotEnabledError(EngineError):
    """A request with a priority while the server schedules first come, first served (400)."""


class TooManyChoicesError(EngineError):
    """n x prompts above the waiting queue's size: the request could never be queued (400)."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    kv_page_bytes: int          # bytes of one page over all layers (K and V)
    kv_tiers: dict = field(default_factory=dict)   # tier -> (used bytes, capacity bytes)
    kv: object | None = None    # kvstore.stats.KVStatsSnapshot: transfers, lookups, hits, ...
    # --pipeline sfc: sequences per micro-batch (0 while the start-up calibration runs); else -1
    pipeline_micro_batch: int = -1
    prefix_queried_tokens: int = 0      # prompt tokens of admitted requests
    prefix_hit_tokens: int = 0          # of which the prefix cache held the KV
    prefix_pages: dict = field(default_factory=dict)   # tier -> cached pages
    kv_disk_io: dict = field(default_factory=dict)     # disk folder -> bytes_read, bytes_written
    spec_decode: tuple[int, int, int] = (0, 0, 0)   # drafts verified, tokens drafted, kept
    # LoRA adapter -> (running, waiting) requests, every loaded adapter listed
    lora_requests: dict = field(default_factory=dict)


class EngineClient(Protocol):
    model_name: str             # the id served at /v1/models
    max_model_len: int          # prompt + completion tokens, at most
    max_waiting: int            # requests waiting at most (QueueFullError beyond)
    # request field -> the model's default, for requests that leave it unset
    # (engine/generation_defaults.py; {} until the model is loaded)
    sampling_defaults: dict

    @property
    def is_ready(self) -> bool: ...

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Submit and stream outputs until one with finished=True. Raises QueueFullError,
        EngineNotReadyError, EngineDeadError, RequestTooLargeError before the first output.
        Closing the iterator early (client gone) aborts the request and frees its pages."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def load_lora(self, name: str, path: str) -> None:
        """Serve a LoRA adapter from the next step on (ValueError: name taken, no adapter)."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Stop serving one (KeyError: not loaded; ValueError: requests use it)."""
        ...

    def stats(self) -> EngineStats: ...
