"""EngineSlot: an EngineClient that stands in until the real engine has loaded.

The CLI serves HTTP before the model is loaded, so /health can answer 503 meanwhile. The slot
reports not ready (and refuses requests with EngineNotReadyError) until the loader thread calls
:meth:`attach`, then delegates everything to the engine.
"""
from __future__ import annotations

from typing import AsyncIterator

from engine.outputs import RequestOutput
from engine.protocol import EngineClient, EngineDeadError, EngineNotReadyError, EngineStats
from scheduler.sampling_params import SamplingParams
from server.tokenizer import Tokenizer

_EMPTY_STATS = EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=0,
                           kv_page_bytes=0)


class EngineSlot:
    def __init__(self, model_name: str):
        self._model_name = model_name
        self._engine: EngineClient | None = None
        self._tokenizer: Tokenizer | None = None
        self._failure: str | None = None

    def attach(self, engine: EngineClient, tokenizer: Tokenizer) -> None:
        """Called once, from the loader thread, when the engine has loaded (no lock needed:
        one reference assignment each, and the tokenizer is set first)."""
        self._tokenizer = tokenizer
        self._engine = engine

    def fail(self, message: str) -> None:
        self._failure = message

    @property
    def engine(self) -> EngineClient | None:
        return self._engine

    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    # ---------------------------------------------------------------- EngineClient
    @property
    def model_name(self) -> str:
        return self._engine.model_name if self._engine is not None else self._model_name

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len if self._engine is not None else 0

    @property
    def max_waiting(self) -> int:
        return self._engine.max_waiting if self._engine is not None else 0

    @property
    def sampling_defaults(self) -> dict:
        return self._engine.sampling_defaults if self._engine is not None else {}

    @property
    def is_ready(self) -> bool:
        return self._engine is not None and self._engine.is_ready

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._engine is None:
            if self._failure is not None:
                raise EngineDeadError(f"the engine failed to load: {self._failure}")
            raise EngineNotReadyError("the model is still loading")
        return self._engine.generate(request_id, prompt_token_ids, params)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self._engine.stats() if self._engine is not None else _EMPTY_STATS

    async def load_lora(self, name: str, path: str) -> None:
        await self._ready_engine().load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        await self._ready_engine().unload_lora(name)

    def _ready_engine(self) -> EngineClient:
        if self._engine is None:
            raise EngineNotReadyError("the model is still loading")
        return self._engine
