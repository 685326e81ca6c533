"""Fetcher: moves pages between tiers for a step. Hits and misses per tier, evictions with
demotion to the host tier, fills from host or disk into device slots, and write-back of full
pages to the backing tier (asynchronous for disk, so it overlaps with compute)."""
from __future__ import annotations

import logging

import torch

from kvstore.tiers.errors import PageCorrupted, TierError

logger = logging.getLogger(__name__)


class DeviceTierTooSmall(RuntimeError):
    pass


class Fetcher:
    def __init__(self, store):
        self.store = store

    # ---------------------------------------------------------------- device residency
    def ensure(self, keys: torch.Tensor, protect: torch.Tensor, fill: bool) -> torch.Tensor:
        """Make every key resident on the device tier; returns int32 slots [n].
        fill=False only reserves slots (pages about to be written)."""
        store, dev = self.store, self.store.device_tier
        slots = dev.slots(keys)
        miss_mask = slots < 0
        n_miss = int(miss_mask.sum())
        if fill:
            store.stats.lookups["device"] += keys.numel()
            store.stats.hits["device"] += keys.numel() - n_miss
        if n_miss == 0:
            return slots
        miss = torch.unique(keys[miss_mask])
        self._make_room(miss.numel(), protect)
        new_slots = dev.alloc_slots(miss)
        if fill:
            self._fill(miss, new_slots.long())
        return dev.slots(keys)

    def _make_room(self, n: int, protect: torch.Tensor) -> None:
        store, dev = self.store, self.store.device_tier
        short = n - dev.num_free
        if short <= 0:
            return
        # NOTE: evict a batch beyond the shortfall: the scan over every slot then runs once
        # per several layers instead of once per layer
        want = max(short, dev.capacity_pages // 32)
        for attempt in range(2):
            key_of = dev.slot_keys
            evictable = (key_of >= 0) & store.clean[key_of.clamp(min=0)]
            if protect.numel():
                ps = dev.slots(protect)
                evictable[ps[ps >= 0].long()] = False
            victims = store.residency.victims(want, evictable)
            if victims.numel() >= short:
                break
            # pages still being written to the backing tier cannot go yet: wait for them
            for rkv in store.requests.values():
                store.wait_writes(rkv)
        else:
            raise DeviceTierTooSmall(
                f"the device tier ({dev.capacity_pages} pages) cannot hold this step's working "
                f"set: raise --kv-device-gb, or lower --max-num-seqs, --max-num-batched-tokens "
                f"or --sparse-budget")
        self.evict_device(victims)

    def evict_device(self, slots: torch.Tensor) -> None:
        """Drop device slots (clean pages only), demoting them to the host tier when it is a cache."""
        store, dev = self.store, self.store.device_tier
        if slots.numel() == 0:
            return
        keys = dev.slot_keys[slots]
        host = store.host_tier
        if host is not None and store.backing is not host:
            absent = ~host.contains(keys)
            if bool(absent.any()):
                hk = keys[absent]
                self._make_host_room(hk.numel())
                k = min(hk.numel(), host.num_free)
                if k:
                    host.put(hk[:k], dev.pool[slots[absent][:k]])
                    store.host_residency.touch(host.slots(hk[:k]), store.step_counter)
                    store.stats.add_transfer("device", "host", k * store.page_shape.nbytes)
        dev.delete(keys)
        store.stats.evictions["device"] += keys.numel()

    def _make_host_room(self, n: int) -> None:
        store, host = self.store, self.store.host_tier
        short = n - host.num_free
        if short <= 0:
            return
        key_of = host.slot_keys
        victims = store.host_residency.victims(max(short, host.capacity_pages // 32), key_of >= 0)
        host.delete(key_of[victims])
        store.stats.evictions["host"] += victims.numel()

    def evict_host(self, keys: torch.Tensor) -> None:
        store, host = self.store, self.store.host_tier
        if host is None or store.backing is host:
            return
        present = host.contains(keys)
        host.delete(keys[present])
        store.stats.evictions["host"] += int(present.sum())

    # ---------------------------------------------------------------- fills
    def _fill(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        store = self.store
        pool = store.device_tier.pool
        nbytes = store.page_shape.nbytes
        rest_keys, rest_slots = keys, slots
        host = store.host_tier
        if host is not None:
            hslots = host.slots(keys)
            in_host = hslots >= 0
            store.stats.lookups["host"] += keys.numel()
            n = int(in_host.sum())
            if n:
                store.stats.hits["host"] += n
                pool.index_copy_(0, slots[in_host], host.pool[hslots[in_host].long()])
                store.host_residency.touch(hslots[in_host], store.step_counter)
                store.stats.add_transfer("host", "device", n * nbytes)
            rest_keys, rest_slots = keys[~in_host], slots[~in_host]
        if rest_keys.numel() == 0:
            return
        disk = store.disk_tier
        if disk is None:
            raise RuntimeError(f"{rest_keys.numel()} KV pages are in no tier (store bug)")
        store.stats.lookups["disk"] += rest_keys.numel()
        staging = store.staging(rest_keys.numel())
        try:
            disk.get(rest_keys, staging)
        except TierError as exc:
            raise store.request_error(exc.keys, str(exc)) from exc
        store.stats.hits["disk"] += rest_keys.numel()
        pool.index_copy_(0, rest_slots, staging)
        store.stats.add_transfer("disk", "device", rest_keys.numel() * nbytes)

    # ---------------------------------------------------------------- write-back
    def write_back(self, keys: torch.Tensor, slots: torch.Tensor, request_ids: list[str]) -> None:
        """Pages that became full: copy them to the backing tier once."""
        store = self.store
        backing = store.backing
        if backing is store.device_tier:
            return          # device-only store: pages live (and stay) on the device
        pages = store.device_tier.pool[slots.long()]          # a copy the writer can own
        nbytes = store.page_shape.nbytes
        if backing is store.host_tier:
            backing.put(keys, pages)
            store.clean[keys] = True
            store.stats.add_transfer("device", "host", keys.numel() * nbytes)
            return
        by_req: dict[str, list[int]] = {}
        for u, rid in enumerate(request_ids):
            by_req.setdefault(rid, []).append(u)
        for rid, rows in by_req.items():
            idx = torch.tensor(rows, dtype=torch.int64)
            k, p = keys[idx], pages[idx]
            # NOTE: the store keeps `p` alive with the future until the write is applied
            store.requests[rid].written.append((backing.put_async(k, p), k, p))
