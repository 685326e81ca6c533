"""TieredKVStore: the KV store's facade; it wires its parts and owns none of their state.

The parts, each with one concern (docs/kvstore.md):
- PageAllocator (page_allocator.py): logical page ids, reference counts, who holds what;
- RequestTable (requests.py): per request, its file handle, summaries and prior;
- TierSet (tierset.py): the tiers, slot maps, pins, residency, demotion, clean mask and
  backing writes; its movers are the Fetcher (fetcher.py) and the C eviction pass;
- PageSelection (selection.py): which pages sparse decode attends to;
- PrefixReuse (prefix.py, over prefix_cache.py): full pages found again by their tokens,
  kept across requests and, with a disk tier, across restarts;
- Pipeline (pipeline.py): how a layer's select / fetch / compute stages are scheduled;
- StepKV (step.py): one step's view that the model attends through, holding the kernels.

The scheduler allocates through this object (PageAllocator's interface): `allocate`,
`free` and `can_allocate` return at once. Pages nobody holds leave the tiers right away
(memory bookkeeping); their backing writes still in flight are retired, never waited for
here: the KV side waits for them at the start of the next step.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from kernels.backends import make_attention_backend, make_sparse_decode
from kvstore.config import KVStoreConfig
from kvstore.disk_room import register_on_disk
from kvstore.errors import KVFull, KVNeverFits, RequestKVError
from kvstore.pipeline import Pipeline
from kvstore.fetcher import Fetcher
from kvstore.placement import make_placement
from kvstore.prefix import PrefixReuse
from kvstore.prefix_cache import PrefixCache, store_namespace
from kvstore.recompute import KVFromInputs
from kvstore.requests import RequestKV, RequestTable
from kvstore.selection import PageSelection
from kvstore.step import SeqKV, StepKV, StepParts
from kvstore.stats import KVStats
from kvstore.tiers.base import PageShape
from kvstore.centroids import CentroidIndex
from kvstore.lowrank import LowRankProjection
from kvstore.backing import backing_geometry
from kvstore.tiers.codec import PageCodec
from kvstore.tierset import TierSet
from kvstore.window_trim import make_allocator

__all__ = ["KVFull", "KVNeverFits", "RequestKVError", "TieredKVStore"]

logger = logging.getLogger(__name__)

_RECONFIGURABLE = {"sparse_budget", "sparse_threshold", "sink_tokens", "local_tokens",
                   "dense_layers", "selector", "centroid_pages", "budget_plan",
                   "obs_reduce", "prior_share", "head_pages", "force_tier"}


class TieredKVStore:
    def __init__(self, cfg: KVStoreConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", model_id: str = "",
                 projection: LowRankProjection | None = None, hidden_size: int = 0,
                 kv_from_inputs: KVFromInputs | None = None,
                 windows: tuple[int | None, ...] = (), softcap: float | None = None):
        """model_id: what else shapes the KV bytes (the weights, the activation dtype): part
        of the prefix cache's namespace, so another model's pages never hit; projection: the
        keys' low-rank basis (--selector lowrank); hidden_size, kv_from_inputs: the model's
        width and K/V projection, for KV recompute (--kv-recompute); windows: each layer's
        sliding window (None, or () for every layer: attends to the whole context); softcap:
        the attention scores' (Gemma 2's attn_logit_softcapping)."""
        self.cfg = cfg
        self.num_layers = num_layers
        self.page_shape = PageShape(cfg.page_size, num_kv_heads, head_dim, dtype)
        device = torch.device(device)
        codec = PageCodec.from_name(cfg.tier_codec, self.page_shape, cfg.tier_codec_group)
        budgets = cfg.budgets(device.type)
        if codec is not None and not (budgets["disk"] or budgets["host"]):
            raise ValueError("--kv-tier-codec: no tier to encode (on a CPU the host tier "
                             "joins the device pool unless --kv-host-pool separate)")
        coded, plan, max_pages = backing_geometry(cfg, self.page_shape, num_layers, budgets,
                                                  codec, device, hidden_size, kv_from_inputs)
        cfg.check_plan(num_layers, num_kv_heads)
        if softcap is not None and cfg.sparse_budget > 0:
            logger.warning("--sparse-budget: this model soft-caps its attention scores, which "
                           "only the window attention does; its decodes attend densely")
        self.stats = KVStats()
        whole_pages = max_pages
        self._allocator, self._trim = make_allocator(cfg, budgets, windows, whole_pages)
        max_pages = self._allocator.num_pages   # (more than whole where windows trim)
        self._selection = PageSelection(cfg, max_pages * num_layers, self.stats, head_dim,
                                        projection)
        namespace = store_namespace(model_id, self.page_shape, num_layers, codec, coded,
                                    projection if self._selection.projected else None)
        self._tiers = TierSet(cfg, self.page_shape, num_layers, max_pages, device, self.stats,
                              owners=self._allocator.holders, namespace=namespace, codec=codec,
                              summary_dim=self._selection.summary_dim,
                              recompute=plan, coded=coded)
        disk = self._tiers.disk_tier
        self._requests = RequestTable(disk.next_handle if disk is not None else 0)
        if cfg.force_tier == "host" and self._tiers.host_tier is None and cfg.disk_bytes == 0:
            raise ValueError("--kv-force-tier host needs a host tier: on a CPU it joins the "
                             "device pool unless --kv-host-pool separate")
        self._fetcher = Fetcher(self._tiers)
        self.pipeline = Pipeline(self._tiers, self._fetcher, self.stats, cfg.pipeline,
                                 cfg.micro_batch)
        self.sparse_attention = make_sparse_decode(device)
        self._parts = StepParts(cfg, self._tiers, self._fetcher, self._requests,
                                self._selection, self.pipeline, self.stats,
                                make_attention_backend(device), self.sparse_attention,
                                tuple(windows), softcap)
        self._placement = make_placement(cfg.placement)
        self._prefix = None
        if cfg.prefix_cache:
            self._prefix = PrefixReuse(cfg, PrefixCache(namespace, cfg.page_size),
                                       self._allocator, self._tiers, self._requests,
                                       self._trim)
            self._prefix.restore()
        logger.info("KV store: %s; backing tier %s holds %d pages x %d layers%s",
                    ", ".join(f"{name} {cap / 2**20:.0f} MiB"
                              for name, (_, cap) in self._tiers.usage().items()),
                    cfg.backing, whole_pages, num_layers,
                    f" (sliding-window layers keep their window: up to {max_pages} page ids)"
                    if self._trim is not None else "")

    @property
    def tiers(self) -> TierSet:
        return self._tiers

    def request(self, request_id: str) -> RequestKV | None:
        """The request's KV state (summaries, prior, disk handle), or None."""
        return self._requests.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def selection(self) -> PageSelection:
        return self._selection

    @property
    def attention_threads(self) -> int:
        """Threads of the C decode attention and of the C page selection, which share one
        pool (0: torch's intra-op count at each call)."""
        return self._selection.threads

    @attention_threads.setter
    def attention_threads(self, n: int) -> None:
        if hasattr(self.sparse_attention, "threads"):
            self.sparse_attention.threads = n
        self._selection.threads = n

    @property
    def max_pages(self) -> int:
        return self._allocator.num_pages

    # ---------------------------------------------------------------- request lifecycle
    def capacity_tokens(self) -> int:
        """The longest request the backing tier holds (prompt and output)."""
        if self._trim is None:
            return self.max_pages * self.cfg.page_size
        return self._trim.capacity * self.cfg.page_size

    def add_request(self, request_id: str, max_total_tokens: int) -> None:
        """Reserve backing room for prompt + max_tokens. Raises KVNeverFits or KVFull."""
        cap = self.cfg.pages(max_total_tokens)
        if max_total_tokens > self.capacity_tokens():
            raise KVNeverFits(f"request needs KV for {max_total_tokens} tokens but the "
                              f"{self.cfg.backing} tier holds {self.capacity_tokens()}; raise "
                              f"--kv-{self.cfg.backing}-gb or lower max_tokens")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the KV store")
        handle = self._requests.new_handle()
        register_on_disk(self._tiers, self._prefix, handle, cap)
        cfg = self.cfg
        self._requests.add(RequestKV.new(request_id, handle, cap, self.num_layers,
                                         self.page_shape, self._selection.summary_dim,
                                         cfg.sparse_budget > 0, cfg.obs_window > 0))

    def release(self, request_id: str) -> None:
        """The request ended: its pages leave every tier, its disk file goes once its writes
        in flight are done."""
        rkv = self._requests.pop(request_id)
        disk = self._tiers.disk_tier
        close = None
        if rkv is not None and disk is not None:
            close = (lambda h=rkv.handle: disk.release_request(h))
        self._free(request_id, close)
        self._tiers.reap()          # closes it now when its writes are done (an idle engine
        #                             runs no step that would)

    # ---------------------------------------------------------------- allocator interface
    @property
    def page_size(self) -> int:
        return self.cfg.page_size

    @property
    def num_pages(self) -> int:
        """Pages of every layer the backing tier holds."""
        return self._allocator.num_pages if self._trim is None else self._trim.whole_pages

    @property
    def num_free_pages(self) -> int:
        """Free pages, and cached ones no request holds (they make room on demand)."""
        free = self._allocator.num_free_pages + self._allocator.num_cache_only
        return free if self._trim is None else self._trim.free_pages(free)

    @property
    def num_used_pages(self) -> int:
        """Pages requests hold (cached pages only the prefix cache holds are not counted)."""
        if self._trim is not None:
            return self._trim.used_pages()
        return self._allocator.num_used_pages - self._allocator.num_cache_only

    @property
    def num_cached_pages(self) -> int:
        """Pages in the prefix cache (whoever else holds them)."""
        return self._prefix.num_pages if self._prefix is not None else 0

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        return self._allocator.pages_needed(request_id, num_tokens)

    def pages_for_tokens(self, n: int) -> int:
        return self._allocator.pages_for_tokens(n)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self._allocator.pages_needed(request_id, num_tokens) <= self.num_free_pages

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's pages (all or nothing); cached pages nobody uses make room."""
        if self._trim is not None and self._trim.due(request_id):
            self._tiers.drop_layers(self._trim.advance(request_id,
                                                       self._allocator.pages(request_id)))
        before = len(self._allocator.pages(request_id))
        need = self._allocator.pages_needed(request_id, num_tokens)
        short = need - self._allocator.num_free_pages
        if short > 0 and self._prefix is not None:
            self._prefix.reclaim(short)
        if self._trim is not None and not self._trim.make_room(
                need, self._tiers.drop_layers,
                self._prefix.reclaim if self._prefix is not None else None):
            return False
        if not self._allocator.allocate(request_id, num_tokens):
            return False
        pages = self._allocator.pages(request_id)
        if self._trim is not None and len(pages) > before:
            self._trim.added(pages[before:], before)
        rkv = self._requests.get(request_id)
        disk = self._tiers.disk_tier
        if disk is not None and rkv is not None and len(pages) > before:
            # pages an earlier run of this request left cached in its file make way
            stale = disk.occupants(rkv.handle, before, len(pages) - before)
            if stale and self._prefix is not None:
                self._prefix.forget(stale)
            disk.bind(list(pages[before:]), rkv.handle, before)
        return True

    def reuse_prefix(self, request_id: str, token_ids, salt: str | None = None) -> int | None:
        """The request starts with the cached pages of the longest cached prefix of its
        tokens (among those cached under the same `salt`); returns how many tokens they hold
        (0 with --prefix-cache off), or None when a running request is computing the pages
        that follow (admit it once they are cached)."""
        if self._prefix is None or request_id not in self._requests:
            return 0
        return self._prefix.reuse(request_id, token_ids, salt)

    def publish(self, request_id: str, token_ids, salt: str | None = None) -> None:
        """The request computed the KV of `token_ids` (its prompt, once prefilled; every
        token, when it ends): their full pages join the prefix cache, under `salt`."""
        if self._prefix is not None and request_id in self._requests:
            self._prefix.publish(request_id, token_ids, salt)

    def clear_prefix_cache(self) -> int:
        """Drop every cached page no request holds; returns how many went."""
        return self._prefix.clear() if self._prefix is not None else 0

    def refresh_stats(self) -> None:
        """An idle engine runs no step: index the cached pages now on disk (an answer's,
        cached when its request ended) and recount the gauges counted on the engine thread."""
        if self._prefix is not None:
            self._prefix.persist()
            self._prefix.count_tiers(max_age_s=0.0)
        if self._trim is not None:
            self._trim.count(self._allocator.cache_only, max_age_s=0.0)

    def prefix_pages(self) -> dict[str, int]:
        """Cached pages per tier (recounted at most once a second, at the end of a step)."""
        return self._prefix.pages_per_tier if self._prefix is not None else {}

    def share(self, request_id: str, page_ids) -> None:
        """The request starts with full pages other requests hold (a common prefix). Only
        pages safe in the backing tier can be shared: no write of theirs is in flight. The
        caller fills the new holder's summaries and prior for the shared pages."""
        page_ids = [int(p) for p in page_ids]
        keys = self._tiers.keys_of(torch.tensor(page_ids, dtype=torch.int64))
        backs = self._tiers.backing is not self._tiers.device_tier
        if backs and not bool(self._tiers.is_clean(keys).all()):
            raise ValueError("only pages already in the backing tier can be shared")
        self._allocator.share(request_id, page_ids)

    def pages(self, request_id: str) -> tuple[int, ...]:
        return self._allocator.pages(request_id)

    def refs(self, page_id: int) -> int:
        """Holders of the page: requests, and the prefix cache."""
        return self._allocator.refs(page_id)

    def free(self, request_id: str) -> int:
        """Drop the request's pages (preemption or end); returns how many became free."""
        return self._free(request_id, None)

    def _free(self, request_id: str, then) -> int:
        rkv = self._requests.get(request_id)
        if rkv is not None:
            rkv.prefilled = False
            rkv.centroids = CentroidIndex(rkv.capacity_pages)   # rebuilt from the new pages
        if self._prefix is not None:
            self._prefix.before_free(request_id)
        gone = self._allocator.release(request_id)
        # NOTE: no stage thread runs between steps (end_step and abort_step drain them)
        self._tiers.drop(gone)
        if self._trim is not None:
            self._trim.gone(gone)
            self._trim.ended(request_id)
        self._tiers.retire_writes(request_id, then)
        return len(gone)

    # ---------------------------------------------------------------- steps
    def begin_step(self, seqs: list[SeqKV]) -> StepKV:
        # NOTE: writes of freed pages finish before this step writes any page (a reused id's
        # new contents must not race its old ones on disk); they were issued a step ago or more
        self._tiers.reap(block=True)
        self.pipeline.drain(raise_errors=False)     # a step that failed may have left jobs
        self._drop_lost()
        return StepKV(self._parts, seqs)

    def end_step(self, step: StepKV, prefilled: list[str]) -> list[tuple[str, str]]:
        """After the forward: placement for requests whose prompt is now computed, forced
        demotion (--kv-force-tier), and failed backing writes as (request_id, error)."""
        # NOTE: the last layer's bookkeeping (recency, write-back of pages that filled) may
        # still run on a stage thread; placement and demotion below mutate the same tiers
        self.pipeline.drain()
        step.end()
        self.pipeline.end_step()
        if self._trim is not None:      # NOTE: their pages left behind go at `allocate`
            self._trim.after_step([s for s in step.seqs if s.request_id in self._requests],
                                  self._allocator.cache_only)
        self._selection.end_step(step.now, step.selected)
        for rid in prefilled:
            rkv = self._requests.get(rid)
            if rkv is not None and not rkv.prefilled:
                rkv.prefilled = True
                self._placement.place(self._tiers, self._allocator.pages(rid), self.cfg,
                                      rkv.prior)
        if self.cfg.force_tier != "none":
            self._force_down()
        failed = self._tiers.check_writes()
        if self._prefix is not None:
            self._prefix.persist()
            self._prefix.count_tiers()
        return failed

    def abort_step(self) -> None:
        """The step's forward failed: wait for its stage threads (their errors are logged);
        pages it found lost leave the prefix cache (a later request recomputes them)."""
        self.pipeline.drain(raise_errors=False)
        self._drop_lost()

    def _drop_lost(self) -> None:
        lost = self._tiers.take_lost()
        if lost and self._prefix is not None:
            self._prefix.forget(lost)

    def _force_down(self) -> None:
        self._tiers.wait_writes()
        self._fetcher.evict_clean(to_disk=self.cfg.force_tier == "disk")

    def reconfigure(self, **changes) -> None:
        """Change per-step settings of a running store (benchmarks and tests compare variants
        of one loaded engine): selection settings and --kv-force-tier; no size."""
        bad = set(changes) - _RECONFIGURABLE
        if bad:
            raise ValueError(f"cannot change {sorted(bad)} on a running KV store")
        cfg = dataclasses.replace(self.cfg, **changes)
        cfg.check_plan(self.num_layers, self.page_shape.num_kv_heads)
        self.cfg = cfg
        self._selection.reconfigure(self.cfg)
        self._parts = dataclasses.replace(self._parts, cfg=self.cfg)

    def use_pipeline(self, mode: str, micro_batch: int = 0, **options) -> None:
        """Swap the pipeline (benchmarks and tests compare modes and their variants on one
        loaded engine): kvstore.pipeline.Pipeline's options."""
        self.pipeline.close()
        self.pipeline = Pipeline(self._tiers, self._fetcher, self.stats, mode, micro_batch,
                                 **options)
        self._parts = dataclasses.replace(self._parts, pipeline=self.pipeline)

    def tier_usage(self) -> dict[str, tuple[int, int]]:
        """tier -> (used bytes, capacity bytes)."""
        return self._tiers.usage()

    def disk_io(self) -> dict[str, dict[str, int]]:
        """Disk folder -> bytes read and written so far (and reads); {} without a disk tier."""
        disk = self._tiers.disk_tier
        return disk.per_path() if disk is not None else {}

    def close(self) -> None:
        self.pipeline.close()
        if self._prefix is not None and self._tiers.disk_tier is not None:
            self._tiers.wait_writes()       # cached pages written by now are kept
            self._prefix.persist()
        self._tiers.close()
