"""The KV store's parts (docs/kvstore.md): shared, reference-counted pages, and an allocator
interface that never blocks the scheduler on disk I/O."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from kvstore.config import KVStoreConfig
from kvstore.page_allocator import PageAllocator
from kvstore.store import TieredKVStore
from kvstore.tiers.disk_fault import DiskFault

PAGE = 16 * 1 * 8 * 2 * 4          # page_size 16, 1 KV head, head_dim 8, K and V, float32
LAYERS = 2


def test_shared_pages_are_freed_when_the_last_holder_lets_go():
    a = PageAllocator(num_pages=8, page_size=4)
    assert a.allocate("a", 12)                                  # 3 pages
    prefix = a.pages("a")[:2]
    a.share("b", prefix)
    assert a.allocate("b", 16)                                  # 2 shared + 2 of its own
    assert a.pages("b")[:2] == prefix and a.num_free_pages == 3
    assert [a.refs(p) for p in prefix] == [2, 2]
    assert sorted(a.holders({prefix[0]})) == ["a", "b"]
    own_a, held_b = a.pages("a")[2], a.pages("b")
    assert a.release("a") == [own_a]                          # the shared pages stay held
    assert [a.refs(p) for p in prefix] == [1, 1] and a.num_free_pages == 4
    assert sorted(a.release("b")) == sorted(held_b)
    assert a.num_free_pages == 8 and all(a.refs(p) == 0 for p in range(8))


def test_share_refuses_free_repeated_or_second_hand_pages():
    a = PageAllocator(num_pages=4, page_size=4)
    assert a.allocate("a", 8)
    with pytest.raises(ValueError, match="in use"):
        a.share("b", [3])                                        # a free page
    with pytest.raises(ValueError, match="twice"):
        a.share("b", [a.pages("a")[0]] * 2)
    a.share("b", a.pages("a")[:1])
    with pytest.raises(ValueError, match="already holds"):
        a.share("b", a.pages("a")[1:])
    assert a.free("x") == 0                                      # idempotent, unknown ids too


def _store(tmp_path, disk: bool, fault: DiskFault | None = None) -> TieredKVStore:
    cfg = KVStoreConfig(page_size=16, device_bytes=64 * PAGE * LAYERS,
                        disk_bytes=(256 * PAGE * LAYERS) if disk else 0,
                        disk_path=tmp_path / "kv" if disk else None)
    store = TieredKVStore(cfg, LAYERS, 1, 8, torch.float32)
    if fault is not None:
        store.tiers.disk_tier.fault = fault
    return store


def _write_pages(store: TieredKVStore, rid: str) -> torch.Tensor:
    """Put the request's pages in the device tier (every layer); returns their keys."""
    keys = store.tiers.keys_of(torch.tensor(store.pages(rid), dtype=torch.int64))
    slots = store.tiers.device_tier.alloc_slots(keys).long()
    store.tiers.pool[slots] = torch.randn(slots.numel(), *store.page_shape.shape)
    return keys


def test_a_page_two_requests_share_stays_in_the_tiers_until_both_end(tmp_path):
    store = _store(tmp_path, disk=False)
    for rid in ("a", "b"):
        store.add_request(rid, 64)
    assert store.allocate("a", 48)
    keys_a = _write_pages(store, "a")
    shared = store.pages("a")[:2]
    store.share("b", shared)
    assert store.allocate("b", 48) and store.pages("b")[:2] == shared
    assert store.free("a") == 1                                  # its unshared page only
    shared_keys = store.tiers.keys_of(torch.tensor(shared, dtype=torch.int64))
    assert bool((store.tiers.device_slots(shared_keys) >= 0).all())
    assert not bool((store.tiers.device_slots(keys_a) >= 0).all())
    store.release("b")
    store.release("a")
    assert not bool((store.tiers.device_slots(shared_keys) >= 0).any())
    assert store.num_used_pages == 0


def test_only_pages_safe_in_the_backing_tier_can_be_shared(tmp_path):
    cfg = KVStoreConfig(page_size=16, device_bytes=8 * PAGE * LAYERS,
                        host_bytes=24 * PAGE * LAYERS, merge_host=False)
    store = TieredKVStore(cfg, LAYERS, 1, 8, torch.float32)        # the host tier backs
    store.add_request("a", 64)
    assert store.allocate("a", 32)
    with pytest.raises(ValueError, match="backing tier"):
        store.share("b", store.pages("a"))
    disk = _store(tmp_path, disk=True)       # not before their writes to disk are done
    disk.add_request("a", 64)
    assert disk.allocate("a", 32)
    with pytest.raises(ValueError, match="backing tier"):
        disk.share("b", disk.pages("a"))
    disk.close()


def test_a_finished_requests_file_goes_when_its_writes_are_done_even_when_idle(tmp_path):
    # the disk budget holds one request: the next one must get in once the first ended, with
    # no step in between (an idle engine) although its last write was still in flight
    slow = 0.3
    cfg = KVStoreConfig(page_size=16, device_bytes=64 * PAGE * LAYERS,
                        disk_bytes=(8 + 2) * 4096 * LAYERS, disk_path=tmp_path / "kv")
    store = TieredKVStore(cfg, LAYERS, 1, 8, torch.float32)       # 4 KB a page on disk
    store.tiers.disk_tier.fault = DiskFault(write_delay_s=slow)
    store.add_request("r", 128)
    assert store.allocate("r", 32)
    keys = _write_pages(store, "r")
    pages = store.tiers.pool[store.tiers.device_slots(keys).long()].clone()
    store.tiers.track_write("r", store.tiers.disk_tier.put_async(keys, pages), keys, pages)
    store.release("r")
    store.add_request("next", 128)                      # waits for the write, then fits
    store.release("next")
    store.close()


def test_free_returns_at_once_while_the_requests_disk_writes_are_in_flight(tmp_path):
    slow = 0.6
    store = _store(tmp_path, disk=True, fault=DiskFault(write_delay_s=slow))
    store.add_request("r", 64)
    assert store.allocate("r", 32)
    keys = _write_pages(store, "r")
    pages = store.tiers.pool[store.tiers.device_slots(keys).long()].clone()
    fut = store.tiers.disk_tier.put_async(keys, pages)
    store.tiers.track_write("r", fut, keys, pages)
    t0 = time.perf_counter()
    assert store.free("r") == 2                       # preempted: pages go, the file stays
    store.release("r")
    took = time.perf_counter() - t0
    assert took < slow / 3, f"free waited {took:.2f} s for a disk write"
    assert not fut.done() and any((tmp_path / "kv").iterdir())
    store.begin_step([])                              # the KV side waits, then closes the file
    assert fut.done() and not any(p.suffix == ".kv" for p in (tmp_path / "kv").iterdir())
    assert not bool(store.tiers.is_clean(keys).any())  # a retired write marks nothing clean
    store.close()


def test_on_a_cpu_the_host_budget_joins_the_device_pool(tmp_path):
    cfg = KVStoreConfig(page_size=16, device_bytes=8 * PAGE * LAYERS,
                        host_bytes=24 * PAGE * LAYERS)
    merged = TieredKVStore(cfg, LAYERS, 1, 8, torch.float32)
    assert set(merged.tier_usage()) == {"device"} and merged.num_pages == 32
    assert merged.tier_usage()["device"][1] == 32 * PAGE * LAYERS
    merged.add_request("a", 64)
    assert merged.allocate("a", 32)
    merged.share("b", merged.pages("a"))         # the device pool backs it: nothing to wait for
    separate = TieredKVStore(dataclasses.replace(cfg, merge_host=False), LAYERS, 1, 8,
                             torch.float32)
    assert set(separate.tier_usage()) == {"device", "host"} and separate.num_pages == 24


def test_forcing_pages_to_a_host_tier_that_joined_the_device_pool_is_refused():
    cfg = KVStoreConfig(page_size=16, device_bytes=8 * PAGE * LAYERS,
                        host_bytes=8 * PAGE * LAYERS, force_tier="host")
    with pytest.raises(ValueError, match="--kv-host-pool separate"):
        TieredKVStore(cfg, LAYERS, 1, 8, torch.float32)
    TieredKVStore(dataclasses.replace(cfg, merge_host=False), LAYERS, 1, 8, torch.float32)


def test_a_page_several_sequences_need_is_read_from_disk_once(tmp_path):
    """Sequences sharing prefix pages select the same keys: one slot, one disk read each."""
    store = _store(tmp_path, disk=True)
    store.add_request("r", 64)
    assert store.allocate("r", 48)
    keys = _write_pages(store, "r")
    tiers = store.tiers
    slots = tiers.device_slots(keys).long()
    pages = tiers.pool[slots].clone()
    tiers.disk_tier.put(keys, pages)
    tiers.clean[keys] = True
    store._fetcher.evict_device(slots.int())
    assert not bool((tiers.device_slots(keys) >= 0).any())
    twice = torch.cat([keys, keys.flip(0), keys[:1]])            # as two sequences' unions
    before = tiers.disk_tier.bytes_read
    res = store._fetcher.resolve(twice, twice)
    assert sorted(res.disk_keys.tolist()) == sorted(keys.tolist())
    store._fetcher.fill(res)
    got = tiers.device_slots(twice).long()
    assert torch.equal(got[:keys.numel()], got[keys.numel():2 * keys.numel()].flip(0))
    assert torch.equal(tiers.pool[got[:keys.numel()]], pages)
    # each page once (and the one gap page between the two layers' runs, read and dropped)
    assert tiers.disk_tier.bytes_read - before <= (keys.numel() + 1) * tiers.disk_tier.page_bytes
    assert store.stats.snapshot().lookups["disk"] == keys.numel()
    assert tiers.device_tier.num_free == tiers.device_tier.capacity_pages - keys.numel()
    store.release("r")
    store.close()
