"""The eviction pass in C (kvstore/_evict.c through kvstore/native_evict.py) against the torch
pass it replaces (Fetcher._evictable, the residency policy's victims, Fetcher.evict_device):
the same pages leave each tier, the same pages are demoted with the same host stamps, the same
counters move, on random tier states of a real TieredKVStore's bookkeeping."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvstore.config import KVStoreConfig
from kvstore.fetcher import DeviceTierTooSmall, Fetcher
from kvstore.residency import WEAK_FLAG
from kvstore.store import TieredKVStore
from tests.server_helpers import REPO

PAGE = 1024                     # bytes: 16 tokens x 1 head x 8 dims x fp32 x K and V


def make_store(tmp_path, residency: str, dev_pages: int = 64, host_pages: int = 160,
               disk: bool = True, layers: int = 200) -> TieredKVStore:
    """Tiny pages; the residency policy's period is `layers` clock ticks (a clock per layer),
    so that the random stamps below can be live or stale."""
    cfg = KVStoreConfig(page_size=16, device_bytes=dev_pages * PAGE, host_bytes=host_pages * PAGE,
                        merge_host=False, disk_bytes=(1 << 22) if disk else 0,
                        disk_path=tmp_path / "kv" if disk else None, residency=residency)
    return TieredKVStore(cfg, layers, 1, 8, torch.float32)


def fill_randomly(store: TieredKVStore, seed: int, host_full: bool, now: int) -> None:
    """Random bookkeeping: device and host slots taken by random keys (some in both tiers),
    mostly clean, a few pinned, distinct stamps (live and stale) so that no tie decides."""
    g = torch.Generator().manual_seed(seed)
    dev, host = store.tiers.device_tier, store.tiers.host_tier
    max_keys = store.tiers.clean.numel()
    keys = torch.randperm(max_keys, generator=g)
    n_dev = dev.num_slots - int(torch.randint(0, 8, (1,), generator=g))
    dev.alloc_slots(keys[:n_dev])
    if host is not None:
        n_host = host.num_slots - (0 if host_full else host.num_slots // 3)
        both = n_dev // 3                               # spare copies: in both tiers
        host.alloc_slots(torch.cat([keys[:both], keys[n_dev:n_dev + n_host - both]]))
    store.tiers.clean[:] = torch.rand(max_keys, generator=g) < 0.9
    stamps = torch.randperm(dev.num_slots + (host.num_slots if host else 0), generator=g)
    stamps = now - (1 + seed % 2) * stamps      # most live (even seeds) or half stale (odd)
    if store.cfg.residency == "score":          # some pages flagged weak (kvstore/residency.py)
        stamps = torch.where(torch.rand(stamps.numel(), generator=g) < 0.4,
                             stamps | WEAK_FLAG, stamps)
    store.tiers.residency.last_used[:] = stamps[:dev.num_slots]
    store.tiers.device_pinned[:] = torch.rand(dev.num_slots, generator=g) < 0.05
    if host is not None:
        store.tiers.host_residency.last_used[:] = stamps[dev.num_slots:]
        store.tiers.host_pinned[:] = torch.rand(host.num_slots, generator=g) < 0.05
    store.tiers.clock_now = now


def state(store: TieredKVStore) -> dict:
    """What the pass decides, independent of which free slot a page landed in."""
    out = {"device": set(store.tiers.device_tier.keys().tolist()),
           "evictions": dict(store.stats.evictions),
           "transfers": dict(store.stats.transfer_bytes)}
    host = store.tiers.host_tier
    if host is not None:
        keys = host.keys()
        stamps = store.tiers.host_residency.last_used[host.slots(keys).long()]
        out["host"] = dict(zip(keys.tolist(), stamps.tolist()))
    return out


def demoted(store: TieredKVStore, dev_keys_before: torch.Tensor) -> set[int]:
    """Keys demoted, checking each recorded copy goes from the page's device slot to its new
    host slot."""
    got = set()
    for ds, hs in store.tiers.demotions:
        before = dev_keys_before[ds].tolist()
        assert before == store.tiers.host_tier.slot_keys[hs].tolist()
        got.update(before)
    return got


def check_maps(tier) -> None:
    """MemoryPool's invariants: the two maps agree and the free stack is every free slot."""
    key_of = tier.slot_keys
    used = (key_of >= 0).nonzero().squeeze(1)
    assert torch.equal(tier._slot_of[key_of[used]].long(), used)
    assert int((tier._slot_of >= 0).sum()) == used.numel()
    free = tier._free[:tier.num_free].long()
    assert sorted(free.tolist()) == (key_of < 0).nonzero().squeeze(1).tolist()


def run_pass(store, native: bool, want: int, need: int, protect: torch.Tensor):
    fetcher = Fetcher(store.tiers)
    fetcher.native = native
    before = store.tiers.device_tier.slot_keys.clone()
    ok = fetcher._evict(want, protect, need)
    return ok, state(store), demoted(store, before)


@pytest.mark.parametrize("residency", ["cycle", "lru", "score"])
@pytest.mark.parametrize("host_full", [True, False])
def test_native_pass_evicts_and_demotes_what_the_torch_pass_does(tmp_path, residency, host_full):
    demotions = 0
    for seed in range(6):
        want = [1, 5, 17, 40, 64, 200][seed]
        stores = [make_store(tmp_path / f"{seed}{native}", residency) for native in (0, 1)]
        for store in stores:
            fill_randomly(store, seed, host_full, now=10_000)
        protect = stores[0].tiers.device_tier.keys()[:: 3 + seed]
        (ok0, ref, dem0), (ok1, got, dem1) = (run_pass(s, n, want, 0, protect)
                                              for s, n in zip(stores, (False, True)))
        assert ok0 and ok1
        assert got == ref and dem1 == dem0
        assert ref["evictions"]["device"] > 0
        for tier in (stores[1].tiers.device_tier, stores[1].tiers.host_tier):
            check_maps(tier)
        if host_full:                  # each page demoted took the slot of one the host evicted
            assert len(dem0) <= ref["evictions"].get("host", 0)
        demotions += len(dem0)
    assert demotions > 0


@pytest.mark.parametrize("native", [False, True])
def test_pass_evicts_nothing_when_fewer_than_needed_can_go(tmp_path, native):
    store = make_store(tmp_path, "cycle")
    fill_randomly(store, 0, True, now=500)
    store.tiers.clean[:] = False
    store.tiers.clean[store.tiers.device_tier.keys()[:3]] = True           # 3 evictable pages
    before = state(store)
    fetcher = Fetcher(store.tiers)
    fetcher.native = native
    assert not fetcher._evict(10, torch.empty(0, dtype=torch.int64), need=4)
    assert not fetcher._evict(2, torch.empty(0, dtype=torch.int64), need=3)  # want < need
    assert state(store) == before and not store.tiers.demotions
    assert fetcher._evict(10, torch.empty(0, dtype=torch.int64), need=3)
    assert len(state(store)["device"]) == len(before["device"]) - 3
    with pytest.raises(DeviceTierTooSmall):
        fetcher._make_room(store.tiers.device_tier.num_free + 1, torch.empty(0, dtype=torch.int64))


def test_native_pass_with_the_host_as_backing_tier_only_drops_device_pages(tmp_path):
    stores = [make_store(tmp_path / str(n), "cycle", disk=False, layers=4) for n in (0, 1)]
    for store in stores:
        fill_randomly(store, 3, False, now=700)
    res = [run_pass(s, n, 20, 0, torch.empty(0, dtype=torch.int64))
           for s, n in zip(stores, (False, True))]
    assert res[0] == res[1] and not res[1][2]           # nothing demoted: the host has them all
    check_maps(stores[1].tiers.device_tier)


def test_native_pass_rejects_protect_keys_outside_the_key_space(tmp_path):
    store = make_store(tmp_path, "cycle")
    fill_randomly(store, 1, True, now=500)
    before = state(store)
    with pytest.raises(ValueError, match="protect"):
        Fetcher(store.tiers)._evict(5, torch.tensor([store.tiers.clean.numel()]))
    assert state(store) == before


def test_evict_pass_bench_runs_both_passes():
    """bench/evict_pass.py at its default tier sizes, a couple of passes (timings not asserted)."""
    out = subprocess.run([sys.executable, str(REPO / "bench" / "evict_pass.py"), "--repeats", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "torch (" in out and "C (kvstore/_evict.c)" in out and "ratio" in out
