"""TierSet: the tiers of one KV store and everything that says where a page is.

Owns the device, host and disk tiers, their residency policies, the pins of slots a pending
fill reads from or writes into, the demotion queue, the clean mask (which pages are safe in
the backing tier), the in-flight backing writes, the staging buffers and the layer clocks.
The Fetcher (kvstore/fetcher.py) and the C eviction pass (kvstore/native_evict.py) are the
tier set's movers: they, and only they, read and write its fields. Everyone else uses the
methods below.

A page of one layer is the key `layer * max_pages + page_id` in every tier.

Lock discipline: one thread at a time mutates the tiers' slot maps, the residency stamps, the
clean mask and the pins (the engine thread, or the pipeline's resolve thread while the engine
thread waits for it at the next drain). Fills on the fetch thread touch only pool contents and
the pins their own resolve set. `demote_lock` serialises the demotion copies, which the fetch
thread and the engine thread may both make. Completed backing writes are applied on the engine
thread only (`check_writes`), never in I/O callbacks.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, wait
from typing import Callable

import torch

from kvstore.config import KVStoreConfig
from kvstore.errors import RequestKVError
from kvstore.recompute import Recompute, RecomputePlan
from kvstore.residency import WEAK_FLAG, make_residency
from kvstore.stats import KVStats
from kvstore.tiers.base import PageShape
from kvstore.tiers.codec import PageCodec
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_inputs import DiskWithInputs, input_page_shape, inputs_path
from kvstore.tiers.disk_layers import DiskLayers
from kvstore.tiers.disk_set import DiskSet
from kvstore.tiers.host import HostTier
from kvstore.tiers.transfers import make_copies

logger = logging.getLogger(__name__)


class TierSet:
    def __init__(self, cfg: KVStoreConfig, page_shape: PageShape, num_layers: int,
                 max_pages: int, device: torch.device, stats: KVStats,
                 owners: Callable[[set[int]], list[str]], namespace: bytes = b"",
                 codec: PageCodec | None = None, summary_dim: int | None = None,
                 recompute: RecomputePlan | None = None, coded: list[int] | None = None):
        """namespace: the prefix cache's, which the disk tier's index logs carry; codec: the
        host and disk tiers' (None: pages stored as they are); coded: the layers the disk
        tier codes (None: all; kvstore/codec_share.py); recompute: the plan when fills
        recompute a share of their pages (KVPR)."""
        self.page_shape = page_shape
        self.num_layers = num_layers
        self.max_pages = max_pages
        self.stats = stats
        self._owners = owners               # page ids -> the requests that hold them
        max_keys = max_pages * num_layers
        # NOTE: on a CPU both pools are the same DRAM: one pool that attention reads in place,
        # instead of a host pool whose hits are copies into another (cfg.budgets)
        budgets = cfg.budgets(device.type)
        device_bytes, host_bytes = budgets["device"], budgets["host"]
        self.device_tier = DeviceTier(page_shape, device_bytes, max_keys, device)
        # NOTE: the codec stores the host tier's pages too (a separate host pool only)
        self.host_tier = HostTier(page_shape, host_bytes, max_keys, codec=codec) \
            if host_bytes else None
        # None: fills write the pool in place (host memory); else its copy stream
        self.copies = make_copies(device, page_shape, cfg.copy_stream)
        # values per page summary row (kvstore/selection.py): what cached pages carry
        self.summary_dim = summary_dim or page_shape.head_dim
        summary_bytes = num_layers * page_shape.num_kv_heads * 3 * self.summary_dim \
            * page_shape.dtype.itemsize
        disk_args = (page_shape, cfg.disk_bytes, cfg.disk_path, max_keys, num_layers, max_pages)
        coded = list(range(num_layers)) if coded is None or codec is None else coded
        disk_codec = codec if coded else None
        self.coded_layers = coded if disk_codec is not None and cfg.disk_bytes else []
        disk_kw = dict(threads=cfg.disk_threads, namespace=namespace,
                       summary_bytes=summary_bytes, codec=disk_codec)
        self.disk_tier, self.recompute = None, None
        if cfg.disk_bytes and 0 < len(coded) < num_layers:     # some layers coded
            self.disk_tier = DiskLayers(page_shape, cfg.disk_bytes,
                                        list(cfg.disk_paths or [cfg.disk_path]), num_layers,
                                        max_pages, codec, coded, namespace=namespace,
                                        summary_bytes=summary_bytes, threads=cfg.disk_threads)
        elif cfg.disk_bytes and recompute is not None:
            self.disk_tier, self.recompute = self._recomputing_disk(recompute, disk_args,
                                                                    disk_kw)
        elif cfg.disk_bytes and cfg.disk_paths:          # several folders: pages striped
            self.disk_tier = DiskSet(page_shape, cfg.disk_bytes, list(cfg.disk_paths),
                                     *disk_args[3:], **disk_kw)
        elif cfg.disk_bytes:
            self.disk_tier = DiskTier(*disk_args, **disk_kw)
        self._tiers = [t for t in (self.device_tier, self.host_tier, self.disk_tier)
                       if t is not None]
        self.backing = self._tiers[-1]
        self.residency = make_residency(cfg.residency, self.device_tier.capacity_pages,
                                        num_layers)
        host_slots = self.host_tier.capacity_pages if self.host_tier else 0
        self.host_residency = make_residency(cfg.residency, host_slots, num_layers)
        # host slots a pending fill reads from (never evicted until the fill is done)
        self.host_pinned = torch.zeros(host_slots, dtype=torch.bool)
        # device slots a pending fill writes into (never evicted until it has)
        self.device_pinned = torch.zeros(self.device_tier.capacity_pages, dtype=torch.bool)
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        # evicted device pages whose copy to their new host slot is still to be made:
        # (device slots, host slots), recorded by resolve, made by the fill after it
        # (Fetcher.demote)
        self.demotions: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self.demote_lock = threading.Lock()
        # True where the key's page is safely in the backing tier (evictable from faster tiers)
        self.clean = torch.zeros(max_keys, dtype=torch.bool)
        # in-flight backing writes per request: (future, keys, pages); pages stay alive
        # until the write is applied
        self._writes: dict[str, list[tuple[Future, torch.Tensor, torch.Tensor]]] = {}
        self._write_errors: dict[str, list[str]] = {}
        # writes of freed pages, per request: waited for before its file goes (`_then`) and
        # before the next step writes; they mark nothing clean
        self._retired: dict[str, list[Future]] = {}
        self._then: dict[str, list[Callable[[], None]]] = {}
        self._lost: set[int] = set()        # page ids lost since `take_lost`
        self.step_counter = 0
        self.clock_now = 0          # layer clock (`clock_of`) of the layer being computed

    def _recomputing_disk(self, plan: RecomputePlan, disk_args, disk_kw):
        """The disk tier with its sidecar of layer inputs (their share of the disk budget),
        and the Recompute that uses it."""
        shape, disk_bytes, path, max_keys, num_layers, max_pages = disk_args
        in_bytes = plan.input_bytes(disk_bytes)
        inputs = DiskTier(input_page_shape(shape.page_size, plan.hidden, shape.dtype), in_bytes,
                          inputs_path(path), max_keys, num_layers, max_pages,
                          threads=disk_kw["threads"], stride=plan.input_stride)
        disk = DiskWithInputs(shape, disk_bytes - in_bytes, *disk_args[2:], inputs=inputs,
                              **disk_kw)
        return disk, Recompute(plan, shape.page_size, self.device_tier.capacity_pages,
                               max_pages, inputs)

    def use_residency(self, name: str) -> None:
        """Swap both memory tiers' residency policy; their stamps carry over (benchmarks)."""
        for attr in ("residency", "host_residency"):
            old = getattr(self, attr)
            new = make_residency(name, 0, self.num_layers)
            stamps = old.last_used
            # `score`'s flag means nothing to the others (they would read a very new page)
            new.last_used = torch.where(stamps >= 0, stamps & ~WEAK_FLAG, stamps)
            setattr(self, attr, new)

    def __iter__(self):
        """The tiers, fastest first."""
        return iter(self._tiers)

    def disk_bytes_of(self, keys: torch.Tensor) -> int:
        """Bytes the pages of `keys` move to or from the disk tier (codes where coded)."""
        if self.disk_tier is None:
            return int(keys.numel()) * self.page_shape.nbytes
        return self.disk_tier.bytes_of(keys)

    def usage(self) -> dict[str, tuple[int, int]]:
        """tier -> (used bytes, capacity bytes)."""
        return {t.name: (t.used_bytes, t.capacity_bytes) for t in self._tiers}

    # ---------------------------------------------------------------- the device tier, read
    @property
    def pool(self) -> torch.Tensor:
        """The device pool attention reads: [slots, 2, KVH, page_size, D]."""
        return self.device_tier.pool

    @property
    def device_free(self) -> int:
        return self.device_tier.num_free

    @property
    def device_capacity(self) -> int:
        return self.device_tier.capacity_pages

    def device_slots(self, keys: torch.Tensor) -> torch.Tensor:
        """int32 device slot of each key (-1: not resident)."""
        return self.device_tier.slots(keys)

    def touch(self, slots: torch.Tensor, clocks: int | torch.Tensor,
              weak: torch.Tensor | None = None) -> None:
        """Device `slots` were used at layer clocks `clocks` (the residency policy's input);
        `weak`: those of them whose page the step before did not select."""
        self.residency.touch(slots, clocks)
        if weak is not None:
            self.residency.mark_weak(weak)

    def is_clean(self, keys: torch.Tensor) -> torch.Tensor:
        """bool per key: its page is safe in the backing tier."""
        return self.clean[keys]

    @property
    def host_is_cache(self) -> bool:
        """A host tier above a disk backing store (demotions go there)."""
        return self.host_tier is not None and self.backing is not self.host_tier

    # ---------------------------------------------------------------- keys and clocks
    def clock_of(self, keys: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """Layer clock of a use of `keys` in `step` (default: this one): step * layers + the
        key's layer, the order in which a step reads them (the tiers' recency stamps)."""
        step = self.step_counter if step is None else step
        return step * self.num_layers + keys // self.max_pages

    def keys_of(self, page_ids: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        """page_ids [n] -> keys [L * n] (layer-major) for every layer (or `layers`)."""
        layers = range(self.num_layers) if layers is None else layers
        ls = torch.tensor(list(layers), dtype=torch.int64)
        return (ls[:, None] * self.max_pages + page_ids[None, :]).reshape(-1)

    def begin_step(self) -> int:
        self.step_counter += 1
        return self.step_counter

    def at_layer(self, step: int, layer: int) -> int:
        """The layer being computed: returns its clock."""
        self.clock_now = step * self.num_layers + layer
        return self.clock_now

    # ---------------------------------------------------------------- pages leaving
    def drop(self, page_ids: list[int]) -> None:
        """Pages no request holds any more: gone from every tier (their ids may be reused)."""
        if not page_ids:
            return
        ids = torch.tensor(page_ids, dtype=torch.int64)
        keys = self.keys_of(ids)
        for tier in self._tiers:
            tier.delete(keys)
        if self.disk_tier is not None:
            self.disk_tier.unbind(ids)
        self.clean[keys] = False

    def drop_layers(self, drops) -> None:
        """[(page ids, layers)]: those layers of those pages leave every tier (a sliding
        window's pages nobody reads again: kvstore/window_trim.py; no backing writes, as the
        device tier is the backing store there)."""
        for page_ids, layers in drops:
            keys = self.keys_of(torch.tensor(page_ids, dtype=torch.int64), layers)
            for tier in self._tiers:
                tier.delete(keys)
            self.clean[keys] = False
            self.stats.add_window_dropped(keys.numel())

    def lost(self, keys: torch.Tensor, message: str) -> RequestKVError:
        """Map the keys of lost pages to the requests that hold them (the pages are kept for
        `take_lost`: nobody may reuse them, e.g. from the prefix cache)."""
        pages = set((torch.as_tensor(keys) % self.max_pages).tolist())
        self._lost |= pages
        return RequestKVError(self._owners(pages), message)

    def take_lost(self) -> list[int]:
        """The page ids lost (corrupt, unreadable) since the last call."""
        lost, self._lost = sorted(self._lost), set()
        return lost

    def staging(self, n: int, purpose: str) -> torch.Tensor:
        """A reused host buffer [n, 2, kvh, ps, hd] (grown on demand, never shrunk): fresh
        memory costs a page fault per 4 KB. One buffer per purpose (the prefix cache's
        "verify" reads) and per thread. (Copies to and from a device pool in GPU memory go
        through the copy stream's own buffers, kvstore/tiers/transfers.py.)"""
        key = (purpose, threading.get_ident())
        buf = self._staging.get(key)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, 256), *self.page_shape.shape, dtype=self.page_shape.dtype)
            self._staging[key] = buf
        return buf[:n]

    # ---------------------------------------------------------------- backing writes
    def track_write(self, request_id: str, fut: Future, keys: torch.Tensor,
                    pages: torch.Tensor) -> None:
        self._writes.setdefault(request_id, []).append((fut, keys, pages))

    def wait_writes(self, request_id: str | None = None) -> None:
        """Block until the backing writes of one request (or all) finish; errors are kept
        for `check_writes`."""
        rids = list(self._writes) if request_id is None else [request_id]
        for rid in rids:
            self._settle(rid, block=True)

    def retire_writes(self, request_id: str, then: Callable[[], None] | None = None) -> None:
        """The request's pages were freed: its writes in flight no longer mark anything clean
        (the ids may be reused at once) and are not waited for here; `then` (closing its
        file) runs once they are done (`reap`: at the latest when the next step begins)."""
        pending = [w[0] for w in self._writes.pop(request_id, []) if not w[0].done()]
        lost = self._write_errors.pop(request_id, None)
        if lost:        # a preempted request recomputes and writes its pages again
            logger.warning("KV writes of %s failed before its pages were freed: %s",
                           request_id, lost[0])
        if pending:
            self._retired.setdefault(request_id, []).extend(pending)
        if then is None:
            return
        if request_id in self._retired:
            self._then.setdefault(request_id, []).append(then)
        else:
            then()

    def reap(self, block: bool = False) -> None:
        """Forget retired writes that are done (all of them with `block`: wait) and run what
        waited for them."""
        for rid in list(self._retired):
            futs = self._retired[rid]
            if not block and not all(f.done() for f in futs):
                continue
            wait(futs)
            del self._retired[rid]
            for then in self._then.pop(rid, []):
                then()

    def _settle(self, request_id: str, block: bool) -> None:
        # NOTE: completions are applied here, on the engine thread, never in I/O callbacks:
        # a callback could mark a page clean after its id was freed
        pending = []
        for entry in self._writes.get(request_id, []):
            fut, keys = entry[0], entry[1]
            if not block and not fut.done():
                pending.append(entry)
                continue
            exc = fut.exception()
            if exc is None:
                self.clean[keys] = True
                self.stats.add_transfer("device", "disk", self.disk_bytes_of(keys))
            else:
                self._write_errors.setdefault(request_id, []).append(
                    f"KV write to disk failed: {exc}")
        if pending:
            self._writes[request_id] = pending
        else:
            self._writes.pop(request_id, None)

    def check_writes(self) -> list[tuple[str, str]]:
        """Apply finished backing writes; returns (request_id, error) for failed ones."""
        for rid in list(self._writes):
            self._settle(rid, block=False)
        self.reap()
        return self.take_write_errors()

    def failed_writes(self) -> list[tuple[str, str]]:
        """(request_id, first error) of the requests whose backing writes failed (kept for
        `check_writes`: a fetch ahead that meets them must not swallow them)."""
        return [(rid, errs[0]) for rid, errs in self._write_errors.items() if errs]

    def take_write_errors(self) -> list[tuple[str, str]]:
        """(request_id, first error) of the requests whose backing writes failed, once."""
        failed = [(rid, errs[0]) for rid, errs in self._write_errors.items() if errs]
        self._write_errors.clear()
        return failed

    def close(self) -> None:
        self.reap(block=True)
        if self.copies is not None:
            self.copies.close()
        if self.disk_tier is not None:
            self.disk_tier.close()
