"""Residency policies (kvstore/residency.py) on the access pattern of sparse decode: each step
reads every layer once, in order, so a tier too small for a step's pages sees a cycle.
(tests/test_pipeline.py compares them on the real model and tiers.)"""
from __future__ import annotations

import pytest
import torch

from kvstore.residency import (WEAK_FLAG, CycleResidency, LRUResidency, ScoreResidency,
                               make_residency)


class Cache:
    """A tier's slot map driven by a residency policy as kvstore/fetcher.py drives the device
    tier's: a miss takes a free slot, else the first victim's."""

    def __init__(self, policy: LRUResidency, slots: int):
        self.policy = policy
        self.slot_of: dict[int, int] = {}
        self.key_of = [-1] * slots
        self.hits = self.misses = 0

    def use(self, key: int, now: int, weak: bool = False) -> None:
        slot = self.slot_of.get(key)
        if slot is None:
            self.misses += 1
            if -1 in self.key_of:
                slot = self.key_of.index(-1)
            else:
                evictable = torch.ones(len(self.key_of), dtype=torch.bool)
                slot = int(self.policy.victims(1, evictable, now)[0])
                del self.slot_of[self.key_of[slot]]
            self.slot_of[key], self.key_of[slot] = slot, key
        else:
            self.hits += 1
        self.policy.touch(torch.tensor([slot]), now)
        if weak:
            self.policy.mark_weak(torch.tensor([slot]))


def run_steps(cache: Cache, keys_per_layer: list[list[int]], steps: range) -> None:
    """Steps in turn; the keys of layer l are used at clock step * layers + l."""
    layers = len(keys_per_layer)
    for step in steps:
        for layer, keys in enumerate(keys_per_layer):
            for k in keys:
                cache.use(k, step * layers + layer)


def test_cycle_keeps_a_fixed_share_where_lru_evicts_the_page_needed_next():
    layers, per_layer, slots = 10, 8, 40        # a step reads 80 pages through 40 slots
    keys = [[layer * 100 + p for p in range(per_layer)] for layer in range(layers)]
    lru = Cache(LRUResidency(slots), slots)
    cyc = Cache(CycleResidency(slots, layers), slots)
    for c in (lru, cyc):
        run_steps(c, keys, range(1))            # the first step fills the tier
        c.hits = c.misses = 0
        run_steps(c, keys, range(1, 6))
    # near Belady's share on a cycle: a page per slot per step, less the few that turn over
    assert cyc.hits >= 0.85 * 5 * slots
    # LRU evicts the page needed next (its only hits are ties within a layer's clock tick)
    assert lru.hits < cyc.hits / 4


def test_cycle_evicts_pages_that_dropped_out_of_the_selection_first():
    layers, slots = 4, 14
    old = [[layer * 100 + p for p in range(3)] for layer in range(layers)]       # 12 pages
    cache = Cache(CycleResidency(slots, layers), slots)
    run_steps(cache, old, range(2))
    # the selection moves: page 2 of each layer is replaced by pages 7 and 8
    new = [[layer * 100 + p for p in (0, 1, 7, 8)] for layer in range(layers)]  # 16 pages
    run_steps(cache, new, range(2, 3))
    assert not any(layer * 100 + 2 in cache.slot_of for layer in range(layers))
    cache.hits = 0
    run_steps(cache, new, range(3, 5))
    assert cache.hits >= 2 * (slots - 2)        # the tier holds a fixed share of the new set


def test_cycle_admits_demoted_pages_by_their_next_use():
    """The host's side: a page demoted from the device competes with the residents by when it
    is next needed; stale residents go first, copies the device holds too last."""
    pol = CycleResidency(6, period=10)
    pol.touch(torch.arange(6), torch.tensor([100, 95, 103, 104, 105, 106]))
    now = 106
    evictable = torch.ones(6, dtype=torch.bool)
    spare = torch.tensor([False, False, False, False, False, True])
    # two pages come in, last used at 101 and 102: slot 1 is stale (unused for a period) and
    # goes; then slot 4 (105, needed after both): slot 5, newer still, is a spare copy and
    # stays
    victims, admit, stamps = pol.admit(torch.tensor([101, 102]), evictable, spare, 0, now)
    assert sorted(victims.tolist()) == [1, 4] and admit.tolist() == [True, True]
    assert stamps.tolist() == [101, 102]
    pol.touch(torch.tensor([1, 4]), stamps)
    # a page used at 107 is needed after every resident: not admitted
    victims, admit, _ = pol.admit(torch.tensor([102, 107]), evictable, spare, 0, now)
    assert victims.tolist() == [3] and admit.tolist() == [True, False]
    # with free slots every page comes in and nothing is evicted
    victims, admit, _ = pol.admit(torch.tensor([104, 107]), evictable, spare, 2, now)
    assert victims.numel() == 0 and admit.all()


def test_lru_admits_every_demoted_page_over_spare_copies_first():
    pol = LRUResidency(4)
    pol.touch(torch.arange(4), torch.tensor([10, 11, 12, 13]))
    evictable = torch.ones(4, dtype=torch.bool)
    spare = torch.tensor([False, False, True, False])
    victims, admit, stamps = pol.admit(torch.tensor([5, 6]), evictable, spare, 0, 14)
    assert sorted(victims.tolist()) == [0, 2] and admit.all()
    assert stamps.tolist() == [14, 14]           # a demotion counts as a use


def test_score_keeps_the_pages_selected_again_over_the_ones_that_come_and_go():
    """Each step a layer needs 6 stable pages and 3 new ones that are never needed again (the
    selection's churn), through slots for 2/3 of a step: cycle keeps a share of everything and
    so gives up stable pages for the churn; score, told which pages the step before did not
    select, gives up the churn first and keeps (nearly) every stable page."""
    layers, slots, steps = 6, 36, 8
    hits = {}
    for policy in (CycleResidency(slots, layers), ScoreResidency(slots, layers)):
        cache = Cache(policy, slots)
        for step in range(steps):
            for layer in range(layers):
                now = step * layers + layer
                for p in range(6):
                    cache.use(layer * 1000 + p, now)
                for p in range(3):                       # new this step: weak
                    cache.use(layer * 1000 + 100 + step * 10 + p, now, weak=True)
            if step == 1:
                cache.hits = 0
        hits[type(policy).__name__] = cache.hits
    stable = (steps - 2) * layers * 6
    assert hits["ScoreResidency"] >= 0.9 * stable
    assert hits["CycleResidency"] < 0.8 * hits["ScoreResidency"]


def test_score_evicts_stale_then_cheap_then_weak_then_the_rest_newest_first():
    pol = ScoreResidency(8, period=10)
    now = 100
    # slots 0-1 stale (unused for a period); 2-3 live with a DRAM copy; 4-5 live, weak; 6-7 live
    pol.touch(torch.arange(8), torch.tensor([80, 85, 95, 96, 97, 98, 99, 100]))
    pol.mark_weak(torch.tensor([1, 4, 5]))          # a stale page's flag changes nothing
    cheap = torch.zeros(8, dtype=torch.bool)
    cheap[[2, 3]] = True
    evictable = torch.ones(8, dtype=torch.bool)
    order = [pol.victims(k, evictable, now, cheap).tolist() for k in range(1, 9)]
    firsts = [sorted(set(o) - set(p)) for o, p in zip(order, [[]] + order[:-1])]
    assert [f[0] for f in firsts] == [0, 1, 3, 2, 5, 4, 7, 6]
    assert int(pol.last_used[4]) == 97 | WEAK_FLAG
    pol.touch(torch.tensor([4]), 101)                # a new use clears the flag
    assert int(pol.last_used[4]) == 101
    # without `cheap` (no host cache) the copies are plain live pages
    assert sorted(pol.victims(3, evictable, now + 1).tolist()) == [0, 1, 5]


def test_score_admits_demoted_pages_with_their_flags():
    """The host tier ranks a weak page demoted from the device as the device did."""
    pol = ScoreResidency(4, period=10)
    pol.touch(torch.arange(4), torch.tensor([96, 97, 98, 99]))
    evictable = torch.ones(4, dtype=torch.bool)
    spare = torch.zeros(4, dtype=torch.bool)
    # a weak page last used at 95 goes before any resident; a strong one at 95 after all
    victims, admit, stamps = pol.admit(torch.tensor([95 | WEAK_FLAG, 95]), evictable, spare,
                                       0, 100)
    assert admit.tolist() == [False, True] and victims.tolist() == [3]
    assert stamps.tolist() == [95]


def test_make_residency_names_the_policies():
    assert isinstance(make_residency("cycle", 4, period=3), CycleResidency)
    assert type(make_residency("lru", 4, period=3)) is LRUResidency
    assert type(make_residency("score", 4, period=3)) is ScoreResidency
    with pytest.raises(ValueError, match="cycle, lru, score"):
        make_residency("fifo", 4, period=3)
