"""AsyncEngine: the EngineClient the server talks to.

The LLMEngine runs in its own thread; only that thread touches the scheduler and the model.
The asyncio side hands it new requests and aborts through inboxes and receives RequestOutputs
through one asyncio.Queue per request.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from pathlib import Path
from typing import AsyncIterator

from engine.admission import Admission, refusal
from engine.args import EngineArgs, default_served_name
from engine.outputs import RequestOutput
from engine.protocol import EngineDeadError, EngineError, EngineNotReadyError, EngineStats
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

class AsyncEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_name = args.served_model_name or default_served_name(args.model)
        self.max_model_len = args.max_model_len or 0   # set from the model once loaded
        self.sampling_defaults: dict = {}               # likewise
        self.max_waiting = args.max_waiting     # narrowed to the total's cap once loaded
        self.tokenizer_path: Path | None = None
        self.engine = None
        self._ready = threading.Event()
        self._dead: str | None = None
        self._lock = threading.Lock()            # guards the inboxes and the queue registry
        self._wake = threading.Condition(self._lock)
        self._new: collections.deque = collections.deque()
        self._aborts: collections.deque = collections.deque()
        # calls to make on the engine thread, between steps: (fn(LLMEngine), loop, future)
        self._calls: collections.deque = collections.deque()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---------------------------------------------------------------- lifecycle
    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._dead is None

    def start(self) -> None:
        """Load the model (blocking) and start the step loop thread."""
        import torch

        from engine.llm_engine import LLMEngine
        prefill, decode = self.args.torch_threads()
        torch.set_num_threads(prefill)          # the model loads (and converts) on every core
        try:
            self.engine = LLMEngine(self.args)
            self.engine.use_threads(prefill, decode)
        except Exception as exc:
            self._dead = f"model failed to load: {exc}"
            logger.exception("model failed to load")
            raise
        self.max_model_len = self.engine.max_model_len
        self.sampling_defaults = self.engine.sampling_defaults
        store = self.engine.store
        # what one request's choices may queue at most: per client, within the total
        self.max_waiting = min(self.args.max_waiting, self.engine.scheduler.config.waiting_total)
        self.admission = Admission(self.max_model_len, store.capacity_tokens(), store.cfg.backing,
                                   self.args.max_waiting,
                                   self.engine.scheduler.config.waiting_total,
                                   self.engine.scheduler.config.policy)
        self.tokenizer_path = self.engine.model_folder
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)
        self._thread.start()
        self._ready.set()
        logger.info("engine ready: %s, max_model_len %d, torch threads %d (prefill) / %d (decode)",
                    self.model_name, self.max_model_len, prefill, decode)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- EngineClient
    def stats(self) -> EngineStats:
        e = self.engine
        if e is None:
            return EngineStats(0, 0, 0, 0, 0)
        return EngineStats(
            num_running=e.scheduler.num_running,
            num_waiting=e.scheduler.num_waiting + len(self._new),
            kv_pages_used=e.store.num_used_pages,
            kv_pages_total=e.store.num_pages,
            kv_page_bytes=e.store.page_shape.nbytes * e.store.num_layers,
            kv_tiers=e.store.tier_usage(),
            kv=e.store.stats.snapshot(),
            pipeline_micro_batch=e.store.pipeline.micro_batch
            if e.store.pipeline.mode == "sfc" else -1,
            prefix_queried_tokens=e.scheduler.prefix_queried_tokens,
            prefix_hit_tokens=e.scheduler.prefix_hit_tokens,
            prefix_pages=dict(e.store.prefix_pages()),
            kv_disk_io=e.store.disk_io(),
            lora_requests=self._lora_requests(),
            spec_decode=(e.spec.drafts, e.spec.draft_tokens, e.spec.accepted_tokens),
        )

    def _lora_requests(self) -> dict[str, tuple[int, int]]:
        """Each loaded adapter's (running, waiting) requests (read from the serving thread:
        a snapshot of the engine's tables, one list copy each)."""
        e = self.engine
        counts = {name: [0, 0] for name in list(e.runner.loras)}
        for req in list(e.scheduler.requests.values()):
            name = req.sampling_params.lora
            if name in counts:
                counts[name][0 if req.status.value == "running" else 1] += 1
        return {name: (r, w) for name, (r, w) in counts.items()}

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        e = self.engine
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            client = params.client
            self.admission.check(len(prompt_token_ids), params.max_new_tokens,
                                 e.scheduler.num_waiting_of(client)
                                 + sum(p.client == client for _, _, p in self._new),
                                 e.scheduler.num_waiting + len(self._new), params.priority)
            self._queues[request_id] = (loop, queue)
            self._new.append((request_id, list(prompt_token_ids), params))
            self._wake.notify()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
                if not finished:
                    self._aborts.append(request_id)
                    self._wake.notify()

    async def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._wake.notify()

    async def load_lora(self, name: str, path: str) -> None:
        # read (files, the shapes) on a worker thread; installed between two steps
        self._check_alive()
        adapter = await asyncio.to_thread(self.engine.read_lora, name, path)
        await self._on_engine_thread(lambda e: e.add_lora(adapter))

    async def unload_lora(self, name: str) -> None:
        await self._on_engine_thread(lambda e: e.unload_lora(name))

    async def _on_engine_thread(self, fn):
        """fn(LLMEngine) run by the engine thread between two steps; its result or error."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(self._dead or "the engine is stopping")
            self._calls.append((fn, loop, future))
            self._wake.notify()
        return await future

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if not self._ready.is_set():
            raise EngineNotReadyError("the model is still loading")

    # ---------------------------------------------------------------- step loop (engine thread)
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._queues.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _drain_inboxes(self) -> None:
        e = self.engine
        with self._lock:
            new = list(self._new)
            self._new.clear()
            aborts = list(self._aborts)
            self._aborts.clear()
            calls = list(self._calls)
            self._calls.clear()
        for rid, prompt, params in new:
            try:
                e.add_request(rid, prompt, params)
            except Exception as exc:  # noqa: BLE001 - this request only (engine/admission.py)
                error = refusal(exc)
                if type(error) is EngineError:      # not a limit: a duplicate id, a bad value
                    logger.error("request %s refused: %s", rid, exc)
                self._deliver(rid, error)
        for rid in aborts:
            out = e.abort(rid)
            if out is not None:
                self._deliver(rid, out)
        # after the new requests: an unload sees those naming its adapter
        for fn, loop, future in calls:
            try:
                result, error = fn(e), None
            except Exception as exc:  # noqa: BLE001 - the caller's error, not the engine's
                result, error = None, exc
            loop.call_soon_threadsafe(_settle, future, result, error)

    def _fail_calls(self, message: str) -> None:
        """The loop ended: calls still queued get EngineDeadError."""
        with self._lock:
            calls = list(self._calls)
            self._calls.clear()
        for _, loop, future in calls:
            loop.call_soon_threadsafe(_settle, future, None, EngineDeadError(message))

    def _run(self) -> None:
        e = self.engine
        try:
            while True:
                with self._lock:
                    idle = not (self._stopping or self._new or self._aborts or self._calls
                                or e.has_unfinished())
                if idle:        # index and recount what /metrics reads, before sleeping
                    e.store.refresh_stats()
                with self._lock:
                    while not (self._stopping or self._new or self._aborts or self._calls
                               or e.has_unfinished()):
                        self._wake.wait()
                    if self._stopping:
                        break
                self._drain_inboxes()
                for out in e.step():
                    self._deliver(out.request_id, out)
        except Exception as exc:  # the loop itself broke: nothing more can be served
            logger.exception("engine loop died")
            self._dead = f"engine loop died: {exc}"
            with self._lock:
                targets = list(self._queues.items())
            for rid, (loop, queue) in targets:
                loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(self._dead))
        self._fail_calls(self._dead or "the engine stopped")


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
