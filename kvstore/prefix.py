"""PrefixReuse: the prefix cache (prefix_cache.py) wired to the KV store's parts.

- `reuse`: a new request looks its tokens up page by page and shares every cached page of
  the longest match (wherever it is: device, host or disk); its prefill starts after them.
  When a running request is computing the next pages of that prefix (the same document sent
  by several clients at once), the new one waits for them instead of computing them again
  (None: the scheduler admits it once they are cached).
  At least `min_new` tokens are always computed: one (to sample from) or, with sparse
  decode, the observation window, whose attention over the whole prompt (reused pages too)
  gives the pages' prior exactly as without the cache. The pages' summaries come with them.
- `publish`: once a request's prompt is computed, its full pages join the cache (one more
  reference each, so they outlive the request), and when it ends those of its answer too
  (the next turn of a conversation resends it; their KV came from decode steps, which
  compute it with the same weights as a prefill would, up to rounding, as in vLLM); with a
  disk tier they are `persist`ed to its index once their bytes are on disk, and a restarted
  server `restore`s them.
- `reclaim`: pages only the cache holds go, least recently used first, when the allocator
  or the disk budget runs short. Pages a request holds are never evicted.
- Restored pages are read back and checked once before their first use (`_verify`): a page
  damaged while the server was down is dropped (and recomputed), never served.

Runs on the engine's thread only, as the rest of the store's bookkeeping.
"""
from __future__ import annotations

import logging
import time

import torch

from kvstore.config import KVStoreConfig
from kvstore.page_allocator import PageAllocator
from kvstore.prefix_cache import CachedPage, PrefixCache
from kvstore.requests import RequestTable
from kvstore.tiers.errors import TierError
from kvstore.tierset import TierSet
from kvstore.window_trim import WindowTrim

logger = logging.getLogger(__name__)

_VERIFY_BATCH = 32          # restored pages read back per batch (all layers)


class PrefixReuse:
    def __init__(self, cfg: KVStoreConfig, cache: PrefixCache, allocator: PageAllocator,
                 tiers: TierSet, requests: RequestTable, trim: WindowTrim | None = None):
        """trim: the sliding-window layers' dropped pages, when the store drops them."""
        self.cfg = cfg
        self.cache = cache
        self._allocator = allocator
        self._tiers = tiers
        self._requests = requests
        self._trim = trim
        self._sparse = cfg.sparse_budget > 0
        self.min_new = max(1, cfg.obs_window) if self._sparse and cfg.obs_window else 1
        self._backed = tiers.backing is not tiers.device_tier
        self._disk = tiers.disk_tier
        self._unrecorded: list[CachedPage] = []
        self._tier_pages: dict[str, int] = {}
        self._counted_at = 0.0
        # keys of the full prompt pages admitted requests are computing, and who computes them
        self._inflight: dict[bytes, str] = {}
        self._inflight_of: dict[str, list[bytes]] = {}

    # ---------------------------------------------------------------- a request starts
    def reuse(self, request_id: str, token_ids, salt: str | None = None) -> int | None:
        """Share the cached pages of the longest cached prefix of `token_ids` under `salt`
        (leaving at least `min_new` tokens to compute); returns the tokens they cover, or None
        when another request is computing the pages that follow them (wait for those)."""
        ps = self.cfg.page_size
        n_full = (len(token_ids) - self.min_new) // ps
        if n_full <= 0 or self._allocator.pages(request_id):
            return 0
        keys = self.cache.keys(token_ids, n_full, salt)
        found = self._usable(self.cache.match(keys)) if len(self.cache) else []
        n = len(found)
        if n < n_full and self._inflight.get(keys[n], request_id) != request_id:
            return None
        self._computing(request_id, keys[n:])
        if not found:
            return 0
        rkv = self._requests[request_id]
        self._allocator.share(request_id, [e.page_id for e in found])
        if self._trim is not None:      # its first query: the pages before its window may go
            self._trim.moved(request_id, len(found) * ps)
        if self._sparse:
            n = len(found)
            rkv.summaries[:, :n] = torch.stack([e.summaries for e in found], dim=1)
        if self._disk is not None:
            self._disk.skip(rkv.handle, len(found))
        self.cache.touch(found)
        return len(found) * ps

    def _computing(self, request_id: str, keys: list[bytes]) -> None:
        self._done_computing(request_id)
        self._inflight_of[request_id] = keys
        for k in keys:
            self._inflight.setdefault(k, request_id)

    def _done_computing(self, request_id: str) -> None:
        for k in self._inflight_of.pop(request_id, ()):
            if self._inflight.get(k) == request_id:
                del self._inflight[k]

    def _usable(self, found: list[CachedPage]) -> list[CachedPage]:
        """The leading entries that can be served now: with summaries (sparse decode needs
        them), safe in the backing tier, and checked if restored from disk."""
        if self._sparse:
            found = _cut(found, [e.summaries is not None for e in found])
        if self._trim is not None:      # the window before the first new query is whole
            found = found[:self._trim.usable([e.page_id for e in found])]
        if self._backed and found:
            clean = self._clean(found)
            if not all(clean):          # writes still in flight (a prompt just computed)
                self._tiers.wait_writes()
                clean = self._clean(found)
            found = _cut(found, clean)
        if any(not e.verified for e in found):
            found = self._verify(found)
        return found

    def _clean(self, entries: list[CachedPage]) -> list[bool]:
        ids = torch.tensor([e.page_id for e in entries], dtype=torch.int64)
        keys = self._tiers.keys_of(ids)
        return self._tiers.is_clean(keys).view(-1, len(entries)).all(0).tolist()

    def _verify(self, found: list[CachedPage]) -> list[CachedPage]:
        """Read restored pages back (all layers); the match ends at the first damaged one,
        which is dropped with the pages after it in its chain."""
        todo = [e for e in found if not e.verified]
        bad: set[int] = set()
        for i in range(0, len(todo), _VERIFY_BATCH):
            batch = todo[i:i + _VERIFY_BATCH]
            ids = torch.tensor([e.page_id for e in batch], dtype=torch.int64)
            keys = self._tiers.keys_of(ids)
            buf = self._tiers.staging(keys.numel(), "verify")
            try:
                self._disk.get(keys, buf)
            except TierError as exc:
                bad.update((exc.keys % self._tiers.max_pages).tolist())
                logger.warning("prefix cache: %d cached pages failed their check on disk "
                               "(%s); dropped, they will be recomputed",
                               len(bad), exc)
            for e in batch:
                e.verified = e.page_id not in bad
            if bad:
                break
        ok = _cut(found, [e.page_id not in bad for e in found])
        # the damaged pages, and the unchecked ones after them (unreachable without them)
        self.forget([e.page_id for e in found[len(ok):] if e.page_id in bad or not e.verified])
        return ok

    # ---------------------------------------------------------------- pages join
    def publish(self, request_id: str, token_ids, salt: str | None = None) -> None:
        """The request computed the KV of `token_ids` (its prompt after prefill; prompt and
        answer when it ends): their full pages join the cache."""
        self._done_computing(request_id)
        pages = self._allocator.pages(request_id)
        n = min(len(token_ids) // self.cfg.page_size, len(pages))
        if n <= 0:
            return
        rkv = self._requests[request_id]
        keys = self.cache.keys(token_ids, n, salt)
        chain = []
        for j, (key, pid) in enumerate(zip(keys, pages[:n])):
            entry = self.cache.find(key)
            if entry is not None and self._fresher(entry.page_id, pid):
                self.forget([entry.page_id])        # the windowed layers it lost are back
                entry = None
            if entry is None and not self._allocator.held(pid):
                summ = rkv.summaries[:, j].clone() if self._sparse else None
                entry = CachedPage(key, pid, j, summ)
                self.cache.insert(entry)
                self._allocator.hold([pid])
                if self._disk is not None:
                    self._unrecorded.append(entry)
            if entry is not None:
                chain.append(entry)
        self.cache.touch(chain)

    def _fresher(self, cached: int, page_id: int) -> bool:
        """The request's page holds the windowed layers the cached one of the same tokens
        lost (kvstore/window_trim.py)."""
        return (self._trim is not None and cached != page_id and self._trim.trimmed(cached)
                and not self._trim.trimmed(page_id) and not self._allocator.held(page_id))

    def persist(self) -> None:
        """Index the cached pages whose bytes are now on disk (so a restart finds them)."""
        if not self._unrecorded:
            return
        live = [e for e in self._unrecorded if self.cache.get(e.page_id) is e]
        clean = self._clean(live) if live else []
        ready = [e for e, c in zip(live, clean) if c]
        self._unrecorded = [e for e, c in zip(live, clean) if not c]
        if not ready:
            return
        done = self._disk.record([e.page_id for e in ready], [e.key for e in ready],
                                 [_summary_bytes(e.summaries) for e in ready])
        for e, ok in zip(ready, done):
            e.recorded = bool(ok)

    def before_free(self, request_id: str) -> None:
        """The request lets its pages go: cached ones among them must be safe in the backing
        tier first (its writes in flight are waited for); a page whose write failed leaves
        the cache (it would never be safe to evict)."""
        self._done_computing(request_id)
        if not self._backed:
            return
        mine = [e for p in self._allocator.pages(request_id) if (e := self.cache.get(p))]
        if not mine:
            return
        self._tiers.wait_writes(request_id)
        failed = [e.page_id for e, c in zip(mine, self._clean(mine)) if not c]
        self.forget(failed)

    # ---------------------------------------------------------------- pages leave
    @property
    def num_pages(self) -> int:
        return len(self.cache)

    def reclaim(self, n: int) -> int:
        """Evict up to n pages only the cache holds, least recently used first; returns how
        many became free."""
        victims = []
        for e in self.cache.oldest():
            if len(victims) >= n:
                break
            if self._allocator.refs(e.page_id) == 1:
                victims.append(e.page_id)
        return len(self.forget(victims))

    def forget(self, page_ids: list[int]) -> list[int]:
        """These pages leave the cache; returns those nobody holds any more (gone from the
        tiers)."""
        for p in page_ids:
            self.cache.remove(p)
        gone = self._allocator.unhold(page_ids)
        self._tiers.drop(gone)
        if self._trim is not None:
            self._trim.gone(gone)
        return gone

    def clear(self) -> int:
        """Every page only the cache holds goes (pages requests hold stay, uncached)."""
        ids = self._cached_ids()
        return len(self.forget(ids))

    def _cached_ids(self) -> list[int]:
        return [e.page_id for e in self.cache.entries()]

    # ---------------------------------------------------------------- restart
    def restore(self) -> int:
        """Take the pages a previous server indexed on this disk path; returns how many."""
        if self._disk is None:
            return 0
        taken = 0
        shape = self._tiers.page_shape
        per_page = (self._tiers.num_layers, shape.num_kv_heads, 3, self._tiers.summary_dim)
        for seg in self._disk.restore():
            n = min(len(seg.indices), self._allocator.num_free_pages)
            pids = self._allocator.take(n)
            if not pids:
                continue
            self._disk.adopt(seg.handle, pids, seg.indices[:n], seg.crcs[:n], seg.meta[:n])
            self._tiers.clean[self._tiers.keys_of(torch.tensor(pids))] = True
            chain, dup = [], []
            for pid, idx, key, raw in zip(pids, seg.indices, seg.keys, seg.summaries):
                summ = None if raw is None else torch.frombuffer(
                    bytearray(raw), dtype=shape.dtype).view(per_page)
                entry = CachedPage(key, pid, int(idx), summ, recorded=True, verified=False)
                (chain if self.cache.insert(entry) else dup).append(entry)
            self.forget([e.page_id for e in dup])
            self.cache.touch(chain)
            taken += len(chain)
        self._disk.finish_restore()
        if taken:
            logger.info("prefix cache: %d pages (%d tokens) restored from %s", taken,
                        taken * self.cfg.page_size, self._disk.layout.root)
        return taken

    # ---------------------------------------------------------------- metrics
    def count_tiers(self, max_age_s: float = 1.0) -> None:
        """Recount the cached pages in each tier (a page counts where all its layers are), at
        most every `max_age_s` seconds; engine thread (`pages_per_tier` reads the count)."""
        now = time.monotonic()
        if now - self._counted_at < max_age_s:
            return
        self._counted_at = now
        ids = torch.tensor(self._cached_ids(), dtype=torch.int64)
        counts = {}
        for tier in self._tiers:
            if self._trim is not None:      # the device tier alone, windowed layers in part
                counts[tier.name] = int(ids.numel())
                continue
            if not ids.numel():
                counts[tier.name] = 0
                continue
            has = tier.contains(self._tiers.keys_of(ids))
            counts[tier.name] = int(has.view(-1, ids.numel()).all(0).sum())
        self._tier_pages = counts

    @property
    def pages_per_tier(self) -> dict[str, int]:
        """Cached pages per tier, as last counted (read by the server's thread)."""
        return self._tier_pages


def _cut(entries: list, ok: list[bool]) -> list:
    """The leading entries up to the first that is not ok."""
    for i, good in enumerate(ok):
        if not good:
            return entries[:i]
    return entries


def _summary_bytes(summaries: torch.Tensor | None) -> bytes | None:
    if summaries is None:
        return None
    return summaries.contiguous().view(torch.uint8).numpy().tobytes()
