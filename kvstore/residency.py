"""Residency policies: which pages of a memory tier to evict when room is needed.

The seam (ARCHITECTURE.md, "residency policy"): the store reports the slots a step used
(`touch`) and asks for victims among the slots it may evict (`victims`). LRU is the first
policy; KVSwap's FIFO reuse buffer or KVDrive's score lookahead plug in here.
"""
from __future__ import annotations

import torch

RESIDENCY_POLICIES = ("lru",)


class LRUResidency:
    """Least recently used slot first. `last_used` [num_slots] int64 step counters."""

    def __init__(self, num_slots: int):
        self.last_used = torch.zeros(num_slots, dtype=torch.int64)

    def touch(self, slots: torch.Tensor, now: int) -> None:
        if slots.numel():
            self.last_used[slots.long()] = now

    def age(self, slots: torch.Tensor) -> None:
        """Make slots the first candidates for eviction (placement of cold pages)."""
        if slots.numel():
            self.last_used[slots.long()] = -1

    def victims(self, n: int, evictable: torch.Tensor) -> torch.Tensor:
        """The n least recently used slots among `evictable` [num_slots] bool (fewer if there
        are not enough), as int64 [<= n]."""
        cand = evictable.nonzero().squeeze(1)
        if cand.numel() <= n:
            return cand
        order = torch.topk(self.last_used[cand], n, largest=False, sorted=False).indices
        return cand[order]


def make_residency(name: str, num_slots: int) -> LRUResidency:
    if name == "lru":
        return LRUResidency(num_slots)
    raise ValueError(f"--residency must be one of {RESIDENCY_POLICIES}, got {name!r}")
