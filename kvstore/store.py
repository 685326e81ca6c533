"""TieredKVStore: owns every KV page of every request across the device, host and disk tiers.

Pages are identified by logical page ids from the PageAllocator (shared by all layers of a
request); a page of one layer is the key `layer * max_pages + page_id` in every tier.
The lowest tier with a budget is the backing store: every full page is written there once
(overlapped with compute), so evicting from a faster tier never writes. Partial pages (the
last page of a request while it fills) live only on the device tier and are never evicted.

The scheduler allocates through this object (it has PageAllocator's interface), so freeing a
request's pages also drops them from every tier before the ids can be reused.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kernels.attention import make_attention_backend
from kernels.page_select import make_selector
from kernels.sparse_attention import make_sparse_decode
from kvstore.config import KVStoreConfig
from kvstore.page_allocator import PageAllocator
from kvstore.pipeline import Pipeline
from kvstore.placement import RecencyPlacement
from kvstore.residency import make_residency
from kvstore.step import SeqKV, StepKV
from kvstore.stats import KVStats
from kvstore.tiers.base import PageShape
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.errors import TierFull
from kvstore.tiers.host import HostTier

logger = logging.getLogger(__name__)


class KVFull(Exception):
    """The backing store cannot take this request now (HTTP 429)."""


class KVNeverFits(ValueError):
    """The request is larger than the backing store could ever hold (HTTP 400)."""


class RequestKVError(Exception):
    """KV pages of some requests were lost (corrupt page, I/O error): fail just those."""

    def __init__(self, request_ids: list[str], message: str):
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class RequestKV:
    """Per-request KV state that outlives preemption (released when the request ends)."""
    request_id: str
    handle: int
    capacity_pages: int                      # pages per layer reserved for prompt + max_tokens
    summaries: torch.Tensor                  # [L, capacity_pages, kvh, 3, hd] min | max | mean
    # [L, capacity_pages, kvh] float32: attention mass from the prompt's observation window,
    # set at the end of prefill (-inf: none, e.g. pages generated later)
    prior: torch.Tensor | None = None
    # in-flight backing writes: (future, keys, pages); pages stay alive until applied
    written: list[tuple[Future, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    write_errors: list[str] = field(default_factory=list)
    prefilled: bool = False                  # placement applied after the prompt was computed


class TieredKVStore:
    def __init__(self, cfg: KVStoreConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.num_layers = num_layers
        self.page_shape = PageShape(cfg.page_size, num_kv_heads, head_dim, dtype)
        self.device = torch.device(device)
        nbytes = self.page_shape.nbytes
        backing_bytes = {"device": cfg.device_bytes, "host": cfg.host_bytes,
                         "disk": cfg.disk_bytes}[cfg.backing]
        self.max_pages = backing_bytes // (nbytes * num_layers)
        if self.max_pages < 1:
            raise ValueError(f"the {cfg.backing} tier ({backing_bytes / 2**30:.3f} GB) holds no "
                             f"page of {cfg.page_size} tokens over {num_layers} layers "
                             f"({nbytes * num_layers} bytes); raise --kv-{cfg.backing}-gb")
        max_keys = self.max_pages * num_layers
        self.allocator = PageAllocator(self.max_pages, cfg.page_size)
        self.device_tier = DeviceTier(self.page_shape, cfg.device_bytes, max_keys, self.device)
        self.host_tier = (HostTier(self.page_shape, cfg.host_bytes, max_keys)
                          if cfg.host_bytes else None)
        self.disk_tier = (DiskTier(self.page_shape, cfg.disk_bytes, cfg.disk_path, max_keys,
                                   num_layers, self.max_pages, threads=cfg.disk_threads)
                          if cfg.disk_bytes else None)
        self.tiers = [t for t in (self.device_tier, self.host_tier, self.disk_tier) if t is not None]
        self.backing = self.tiers[-1]
        self.residency = make_residency(cfg.residency, self.device_tier.capacity_pages,
                                        num_layers)
        self.host_residency = make_residency(
            cfg.residency, self.host_tier.capacity_pages if self.host_tier else 0, num_layers)
        # host slots a pending fill reads from (never evicted until the fill is done)
        self.host_pinned = torch.zeros(self.host_tier.capacity_pages if self.host_tier else 0,
                                       dtype=torch.bool)
        # device slots a pending fill writes into (never evicted until it has)
        self.device_pinned = torch.zeros(self.device_tier.capacity_pages, dtype=torch.bool)
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        # evicted device pages whose copy to their new host slot is still to be made:
        # (device slots, host slots), recorded by resolve, made by the fill after it
        # (Fetcher.demote)
        self.demotions: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self.demote_lock = threading.Lock()
        self.native_eviction = None     # kvstore.native_evict.NativeEviction, made on first use
        self.selector = make_selector(cfg.selector)
        self.dense_attention = make_attention_backend(self.device)
        self.sparse_attention = make_sparse_decode(self.device)
        self.stats = KVStats()
        self.pipeline = Pipeline(self, cfg.pipeline, cfg.micro_batch)
        self.placement = RecencyPlacement()
        # True where the key's page is safely in the backing tier (evictable from faster tiers)
        self.clean = torch.zeros(max_keys, dtype=torch.bool)
        # the last completed step whose sparse decode selected the key's page
        # (kvstore.stages.reused)
        self.selected_at = torch.full((max_keys,), -1, dtype=torch.int64)
        self.completed_step = 0
        self.requests: dict[str, RequestKV] = {}
        self._next_handle = 0
        self.step_counter = 0
        self.clock_now = 0          # layer clock (`clock_of`) of the layer being computed
        logger.info("KV store: device %.0f MiB (%d pages), host %.0f MiB, disk %.0f MiB; "
                    "backing tier %s holds %d pages x %d layers", cfg.device_bytes / 2**20,
                    self.device_tier.capacity_pages, cfg.host_bytes / 2**20,
                    cfg.disk_bytes / 2**20, cfg.backing, self.max_pages, num_layers)

    # ---------------------------------------------------------------- request lifecycle
    def capacity_tokens(self) -> int:
        return self.max_pages * self.cfg.page_size

    def add_request(self, request_id: str, max_total_tokens: int) -> None:
        """Reserve backing room for prompt + max_tokens. Raises KVNeverFits or KVFull."""
        cap = self.cfg.pages(max_total_tokens)
        if cap > self.max_pages:
            raise KVNeverFits(f"request needs KV for {max_total_tokens} tokens but the "
                              f"{self.cfg.backing} tier holds {self.capacity_tokens()}; raise "
                              f"--kv-{self.cfg.backing}-gb or lower max_tokens")
        handle = self._next_handle
        self._next_handle += 1
        if self.disk_tier is not None:
            try:
                self.disk_tier.register_request(handle, cap)
            except TierFull as exc:
                raise KVFull(f"disk tier is full for now ({exc}); retry later") from exc
        shape = self.page_shape
        # NOTE: in the KV dtype; min rounded down and max up, so Quest's bound stays an upper
        # bound. Only sparse decode reads them.
        rows = cap if self.cfg.sparse_budget > 0 else 0
        summaries = torch.empty(self.num_layers, rows, shape.num_kv_heads, 3, shape.head_dim,
                                dtype=shape.dtype)
        prior = None
        if self.cfg.sparse_budget > 0 and self.cfg.obs_window > 0:
            prior = torch.full((self.num_layers, cap, shape.num_kv_heads), -float("inf"))
        self.requests[request_id] = RequestKV(request_id, handle, cap, summaries, prior=prior)

    def release(self, request_id: str) -> None:
        """The request ended: free its pages in every tier and its disk file."""
        self.free(request_id)
        rkv = self.requests.pop(request_id, None)
        if rkv is not None and self.disk_tier is not None:
            self.disk_tier.release_request(rkv.handle)

    # ---------------------------------------------------------------- allocator interface
    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_used_pages

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        return self.allocator.pages_needed(request_id, num_tokens)

    def pages_for_tokens(self, n: int) -> int:
        return self.allocator.pages_for_tokens(n)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.allocator.can_allocate(request_id, num_tokens)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        before = len(self.allocator.pages(request_id))
        if not self.allocator.allocate(request_id, num_tokens):
            return False
        pages = self.allocator.pages(request_id)
        rkv = self.requests.get(request_id)
        if self.disk_tier is not None and rkv is not None and len(pages) > before:
            self.disk_tier.bind(list(pages[before:]), rkv.handle, before)
        return True

    def pages(self, request_id: str) -> tuple[int, ...]:
        return self.allocator.pages(request_id)

    def free(self, request_id: str) -> int:
        """Drop the request's pages from every tier (preemption or end), then free the ids."""
        self.pipeline.drain(raise_errors=False)     # no stage thread may be using the tiers
        page_ids = self.allocator.pages(request_id)
        rkv = self.requests.get(request_id)
        if rkv is not None:
            self.wait_writes(rkv)
            rkv.prefilled = False
        if page_ids:
            keys = self.keys_of(torch.tensor(page_ids, dtype=torch.int64))
            for tier in self.tiers:
                tier.delete(keys)
            self.clean[keys] = False
        return self.allocator.free(request_id)

    # ---------------------------------------------------------------- helpers
    def clock_of(self, keys: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """Layer clock of a use of `keys` in `step` (default: this one): step * layers + the
        key's layer, the order in which a step reads them (the tiers' recency stamps)."""
        step = self.step_counter if step is None else step
        return step * self.num_layers + keys // self.max_pages

    def keys_of(self, page_ids: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        """page_ids [n] -> keys [L * n] (layer-major) for every layer (or `layers`)."""
        layers = range(self.num_layers) if layers is None else layers
        ls = torch.tensor(list(layers), dtype=torch.int64)
        return (ls[:, None] * self.max_pages + page_ids[None, :]).reshape(-1)

    def wait_writes(self, rkv: RequestKV) -> None:
        """Block until the request's backing writes finish (errors kept for check_writes)."""
        self._settle(rkv, block=True)

    def _settle(self, rkv: RequestKV, block: bool) -> None:
        # NOTE: completions are applied here, on the engine thread, never in I/O callbacks:
        # a callback could mark a page clean after free() released its id
        pending = []
        for entry in rkv.written:
            fut, keys = entry[0], entry[1]
            if not block and not fut.done():
                pending.append(entry)
                continue
            exc = fut.exception()
            if exc is None:
                self.clean[keys] = True
                self.stats.add_transfer("device", "disk", keys.numel() * self.page_shape.nbytes)
            else:
                rkv.write_errors.append(f"KV write to disk failed: {exc}")
        rkv.written = pending

    def check_writes(self) -> list[tuple[str, str]]:
        """Apply finished backing writes; returns (request_id, error) for failed ones."""
        failed = []
        for rid, rkv in self.requests.items():
            self._settle(rkv, block=False)
            if rkv.write_errors:
                failed.append((rid, rkv.write_errors[0]))
                rkv.write_errors.clear()
        return failed

    def staging(self, n: int, purpose: str = "fill") -> torch.Tensor:
        """A reused host buffer [n, 2, kvh, ps, hd] (grown on demand, never shrunk): fresh
        memory costs a page fault per 4 KB, so page copies between tiers go through these.
        One buffer per purpose ("fill": host -> device, "demote": device -> host, both
        with a CUDA device pool; host pools copy pages directly, see copy_pages) and per
        thread (an inline fill on the engine thread may run beside one on the fetch thread)."""
        key = (purpose, threading.get_ident())
        buf = self._staging.get(key)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, 256), *self.page_shape.shape, dtype=self.page_shape.dtype)
            self._staging[key] = buf
        return buf[:n]

    def request_error(self, keys: torch.Tensor, message: str) -> RequestKVError:
        """Map the keys of lost pages to the requests that own them."""
        lost = set((torch.as_tensor(keys) % self.max_pages).tolist())
        rids = [rid for rid in self.requests if lost & set(self.allocator.pages(rid))]
        return RequestKVError(rids, message)

    def begin_step(self, seqs: list[SeqKV]) -> StepKV:
        self.pipeline.drain(raise_errors=False)     # a step that failed may have left jobs
        return StepKV(self, seqs)

    def end_step(self, step: StepKV, prefilled: list[str]) -> list[tuple[str, str]]:
        """After the forward: placement for requests whose prompt is now computed, forced
        demotion (--kv-force-tier), and failed backing writes as (request_id, error)."""
        # NOTE: the last layer's bookkeeping (recency, write-back of pages that filled) may
        # still run on a stage thread; placement and demotion below mutate the same tiers
        self.pipeline.drain()
        self.pipeline.end_step()
        if step.selected:
            self.selected_at[torch.cat(step.selected)] = step.now
        self.completed_step = step.now
        for rid in prefilled:
            rkv = self.requests.get(rid)
            if rkv is not None and not rkv.prefilled:
                rkv.prefilled = True
                self.placement.place(self, rid)
        if self.cfg.force_tier != "none":
            self._force_down(step)
        return self.check_writes()

    def _force_down(self, step: StepKV) -> None:
        for rkv in self.requests.values():
            self.wait_writes(rkv)
        dev = self.device_tier
        key_of = dev.slot_keys
        evictable = (key_of >= 0) & self.clean[key_of.clamp(min=0)]
        step.fetcher.evict_device(evictable.nonzero().squeeze(1))
        if self.cfg.force_tier == "disk" and self.host_tier is not None:
            step.fetcher.evict_host(self.host_tier.keys())

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """tier -> (used bytes, capacity bytes)."""
        return {t.name: (t.used_bytes, t.capacity_bytes) for t in self.tiers}
