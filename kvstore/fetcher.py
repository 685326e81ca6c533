"""Fetcher: moves pages between tiers for a step. Hits and misses per tier, evictions with
demotion to the host tier, fills from host or disk into device slots (write-back of full
pages to the backing tier: kvstore/write_back.py; copies up through a copy stream:
kvstore/fill_copies.py)."""
from __future__ import annotations

import logging
from concurrent.futures import Future, wait

import torch

from kvstore import native_evict
from kvstore.errors import RequestKVError
from kvstore.fill_copies import copy_up, send_up, unstage
from kvstore.resolution import NONE as _NONE, Resolution
from kvstore.tiers.errors import TierError

logger = logging.getLogger(__name__)


class DeviceTierTooSmall(RuntimeError):
    pass


class Fetcher:
    """Stages of making pages resident on the device tier: `resolve` (hit/miss, slot
    reservation, eviction: mutates tier bookkeeping) then `fill` (data movement only). The
    pipeline runs them on different threads, so `fill` touches no bookkeeping but the host
    pins that `resolve` set; one thread at a time may call `resolve` (and anything else that
    mutates the tiers)."""

    native = True       # False: always the torch eviction pass (the reference)

    def __init__(self, tiers):
        self.tiers = tiers
        self._native = None     # kvstore.native_evict.NativeEviction, made on first use

    # ---------------------------------------------------------------- device residency
    def ensure(self, keys: torch.Tensor, protect: torch.Tensor, fill: bool) -> torch.Tensor:
        """Make every key resident on the device tier; returns int32 slots [n].
        fill=False only reserves slots (pages about to be written)."""
        res = self.resolve(keys, protect, count=fill, locate=fill)
        if fill:
            self.fill(res)
            self.arrived(res)
        return res.slots

    def resolve(self, keys: torch.Tensor, protect: torch.Tensor, count: bool = True,
                locate: bool = True) -> Resolution:
        """Device slots for keys [n]: hits keep their slot, misses get a reserved one
        (evicting unprotected clean pages if needed); with `locate`, misses are looked up in
        the host tier (found slots are pinned until `fill`) and the rest go to disk. A key
        may repeat (a page several sequences of the batch share: a prefix-cache hit): it
        takes one slot and is looked up in the host tier and read from disk once (the device
        tier's lookups count each sequence's need)."""
        tiers, dev = self.tiers, self.tiers.device_tier
        slots = dev.slots(keys)
        miss_mask = slots < 0
        n_miss = int(miss_mask.sum())
        if count:
            tiers.stats.count("lookups", "device", keys.numel())
            tiers.stats.count("hits", "device", keys.numel() - n_miss)
        if n_miss == 0:
            return Resolution(slots, _NONE, _NONE, _NONE, _NONE, count, keys=keys)
        miss = keys[miss_mask]
        if n_miss > 1:
            miss = torch.unique(miss)
        host = tiers.host_tier if locate else None
        in_host = hslots = None
        if host is not None:
            # NOTE: located (and pinned) before making room: the demotions that making room
            # causes evict host pages, and must not evict the ones this call is about to copy
            hslots = host.slots(miss)
            in_host = hslots >= 0
            tiers.host_pinned[hslots[in_host].long()] = True
        try:
            self._make_room(miss.numel(), protect)
            new_slots = dev.alloc_slots(miss).long()
        except BaseException:
            if host is not None:
                tiers.host_pinned[hslots[in_host].long()] = False
            raise
        slots = dev.slots(keys)
        if not locate:
            self.demote()            # the caller writes into the new slots right away
            if tiers.copies is not None:    # after any copy still landing in a freed slot
                tiers.copies.wait_all()
            return Resolution(slots, _NONE, _NONE, _NONE, _NONE, count, keys=keys)
        rest_keys, rest_slots = miss, new_slots
        host_src = host_dst = _NONE
        if host is not None:
            n = int(in_host.sum())
            if count:
                tiers.stats.count("lookups", "host", miss.numel())
                tiers.stats.count("hits", "host", n)
            if n:
                host_src, host_dst = hslots[in_host].long(), new_slots[in_host]
                tiers.host_residency.touch(host_src, tiers.clock_of(miss[in_host]))
            rest_keys, rest_slots = miss[~in_host], new_slots[~in_host]
        if rest_keys.numel():
            if tiers.disk_tier is None:
                raise RuntimeError(f"{rest_keys.numel()} KV pages are in no tier (store bug)")
            if count:
                tiers.stats.count("lookups", "disk", rest_keys.numel())
        # NOTE: never evicted until `fill` has written them (or `forget` dropped them): a fill
        # may still run on the fetch stage when a later resolve makes room
        tiers.device_pinned[new_slots] = True
        res = Resolution(slots, host_src, host_dst, rest_keys, rest_slots, count, keys=keys)
        if tiers.copies is not None:    # the copies go after every read of the evicted pages
            res.after = tiers.copies.mark()
        if tiers.recompute is not None and rest_keys.numel():
            pick = tiers.recompute.choose(rest_keys)
            if bool(pick.any()):
                res.input_keys, res.input_dst = rest_keys[pick], rest_slots[pick]
                res.disk_keys, res.disk_dst = rest_keys[~pick], rest_slots[~pick]
        return res

    def _make_room(self, n: int, protect: torch.Tensor) -> None:
        tiers, dev = self.tiers, self.tiers.device_tier
        short = n - dev.num_free
        if short <= 0:
            return
        want = self._batch(short)
        for attempt in range(2):
            if self._evict(want, protect, need=short):
                return
            # pages still being written to the backing tier cannot go yet: wait for them
            tiers.wait_writes()
            failed = tiers.failed_writes()
            if failed:      # they never will (disk full, I/O error): fail their owners
                raise RequestKVError([rid for rid, _ in failed], failed[0][1])
        raise DeviceTierTooSmall(
            f"the device tier ({dev.capacity_pages} pages) cannot hold this step's working "
            f"set: raise --kv-device-gb, or lower --max-num-seqs, --max-num-batched-tokens, "
            f"--sparse-budget or --sparse-threshold (contexts up to it decode densely)")

    def reserve(self, n: int, protect: torch.Tensor, incoming: int = 0) -> None:
        """Evict ahead of need until `n` device slots are free (as far as clean, unpinned
        pages outside `protect` allow; no waiting for writes), and make the demotion copies:
        the pipeline's resolve thread does this while the engine thread computes, so that the
        next layer's resolves on the engine thread find free slots. `incoming`: misses about
        to be resolved, which take free slots first (one eviction for both, a batch as
        `_make_room` evicts)."""
        short = n + incoming - self.tiers.device_tier.num_free
        if short <= 0:
            return
        self._evict(self._batch(short) if incoming > 0 else short, protect)
        if self.tiers.demotions:
            self.demote()

    def _evict(self, want: int, protect: torch.Tensor, need: int = 0) -> bool:
        """Evict up to `want` device pages (clean, unpinned, outside `protect`) that the
        residency policy gives up first, demoting them to the host tier when it is a cache
        (the copies deferred to `demote`). Evicts nothing and returns False when fewer than
        `need` can go. In C for the stock policies (kvstore/native_evict.py)."""
        tiers = self.tiers
        if self.native and native_evict.serves(tiers):
            if self._native is None:
                self._native = native_evict.NativeEviction(tiers)
            return self._native.evict(want, protect, need)
        cheap = None
        if tiers.residency.weighs_cost and tiers.host_is_cache:    # a DRAM copy away
            cheap = tiers.host_tier.contains(tiers.device_tier.slot_keys.clamp(min=0))
        victims = tiers.residency.victims(want, self._evictable(protect), tiers.clock_now,
                                          cheap)
        if victims.numel() < need:
            return False
        self.evict_device(victims, defer=True)
        return True

    def _batch(self, short: int) -> int:
        """How many pages to evict for resolves `short` slots short: a batch beyond the
        shortfall, so that the scan over every slot runs once per several layers instead of
        once per layer."""
        return max(short, self.tiers.device_tier.capacity_pages // 32)

    def _evictable(self, protect: torch.Tensor) -> torch.Tensor:
        """bool [device slots]: clean, unpinned pages outside `protect`."""
        tiers, dev = self.tiers, self.tiers.device_tier
        key_of = dev.slot_keys
        evictable = (key_of >= 0) & tiers.clean[key_of.clamp(min=0)] & ~tiers.device_pinned
        if protect.numel():
            ps = dev.slots(protect)
            evictable[ps[ps >= 0].long()] = False
        return evictable

    def evict_device(self, slots: torch.Tensor, defer: bool = False) -> None:
        """Drop device slots (clean pages only), demoting them to the host tier when it is a
        cache. With `defer` (resolve, whose fill follows on the fetch stage) the demotion
        copies are only recorded, and `demote` makes them before the fill writes into any
        slot; otherwise they are made now."""
        tiers, dev = self.tiers, self.tiers.device_tier
        if slots.numel() == 0:
            return
        keys = dev.slot_keys[slots]
        host = tiers.host_tier
        if tiers.host_is_cache:
            absent = ~host.contains(keys)
            if bool(absent.any()):
                hk, ds = keys[absent], slots[absent].long()
                admit, stamps = self._make_host_room(tiers.residency.last_used[ds])
                k = min(stamps.numel(), host.num_free)
                if k:
                    hk, ds = hk[admit][:k], ds[admit][:k]
                    hslots = host.alloc_slots(hk).long()
                    tiers.demotions.append((ds, hslots))
                    tiers.host_residency.touch(hslots, stamps[:k])
                    tiers.stats.add_transfer("device", "host", k * host.page_bytes)
        dev.delete(keys)
        tiers.stats.count("evictions", "device", keys.numel())
        if not defer:
            self.demote()

    def demote(self) -> None:
        """Make the recorded demotion copies (evicted device page -> its new host slot), in
        the order they were recorded. Called before any write into a device slot or the host
        pool can follow an eviction: at the start of every fill (the fetch stage: a slot freed
        by a resolve is only written by its fill or a later one, and a host slot is only read
        by a later fill), and by whatever evicts outside resolve."""
        tiers = self.tiers
        # NOTE: the lock makes a caller wait for copies another thread has taken, not only
        # for the ones left in the queue
        with tiers.demote_lock:
            while tiers.demotions:
                src, dst = tiers.demotions.popleft()
                dev, host = tiers.device_tier.pool, tiers.host_tier
                if tiers.copies is None:
                    host.store_from(dev, src, dst)
                else:
                    # NOTE: down the copy stream, which runs in order: after the copies still
                    # landing in src, before any later fill's copy into it; not after the
                    # compute stream (an evicted page is clean: written long since). The
                    # host waits for this copy alone
                    pages, ev = tiers.copies.to_host(dev, src)
                    tiers.copies.sync(ev)
                    host.store_from(pages, torch.arange(src.numel()), dst)

    def _make_host_room(self, used: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Room in the host tier for pages demoted from the device, last used at clocks `used`
        [k]: evicts what the host policy gives up for them. Returns (bool [k] which to admit,
        their host stamps)."""
        tiers, host, dev = self.tiers, self.tiers.host_tier, self.tiers.device_tier
        key_of = host.slot_keys
        # NOTE: pinned slots are the sources of fills not done yet (pipelined fetch)
        evictable = (key_of >= 0) & ~tiers.host_pinned
        # pages the device tier holds too (a host hit leaves its copy): the device copy serves
        # them, and the host gets them back if the device evicts them first
        spare = evictable & (dev.slots(key_of.clamp(min=0)) >= 0)
        victims, admit, stamps = tiers.host_residency.admit(used, evictable, spare,
                                                            host.num_free, tiers.clock_now)
        if victims.numel():
            host.delete(key_of[victims])
            tiers.stats.count("evictions", "host", victims.numel())
        return admit, stamps

    def evict_clean(self, to_disk: bool) -> None:
        """Evict every clean device page, and with `to_disk` every host page too
        (--kv-force-tier: tests and diagnostics)."""
        key_of = self.tiers.device_tier.slot_keys
        evictable = (key_of >= 0) & self.tiers.clean[key_of.clamp(min=0)]
        self.evict_device(evictable.nonzero().squeeze(1))
        if to_disk and self.tiers.host_tier is not None:
            self.evict_host(self.tiers.host_tier.keys())

    def evict_host(self, keys: torch.Tensor) -> None:
        tiers, host = self.tiers, self.tiers.host_tier
        if not tiers.host_is_cache:
            return
        present = host.contains(keys)
        host.delete(keys[present])
        tiers.stats.count("evictions", "host", int(present.sum()))

    # ---------------------------------------------------------------- fills
    def start_reads(self, res: Resolution) -> None:
        """Issue the disk reads of `res` now, so that they run on the disk threads while the
        caller selects and resolves the next micro-batch: straight into their device slots (a
        device pool in host memory), else into a staging buffer that `fill` copies up; `fill`
        then copies the host pages and waits for them. The demotions recorded so far are made
        first: the reads overwrite evicted slots. An error is kept in `res.reads` and raised
        by `fill`."""
        tiers = self.tiers
        pool, copies = tiers.device_tier.pool, tiers.copies
        if res.reads is not None or res.inputs is not None \
                or res.disk_keys.numel() + res.input_keys.numel() == 0:
            return
        try:
            self.demote()
            rec = tiers.recompute
            if res.input_keys.numel():      # first: their recompute overlaps the K/V reads
                res.inputs = rec.read(res.input_keys)
            if res.disk_keys.numel():
                if copies is None:
                    res.reads = tiers.disk_tier.get_into(res.disk_keys, pool, res.disk_dst)
                else:
                    res.staged = copies.staging.take(res.disk_keys.numel())
                    res.reads = tiers.disk_tier.get_async(res.disk_keys, res.staged)
        except Exception as exc:   # noqa: BLE001 - raised by fill, which handles its errors
            if res.reads is None:   # NOTE: never replace reads under way: fill waits for them
                res.reads = Future()
                res.reads.set_exception(exc)
            return
        if rec is not None and res.reads is not None:   # the cost model follows the reads
            try:
                rec.time_reads(res.reads, res.disk_keys.numel())
            except Exception:   # noqa: BLE001 - a missed timing is no reason to fail a fill
                logger.exception("KV recompute: timing the reads failed")

    def fill(self, res: Resolution) -> None:
        """Copy the misses of `res` into their device slots: disk reads are issued first
        (straight into the slots when the device pool is in host memory; earlier if
        `start_reads` did) and run on the disk threads while this thread copies the host
        pages. Behind a copy stream, the pages are gathered into staging buffers and go up
        asynchronously; `res.ready` is the last copy's event (`arrived` waits for it).
        Unpins the host slots even when a disk read fails (RequestKVError names the
        owners)."""
        tiers = self.tiers
        self.demote()       # evictions of this resolve (and earlier ones) free the slots
        if not res.misses and res.staged is None:   # every page resident: nothing to move
            return
        pool, copies = tiers.device_tier.pool, tiers.copies
        n = res.disk_keys.numel()
        try:
            self.start_reads(res)           # unless the pipeline already did
            reads = res.reads
            try:
                if res.host_src.numel():
                    host = tiers.host_tier
                    if copies is None:
                        host.load_into(pool, res.host_dst, res.host_src)
                    else:
                        copy_up(tiers, res, res.host_dst, lambda buf: host.load_into(
                            buf, torch.arange(res.host_src.numel()), res.host_src))
                    tiers.stats.add_transfer("host", "device",
                                             res.host_src.numel() * host.page_bytes)
                if res.inputs is not None and not tiers.recompute.rebuild(
                        res.input_keys, res.inputs, pool, res.input_dst, tiers.disk_tier):
                    n, res.inputs = n + res.input_keys.numel(), None    # read as K/V
            finally:
                if reads is not None:    # never return with reads still landing in the pool
                    reads.result()
            if res.staged is not None:          # read into staging: up it goes
                send_up(tiers, res, res.disk_dst, res.staged)
                res.staged = None
        except TierError as exc:
            raise tiers.lost(exc.keys, str(exc)) from exc
        finally:
            tiers.host_pinned[res.host_src] = False
            unstage(tiers, res)
        # NOTE: after a failure the slots stay pinned until `forget` drops them
        tiers.device_pinned[res.host_dst] = False
        tiers.device_pinned[res.disk_slots] = False
        r = res.input_keys.numel() if res.inputs is not None else 0
        if n + r == 0:
            return
        if res.counted:
            tiers.stats.count("hits", "disk", n + r)
        moved = tiers.disk_bytes_of(res.disk_keys)
        if n > res.disk_keys.numel():           # inputs that failed: read as K/V
            moved += tiers.disk_bytes_of(res.input_keys)
        if r:
            if res.counted:
                tiers.stats.count("recomputed", "disk", r)
            moved += r * tiers.recompute.page_bytes
        tiers.stats.add_transfer("disk", "device", moved)

    def arrived(self, res: Resolution | None) -> None:
        """Compute that reads the pages `res` filled waits for their copies (a copy stream's
        event; nothing to wait for where fills write the pool in place)."""
        if res is not None and res.ready is not None:
            self.tiers.copies.wait(res.ready)

    def abandon(self, res: Resolution) -> None:
        """A resolution whose fill will never run (the job handing it over failed): wait
        for its disk reads, if issued, unpin its host pages and drop its slots (`forget`)."""
        if res.reads is not None:
            wait([res.reads])            # no read may land in a slot given to another page
        unstage(self.tiers, res)
        if res.inputs is not None:
            wait([res.inputs[0]])
        self.tiers.host_pinned[res.host_src] = False
        self.forget(res)

    def forget(self, res: Resolution | None) -> None:
        """A fill failed (or never ran): its misses' slots hold no valid page, so drop them
        rather than let a later lookup take them for hits. On the thread that resolves (no
        resolve runs meanwhile); a fill still running writes other slots.
        The owners of unreadable pages fail through the error; other pages are fetched again."""
        if res is None or res.misses == 0:
            return
        dev = self.tiers.device_tier
        slots = torch.cat([res.host_dst, res.disk_slots])
        dev.delete(dev.slot_keys[slots])
        self.tiers.device_pinned[slots] = False
