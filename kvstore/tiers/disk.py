"""DiskTier: KV pages in per-request files (the backing store behind host and device).

Identity: key = layer * max_pages + page_id (base.py). The store tells the tier which request
owns a page id and where it sits in the request's page list (`bind`), so key -> (request file,
layer, index) -> byte offset (disk_layout.py: layer-major, one file per request, 4096-aligned
page extents). A request must `register_request` (reserving its whole budget up front, TierFull
if it does not fit) before its pages are bound; `release_request` deletes its file.

I/O (extent_io.py): a batch is sorted by (file, offset), coalesced into extents of adjacent
pages (one preadv/pwritev each), run on a thread pool, O_DIRECT when the filesystem allows it
(probed once; the fallback to buffered I/O is logged once). An XXH64 checksum per page,
verified on read.

Threading: every public method is called from one thread (the engine's step loop); only the
I/O runs elsewhere. A key is present (`contains`) once its write completed; `put` of a key
hides it until the new write completes. Do not `get` keys whose `put_async` is in flight.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvstore.tiers.base import PageShape, Tier
from kvstore.tiers.disk_fault import DiskFault
from kvstore.tiers.direct_io import probe_direct_io
from kvstore.tiers.disk_layout import DiskLayout
from kvstore.tiers.errors import PageMissing, TierFull
from kvstore.tiers.extent_io import ExtentIO, ExtentJob, plan_extents

logger = logging.getLogger(__name__)


@dataclass
class _RequestFile:
    handle: int
    fd: int
    path: Path
    nbytes: int                       # reserved bytes (counted in used_bytes)
    pending: int = 0                  # batches in flight touching this file (guarded by _cond)
    pids: list = field(default_factory=list)  # np.int64 arrays of page ids bound to it


class DiskTier(Tier):
    name = "disk"

    def __init__(self, page_shape: PageShape, capacity_bytes: int, path: str | Path,
                 max_keys: int, num_layers: int, max_pages: int, threads: int = 8,
                 fault: DiskFault | None = None, max_extent_bytes: int = 1 << 20,
                 read_gap_pages: int = 3):
        if max_keys != num_layers * max_pages:
            raise ValueError(f"disk tier: max_keys ({max_keys}) must equal num_layers * "
                             f"max_pages ({num_layers} * {max_pages})")
        self.page_shape = page_shape
        self.max_keys, self.max_pages = int(max_keys), int(max_pages)
        self.layout = DiskLayout(path, page_shape, num_layers)
        self.layout.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = self.layout.lock()          # held while the process lives
        self._capacity_bytes = int(capacity_bytes)
        free = shutil.disk_usage(self.layout.root).free
        if free < self._capacity_bytes:
            logger.warning("disk tier: --kv-disk-gb asks for %.2f GB but %s has %.2f GB free: "
                           "requests that spill past the free space will fail (disk full)",
                           self._capacity_bytes / 1e9, self.layout.root, free / 1e9)
        self.fault = fault
        # NOTE: a read extent may span up to this many absent pages (read and dropped): one
        # syscall costs 10-30 us of CPU, about what reading 3 extra 12 KB pages costs
        self.read_gap_pages = int(read_gap_pages)
        self.layout.clear_stale_files()
        self.direct_io = probe_direct_io(self.layout.root, fault)
        self._stored = np.zeros(self.max_keys, dtype=bool)      # [max_keys] write completed
        self._crc = np.zeros(self.max_keys, dtype=np.uint64)    # [max_keys] XXH64 of page
        self._page_req = np.full(self.max_pages, -1, np.int64)  # [max_pages] request slot
        self._page_index = np.zeros(self.max_pages, np.int64)   # [max_pages] index in request
        self._io = ExtentIO(page_shape, self.direct_io, threads, self._crc, self._stored,
                            max_extent_bytes)
        self._handles: dict[int, int] = {}                      # handle -> request slot
        self._reqs: list[_RequestFile | None] = []
        self._req = np.zeros((0, 3), np.int64)  # [slots, (pages per layer, fd, handle)]
        self._cond = threading.Condition()
        self._reserved = 0

    # -- sizes and counters -----------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by registered requests (the budget, not what is written)."""
        return self._reserved

    @property
    def capacity_pages(self) -> int:
        return self._capacity_bytes // self.layout.stride

    @property
    def num_pages(self) -> int:
        return int(np.count_nonzero(self._stored))

    @property
    def stored_bytes(self) -> int:
        """Bytes of pages actually written and present now."""
        return self.num_pages * self.layout.stride

    preadv_calls = property(lambda self: self._io.preadv_calls)
    pwritev_calls = property(lambda self: self._io.pwritev_calls)
    bytes_read = property(lambda self: self._io.bytes_read)        # cumulative
    bytes_written = property(lambda self: self._io.bytes_written)  # cumulative

    # -- requests ---------------------------------------------------------------------------

    def register_request(self, request_handle: int, capacity_pages_per_layer: int) -> None:
        """Create the request's file and reserve capacity_pages_per_layer * num_layers pages.
        Raises TierFull when the reservation exceeds the free budget (`needed_bytes` >
        `capacity_bytes` means the request can never fit)."""
        handle, cap = int(request_handle), int(capacity_pages_per_layer)
        if handle in self._handles:
            raise ValueError(f"disk tier: request {handle} is already registered")
        if cap <= 0:
            raise ValueError(f"disk tier: capacity_pages_per_layer must be > 0, got {cap}")
        need = self.layout.file_bytes(cap)
        free = self._capacity_bytes - self._reserved
        if need > free:
            hint = ("the request can never fit: raise --kv-disk-gb"
                    if need > self._capacity_bytes else "retry when requests finish")
            raise TierFull(self.name, [], need, free, hint=hint)
        path = self.layout.file_path(handle)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = os.open(path, flags | (os.O_DIRECT if self.direct_io else 0), 0o600)
        slot = self._reqs.index(None) if None in self._reqs else len(self._reqs)
        if slot == len(self._reqs):
            self._reqs.append(None)
            self._req = np.concatenate([self._req, np.zeros((1, 3), np.int64)])
        self._reqs[slot] = _RequestFile(handle, fd, path, need)
        self._req[slot] = (cap, fd, handle)
        self._handles[handle] = slot
        self._reserved += need

    def bind(self, page_ids, request_handle: int, first_index: int) -> None:
        """Page ids [n] (int tensor or list; shared by all layers) now belong to the request,
        at indices first_index .. first_index + n - 1 of its page list. Their keys in every
        layer become absent (a reused page id holds nothing yet)."""
        slot = self._handles.get(int(request_handle))
        if slot is None:
            raise ValueError(f"disk tier: request {request_handle} is not registered")
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        n, cap = pids.shape[0], int(self._req[slot, 0])
        if first_index < 0 or first_index + n > cap:
            raise ValueError(f"disk tier: indices [{first_index}, {first_index + n}) outside "
                             f"request {request_handle}'s {cap} pages per layer")
        if n and (pids.min() < 0 or pids.max() >= self.max_pages):
            raise ValueError(f"disk tier: page ids outside [0, {self.max_pages})")
        self._page_req[pids] = slot
        self._page_index[pids] = first_index + np.arange(n)
        self._stored.reshape(-1, self.max_pages)[:, pids] = False
        self._reqs[slot].pids.append(pids)

    def release_request(self, request_handle: int) -> None:
        """Wait for the request's in-flight I/O, forget its pages, close and delete its file,
        free its budget. Unknown handles are ignored (idempotent)."""
        slot = self._handles.pop(int(request_handle), None)
        if slot is None:
            return
        req = self._reqs[slot]
        with self._cond:
            self._cond.wait_for(lambda: req.pending == 0)
        for pids in req.pids:
            mine = pids[self._page_req[pids] == slot]
            self._page_req[mine] = -1
            self._stored.reshape(-1, self.max_pages)[:, mine] = False
        os.close(req.fd)
        req.path.unlink(missing_ok=True)
        self._reqs[slot] = None
        self._reserved -= req.nbytes

    def close(self) -> None:
        for handle in list(self._handles):
            self.release_request(handle)
        self._io.close()
        if self._lock_fd is not None:          # the path is free for another server
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- Tier interface ---------------------------------------------------------------------

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self._stored[self._keys(keys)].copy())

    def keys(self) -> torch.Tensor:
        return torch.from_numpy(np.flatnonzero(self._stored).astype(np.int64))

    def delete(self, keys: torch.Tensor) -> None:
        """Forget the pages (their space stays reserved by their request)."""
        self._stored[self._keys(keys)] = False

    def put(self, keys: torch.Tensor, pages: torch.Tensor) -> None:
        """Write pages [n, 2, kvh, ps, hd]. Keys must be bound (`bind`), else PageMissing.
        Raises TierIOError on an OSError (e.g. ENOSPC); failed keys are then absent."""
        self.put_async(keys, pages).result()

    def get(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        """Read into out [n, 2, kvh, ps, hd]. Raises PageMissing (before any I/O),
        PageCorrupted (checksum mismatch) or TierIOError (OSError, short read)."""
        self.get_async(keys, out).result()

    def put_async(self, keys: torch.Tensor, pages: torch.Tensor) -> Future:
        """Start writing; the Future resolves (or raises TierIOError) when all pages are on
        disk. The caller must keep `pages` unchanged until then (CPU contiguous pages are
        written from in place)."""
        k = self._keys(keys)
        self._check_pages(pages, k.shape[0], "pages")
        src = pages.detach().to("cpu").contiguous()
        return self._submit("write", k, self._rows_of(src), np.arange(k.shape[0]), src)

    def get_async(self, keys: torch.Tensor, out: torch.Tensor) -> Future:
        """Start reading into out; PageMissing is raised here, I/O errors by the Future.
        `out` must not be read or freed before the Future resolves."""
        k = self._keys(keys)
        self._check_pages(out, k.shape[0], "out")
        if out.device.type == "cpu" and out.is_contiguous():
            return self._submit("read", k, self._rows_of(out), np.arange(k.shape[0]), out)
        tmp = torch.empty(out.shape, dtype=out.dtype, pin_memory=torch.cuda.is_available())
        inner = self._submit("read", k, self._rows_of(tmp), np.arange(k.shape[0]), tmp)
        outer: Future = Future()

        def finish(f: Future) -> None:
            if f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                out.copy_(tmp)
                outer.set_result(None)
        inner.add_done_callback(finish)
        return outer

    def get_into(self, keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> Future:
        """Read page i into pool[slots[i]] in place (pool: a CPU slot pool such as
        HostTier.pool; O_DIRECT lands straight in its 4096-aligned slots)."""
        k = self._keys(keys)
        return self._submit("read", k, self._rows_of(pool), self._slot_rows(pool, slots, k), pool)

    def put_from(self, keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> Future:
        """Write page i from pool[slots[i]] (a CPU pool is written from in place)."""
        k = self._keys(keys)
        rows = self._slot_rows(pool, slots, k)
        if pool.device.type != "cpu":
            return self.put_async(keys, pool[torch.as_tensor(rows, device=pool.device)])
        return self._submit("write", k, self._rows_of(pool), rows, pool)

    # -- internals --------------------------------------------------------------------------

    def _keys(self, keys) -> np.ndarray:
        return self._check_keys(keys, self.max_keys).numpy()

    def _rows_of(self, pages: torch.Tensor) -> np.ndarray:
        """uint8 [rows, nbytes] numpy view sharing memory with pages [rows, 2, kvh, ps, hd]."""
        if pages.device.type != "cpu" or not pages.is_contiguous():
            raise ValueError("disk tier: page buffers must be contiguous CPU tensors")
        if tuple(pages.shape[1:]) != self.page_shape.shape or pages.dtype != self.page_shape.dtype:
            raise ValueError(f"disk tier: pool must be {self.page_shape.dtype} "
                             f"[slots, {self.page_shape.shape}], got {tuple(pages.shape)}")
        return pages.reshape(pages.shape[0], self.page_shape.numel).view(torch.uint8).numpy()

    def _slot_rows(self, pool: torch.Tensor, slots: torch.Tensor, keys: np.ndarray) -> np.ndarray:
        rows = np.asarray(torch.as_tensor(slots).to("cpu", torch.int64))
        if rows.shape != keys.shape or (rows.size and (rows.min() < 0 or
                                                       rows.max() >= pool.shape[0])):
            raise ValueError(f"disk tier: slots must be [{keys.shape[0]}] in [0, "
                             f"{pool.shape[0]})")
        return rows

    def _submit(self, op: str, keys: np.ndarray, buf: np.ndarray, rows: np.ndarray,
                keep_alive: torch.Tensor) -> Future:
        pids = keys % self.max_pages
        slot = self._page_req[pids]
        absent = slot < 0 if op == "write" else (slot < 0) | ~self._stored[keys]
        if absent.any():
            why = "pages not bound to a registered request (call bind first)" \
                if op == "write" else "pages not stored"
            raise PageMissing(self.name, keys[absent], why)
        pn = self.layout.page_numbers(keys // self.max_pages, self._page_index[pids],
                                      self._req[slot, 0])
        gap = self.read_gap_pages if op == "read" else 0
        order, starts, ends = plan_extents(slot, pn, self._io.max_pages, max_gap=gap)
        if op == "write":
            sk = (slot[order] << 40) | pn[order]
            if (sk[1:] == sk[:-1]).any():
                raise ValueError("disk tier: a key repeats in one put batch")
        first = order[starts]
        job = ExtentJob(op, buf, rows[order], keys[order], self._req[slot[first], 1],
                        self._req[slot[first], 2], self.layout.offsets(pn[first]),
                        starts, ends, self.fault, keep_alive,
                        pn[order] if gap else None)
        busy = np.unique(slot)
        with self._cond:
            for s in busy:
                self._reqs[s].pending += 1
        if op == "write":
            self._stored[keys] = False
        future = self._io.submit(job)
        future.add_done_callback(lambda _: self._settle(busy))
        return future

    def _settle(self, busy: np.ndarray) -> None:
        with self._cond:
            for s in busy:
                self._reqs[s].pending -= 1
            self._cond.notify_all()
