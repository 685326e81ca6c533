"""WindowTrim: a sliding-window layer's pages that no query will read again leave the store.

A layer with a window w (ModelConfig.layer_windows) attends, at position p, to the keys in
(p - w, p]. Once a request's next query is at position q, its page i is dead in that layer
when the page's last key, (i + 1) * page_size - 1, is below q - w + 1. When the device tier is
the backing store (nothing below it, so a page would otherwise stay for the request's life),
such layer-pages are dropped from the tiers, as vLLM's hybrid KV cache manager and llama.cpp's
SWA cache do: Gemma 3 keeps the whole context in one layer of six and a window in the others.

Capacity is counted in layer-pages ("slots") of the backing tier: a page costs one slot per
layer it still holds. There are more page ids than slots over the layers (`id_space`), so a
request's pages can outnumber what whole pages would fit.
- A page's windowed layers (a group: the layers of one window length) are dropped once the
  page is dead there for every request that holds it: each step records where its requests'
  next queries are (`after_step`), and a request's dead pages go before it grows next
  (`advance`, from the store's `allocate`).
- A page the prefix cache holds keeps them (it is retained) until slots run short
  (`reclaim`), so a later prompt with the same prefix can still start after it, as vLLM keeps
  a freed block cached until its memory is taken.
- The prefix cache matches only a prefix whose last window of pages is whole (`usable`).

Engine thread only, as the allocator (which it asks who holds a page) and the prefix cache.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import numpy as np

from kvstore.page_allocator import PageAllocator

ID_FACTOR = 8       # page ids per whole page of slots, at most (the key space, 4 bytes a key)
Drops = list[tuple[list[int], tuple[int, ...]]]     # (page ids, the layers they lose)


def window_groups(windows) -> list[tuple[int, tuple[int, ...]]]:
    """[(window, its layers)] for the layers with a window, by window length."""
    groups: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        if w is not None:
            groups.setdefault(int(w), []).append(layer)
    return [(w, tuple(layers)) for w, layers in sorted(groups.items())]


def id_space(windows, whole_pages: int) -> int:
    """Page ids for a backing tier of `whole_pages` pages of every layer: as many as its slots
    hold pages of the layers without a window, up to ID_FACTOR times the whole pages."""
    full = sum(w is None for w in windows)
    return min(whole_pages * ID_FACTOR, whole_pages * len(windows) // max(full, 1))


def trims_windows(cfg, budgets: dict, windows) -> bool:
    """Windowed layers drop their dead pages: the model has some, --swa-full is off, and the
    device tier is the backing store (a lower tier would hold them anyway)."""
    return (any(w is not None for w in windows) and not cfg.swa_full
            and not budgets["host"] and not budgets["disk"])


def make_allocator(cfg, budgets: dict, windows, whole_pages: int
                   ) -> tuple[PageAllocator, WindowTrim | None]:
    """A KV store's page allocator for a backing tier of `whole_pages` pages of every layer,
    and its window trimming where that applies (more page ids then: `id_space`)."""
    if not trims_windows(cfg, budgets, windows):
        return PageAllocator(whole_pages, cfg.page_size), None
    allocator = PageAllocator(id_space(windows, whole_pages), cfg.page_size)
    return allocator, WindowTrim(windows, cfg.page_size, whole_pages, allocator,
                                 cfg.max_step_tokens)


def dead_pages(start: int, window: int, page_size: int) -> int:
    """Leading pages no query from position `start` on reads in a layer of `window`."""
    return max(0, start - window + 1) // page_size


class WindowTrim:
    def __init__(self, windows, page_size: int, whole_pages: int, allocator: PageAllocator,
                 step_tokens: int = 2048):
        """step_tokens: the most a step computes of one request (--max-num-batched-tokens),
        which `capacity` allows for."""
        self.groups = window_groups(windows)
        self.num_layers = len(windows)
        self.page_size = page_size
        self.whole_pages = whole_pages
        self.total_slots = whole_pages * self.num_layers
        self.used_slots = 0
        self._alloc = allocator
        ids = allocator.num_pages
        self._sizes = np.array([len(layers) for _, layers in self.groups], dtype=np.int64)
        self._trimmed = np.zeros((len(self.groups), ids), dtype=bool)
        self._index = np.zeros(ids, dtype=np.int64)     # a page's index in its holders' lists
        self._start: dict[str, int] = {}                # request -> its next query's position
        self._done: dict[str, list[int]] = {}           # request -> pages settled, per group
        self._retained: OrderedDict[tuple[int, int], None] = OrderedDict()   # (page, group)
        self.evictable_slots = 0        # slots of cached pages no request holds, as counted
        self._counted_at = -1e9
        self.capacity = self.capacity_pages(step_tokens)    # the longest request, in pages

    # ------------------------------------------------------------------ slots
    @property
    def free_slots(self) -> int:
        return self.total_slots - self.used_slots

    def free_pages(self, free_ids: int) -> int:
        """Whole pages that can be allocated, of `free_ids` ids (free or cached only)."""
        return min(free_ids, (self.free_slots + self.evictable_slots) // self.num_layers)

    def used_pages(self) -> int:
        """The whole pages the slots requests hold make."""
        return max(0, -(-(self.used_slots - self.evictable_slots) // self.num_layers))

    def make_room(self, pages: int, drop: Callable[[Drops], None],
                  reclaim: Callable[[int], int] | None) -> bool:
        """Slots for `pages` whole pages: retained windowed layers go first (`drop`s them from
        the tiers), then cached pages nobody holds (`reclaim(n)` frees up to n, least recently
        used first, and returns how many went); False when still short."""
        short = pages * self.num_layers - self.free_slots
        if short > 0:
            drop(self.reclaim(short))
            short = pages * self.num_layers - self.free_slots
        while short > 0 and reclaim is not None and reclaim(-(-short // self.num_layers)):
            short = pages * self.num_layers - self.free_slots
        return short <= 0

    def cost(self, page_ids) -> int:
        """Slots the pages take now."""
        ids = np.asarray(page_ids, dtype=np.int64)
        if not ids.size:
            return 0
        return self.num_layers * ids.size - int(self._sizes @ self._trimmed[:, ids].sum(1))

    def peak_slots(self, num_tokens: int, step_tokens: int) -> int:
        """Slots one request of `num_tokens` tokens needs at most, computed `step_tokens` a
        step: the windowed layers' pages of their window, one step and a page of slack, the
        others' of all."""
        ps = self.page_size
        pages = -(-num_tokens // ps)
        slots = pages * self.num_layers
        for (w, _), n in zip(self.groups, self._sizes):
            live = (w + step_tokens - 1) // ps + 3       # (a page of slack: `advance`)
            slots -= int(n) * max(0, pages - live)
        return slots

    def capacity_pages(self, step_tokens: int) -> int:
        """The most pages one request can hold (its peak slots fit, and the page ids)."""
        lo, hi = 0, self._trimmed.shape[1]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_slots(mid * self.page_size, step_tokens) <= self.total_slots:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def count(self, cache_only: Callable[[], list[int]], max_age_s: float = 1.0) -> None:
        """Recount the slots cached pages nobody holds take (the metrics' free and used pages),
        at most every `max_age_s` seconds."""
        now = time.monotonic()
        if now - self._counted_at >= max_age_s:
            self._counted_at = now
            only = cache_only()
            self.evictable_slots = self.cost(only) + self.retained_slots(set(only))

    def added(self, page_ids, first_index: int) -> None:
        """Fresh pages, the request's from index `first_index` on, take all their slots."""
        ids = np.asarray(page_ids, dtype=np.int64)
        self.used_slots += self.num_layers * ids.size
        self._index[ids] = np.arange(first_index, first_index + ids.size)

    def gone(self, page_ids) -> None:
        """Pages nobody holds any more: their slots are free, their ids fresh."""
        if not page_ids:
            return
        ids = np.asarray(page_ids, dtype=np.int64)
        self.used_slots -= self.cost(ids)
        self._trimmed[:, ids] = False
        if self._retained:
            for p in page_ids:
                for g in range(len(self.groups)):
                    self._retained.pop((int(p), g), None)

    def ended(self, request_id: str) -> None:
        """The request let its pages go (end or preemption): it reads nothing any more."""
        self._start.pop(request_id, None)
        self._done.pop(request_id, None)

    def trimmed(self, page_id: int) -> bool:
        """The page lost some layers."""
        return bool(self._trimmed[:, page_id].any())

    # ------------------------------------------------------------------ dropping
    def moved(self, request_id: str, start: int) -> None:
        """The request's next query is at `start` (after a step)."""
        self._start[request_id] = start

    def after_step(self, seqs, cache_only: Callable[[], list[int]]) -> None:
        """The step's sequences (kvstore/step.SeqKV) moved on; recount (`count`)."""
        for s in seqs:      # NOTE: a decode's drafts may be rejected: from its next token on
            self.moved(s.request_id, s.start_pos + s.q_len - s.drafts)
        self.count(cache_only)

    def due(self, request_id: str) -> bool:
        """The request's frontier passed pages not settled yet (`advance` has work)."""
        start, done = self._start.get(request_id), self._done.get(request_id)
        if start is None:
            return False
        return done is None or any(d < self._frontier(start, w)
                                   for d, (w, _) in zip(done, self.groups))

    def advance(self, request_id: str, pages) -> Drops:
        """Before the request grows: its pages dead in every holder's window go (retained
        instead while the prefix cache holds them); returns what to drop. Not at the end of
        the step that moved it: the prompt's pages join the cache after that."""
        start = self._start.get(request_id)
        if start is None:
            return []
        done = self._done.setdefault(request_id, [0] * len(self.groups))
        drops: Drops = []
        for g, (w, layers) in enumerate(self.groups):
            dead = min(len(pages), self._frontier(start, w))
            i, out = done[g], []
            while i < dead:
                p = pages[i]
                if not self._trimmed[g, p]:
                    if self._needed(p, g, i):
                        break
                    if self._alloc.held(p):
                        self._retained[(p, g)] = None
                    else:
                        out.append(p)
                i += 1
            done[g] = i
            if out:
                drops.append((self._trim(out, g), layers))
        return drops

    def reclaim(self, slots: int) -> Drops:
        """Free at least `slots` slots if the retained pages can (oldest first): their
        windowed layers go, but not where a request that shares them still reads them."""
        freed, drops = 0, []
        for p, g in list(self._retained):
            if freed >= slots:
                break
            if self._needed(p, g, int(self._index[p])):
                continue
            drops.append((self._trim([p], g), self.groups[g][1]))
            freed += int(self._sizes[g])
        return drops

    def retained_slots(self, besides: set[int] = frozenset()) -> int:
        """Slots the retained windowed layers take (of pages not in `besides`)."""
        return sum(int(self._sizes[g]) for p, g in self._retained if p not in besides)

    def _trim(self, page_ids: list[int], g: int) -> list[int]:
        """The pages (not trimmed in group g yet) lose its layers' slots."""
        self._trimmed[g, page_ids] = True
        self.used_slots -= int(self._sizes[g]) * len(page_ids)
        for p in page_ids:      # (retained while cached; the cache may have let it go since)
            self._retained.pop((p, g), None)
        return page_ids

    def _needed(self, page_id: int, g: int, index: int) -> bool:
        """Some request holding the page (at `index`, as prefix sharing keeps it) may still
        read it in group g's layers."""
        w = self.groups[g][0]
        return any(self._frontier(self._start.get(rid, 0), w) <= index
                   for rid in self._alloc.holders_at(index, page_id))

    def _frontier(self, start: int, window: int) -> int:
        """Leading pages a request whose next query is at `start` lets go in a layer of
        `window`. NOTE: a page of slack: a later prompt that resends this one's text matches
        its full pages, whose last window reaches a page further back than the next query's."""
        return dead_pages(start - self.page_size, window, self.page_size)

    # ------------------------------------------------------------------ prefix cache
    def usable(self, page_ids) -> int:
        """How many leading pages of a cached prefix a request can start after: the pages
        its first query (right after them) reads in each window are all whole."""
        n = len(page_ids)
        if not n or not self.groups:
            return n
        ids = np.asarray(page_ids, dtype=np.int64)
        ks = np.arange(n + 1)
        ok = np.ones(n + 1, dtype=bool)
        for g, (w, _) in enumerate(self.groups):
            cut = np.concatenate(([0], np.cumsum(self._trimmed[g, ids])))
            lo = np.maximum(0, ks * self.page_size - w + 1) // self.page_size
            ok &= cut[ks] == cut[lo]
        return int(np.flatnonzero(ok)[-1])
