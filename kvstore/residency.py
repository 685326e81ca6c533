"""Residency policies: which pages of a memory tier to evict when room is needed.

The seam (ARCHITECTURE.md, "residency policy"): the store reports the slots a step used
(`touch`) and asks for victims among the slots it may evict (`victims`). KVSwap's FIFO reuse
buffer or KVDrive's score lookahead plug in here.

Stamps are layer clocks (`TieredKVStore.clock_of`: step * layers + layer). A decode step
reads each layer's pages once, layer after layer, so a tier that cannot hold a step's pages
sees a cycle: LRU then evicts exactly the page needed next (on bench/pipeline.py:
1-3% host hits). `cycle` evicts the page needed last instead; `score`, the default, is cycle
with the pages new to the selection evicted first.
"""
from __future__ import annotations

import torch

from kvstore.config import RESIDENCY_POLICIES

_NONE = torch.empty(0, dtype=torch.int64)
# badness offsets (clocks stay far below 2**56): stale pages first, spare copies last
_STALE, _SPARE = 1 << 61, 1 << 60
# `score`: a flag in a slot's stamp (the page's next use is uncertain), and the badness it adds
# to a live page; a live page the host tier holds too adds _CHEAP (refetched from DRAM)
WEAK_FLAG, _WEAK, _CHEAP = 1 << 58, 1 << 57, 1 << 58


class LRUResidency:
    """Least recently used slot first. `last_used` [num_slots] int64 layer clocks."""

    weighs_cost = False         # whether `victims` takes `cheap`

    def __init__(self, num_slots: int):
        self.last_used = torch.zeros(num_slots, dtype=torch.int64)

    def touch(self, slots: torch.Tensor, now: int | torch.Tensor) -> None:
        """`slots` were used at clock `now` (one value, or one per slot)."""
        if slots.numel():
            self.last_used[slots.long()] = now

    def mark_weak(self, slots: torch.Tensor) -> None:
        """`slots`, just touched, may well not be used next step (`score` ranks them lower;
        the other policies ignore it)."""

    def age(self, slots: torch.Tensor) -> None:
        """Make slots the first candidates for eviction (placement of cold pages)."""
        if slots.numel():
            self.last_used[slots.long()] = -1

    def victims(self, n: int, evictable: torch.Tensor, now: int = 0,
                cheap: torch.Tensor | None = None) -> torch.Tensor:
        """The n slots to evict first among `evictable` [num_slots] bool (fewer if there are
        not enough), as int64 [<= n], at clock `now`. `cheap` [num_slots] bool: pages a
        slower memory tier holds too (only `score` weighs it)."""
        cand = evictable.nonzero().squeeze(1)
        if cand.numel() <= n:
            return cand
        order = torch.topk(self.last_used[cand], n, largest=False, sorted=False).indices
        return cand[order]

    def admit(self, used: torch.Tensor, evictable: torch.Tensor, spare: torch.Tensor,
              free: int, now: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages demoted into this tier, last used at clocks `used` [k], with `free` slots
        free: (slots to evict for them, bool [k] which to admit, the stamps of the admitted).
        `spare` [num_slots]: slots whose page a faster tier holds too. LRU admits every page,
        as used now (the host tier extends the device's recency list), evicting spare copies
        first (the device serves them; it demotes them again if it evicts them first)."""
        admit = torch.ones(used.numel(), dtype=torch.bool)
        excess = used.numel() - free
        victims = _NONE
        if excess > 0:
            victims = spare.nonzero().squeeze(1)[:excess]
            if victims.numel() < excess:
                victims = torch.cat([victims, self.victims(excess - victims.numel(),
                                                           evictable & ~spare, now)])
        return victims, admit, torch.full_like(used, now)


class CycleResidency(LRUResidency):
    """For a cyclic access pattern, `period` clock ticks per cycle (a step's layers), each page
    used at most once per cycle. A page used within the last period (live) is next needed a
    period after its last use, so the most recently used live page is needed last: Belady's
    choice, evicted first. Pages unused for a whole period dropped out of the selection: they
    go before any live page, least recently used first. A tier too small for the cycle so
    keeps a fixed share of it, where LRU keeps none."""

    def __init__(self, num_slots: int, period: int):
        super().__init__(num_slots)
        self.period = period

    def victims(self, n: int, evictable: torch.Tensor, now: int = 0,
                cheap: torch.Tensor | None = None) -> torch.Tensor:
        cand = evictable.nonzero().squeeze(1)
        if cand.numel() <= n:
            return cand
        bad = self._badness(self.last_used[cand], now)
        if cheap is not None:
            bad = bad + self._cost(bad, cheap[cand])
        return cand[torch.topk(bad, n, sorted=False).indices]

    def _cost(self, bad: torch.Tensor, cheap: torch.Tensor) -> torch.Tensor:
        """What a page's refetch cost adds to its badness (cycle: nothing)."""
        return torch.zeros_like(bad)

    def admit(self, used: torch.Tensor, evictable: torch.Tensor, spare: torch.Tensor,
              free: int, now: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Belady's choice between the residents and the pages coming in: the ones needed
        last stay out. A resident whose page a faster tier holds too goes only after every
        other live one: it was just fetched from here (so it looks used last), and giving it
        up costs a copy back when the device evicts the page (measured on bench/pipeline.py:
        demotions 127 -> 49 MB per step in sfc, 94 -> 44 in sequential, disk reads no higher).
        So in a cycle too long for both tiers, the host keeps a fixed share of the pages."""
        admit = torch.ones(used.numel(), dtype=torch.bool)
        excess = used.numel() - free
        if excess <= 0:
            return _NONE, admit, used
        cand = evictable.nonzero().squeeze(1)
        bad = self._badness(self.last_used[cand], now)
        bad = torch.where(spare[cand] & (bad < _STALE), bad - _SPARE, bad)
        pool = torch.cat([bad, self._badness(used, now)])
        out = torch.topk(pool, min(excess, pool.numel()), sorted=False).indices
        admit[out[out >= cand.numel()] - cand.numel()] = False
        return cand[out[out < cand.numel()]], admit, used[admit]

    def _badness(self, used: torch.Tensor, now: int) -> torch.Tensor:
        """Eviction order, worst (largest) first: pages unused for a whole period by age, then
        live pages newest first (their next use is furthest)."""
        stale = used <= now - self.period
        return torch.where(stale, _STALE + (now - used), used)


class ScoreResidency(CycleResidency):
    """`cycle` with a guess at each page's next use (KVDrive's lookahead eviction, SWARM's
    frequency / cost cache). A page a sparse decode selected that the step before did not
    select is *weak*: on bench/pipeline.py's workload such a page is selected again at the next
    step 53% of the time, a page selected two steps running 69%, ten 98% (the prompt's top
    pages, sinks and recent pages: always); dense layers' pages always. Eviction order: stale
    pages (as cycle), then live pages the host tier holds too (a DRAM copy away), then live weak
    pages, then the rest; newest first within each (cycle's Belady order). In a step whose pages
    do not all fit, cycle gives up pages that are needed next step for pages that are not; an
    offline replay of that workload's selections puts score's misses 18% under cycle's (Belady's
    optimum: 46% under), docs/kvstore.md. The flag lives in the stamp (WEAK_FLAG), so the C pass
    (kvstore/_evict.c) reads it with the stamps."""

    weighs_cost = True

    def mark_weak(self, slots: torch.Tensor) -> None:
        if slots.numel():
            s = slots.long()
            self.last_used[s] = self.last_used[s] | WEAK_FLAG

    def _badness(self, used: torch.Tensor, now: int) -> torch.Tensor:
        weak = (used >= 0) & ((used & WEAK_FLAG) != 0)
        used = torch.where(weak, used - WEAK_FLAG, used)
        return super()._badness(used, now) + torch.where(
            weak & (used > now - self.period), _WEAK, 0)

    def _cost(self, bad: torch.Tensor, cheap: torch.Tensor) -> torch.Tensor:
        return torch.where(cheap & (bad < _STALE), _CHEAP, 0)


def make_residency(name: str, num_slots: int, period: int) -> LRUResidency:
    """The policy `name` for a tier of `num_slots` slots; `period`: clock ticks per step."""
    if name == "cycle":
        return CycleResidency(num_slots, period)
    if name == "score":
        return ScoreResidency(num_slots, period)
    if name == "lru":
        return LRUResidency(num_slots)
    raise ValueError(f"--residency must be one of {', '.join(RESIDENCY_POLICIES)}, got {name!r}")
