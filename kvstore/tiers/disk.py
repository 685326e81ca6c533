"""DiskTier: KV pages in per-request files (the backing store behind host and device).

Identity: key = layer * max_pages + page_id (base.py). The store tells the tier which request
owns a page id and where it sits in the request's page list (`bind`), so key -> (request file,
layer, index) -> byte offset (disk_layout.py: layer-major, one file per request, 4096-aligned
page extents). A request must `register_request` (reserving its budget up front, TierFull if
it does not fit) before its pages are bound. Its file (a segment, segments.py) outlives it
while pages bound to it live (`unbind` lets them go): the prefix cache keeps pages, and
records them in the segment's index log (`record`), so a restarted server finds them again
(`restore`: disk_restore.py).

Codec (codec.py): pages stored as 8-/4-bit codes at their own size, coded on the I/O thread;
the scales stay in memory (`_meta`, beside `_crc`) and travel in the index records.

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
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from kvstore.tiers.base import ALIGN, PageShape, Tier
from kvstore.tiers.codec import PageCodec
from kvstore.tiers.disk_fault import DiskFault
from kvstore.tiers.direct_io import probe_direct_io
from kvstore.tiers.disk_layout import DiskLayout
from kvstore.tiers.disk_restore import RestoredPages, restore_segments
from kvstore.tiers.errors import PageMissing, TierFull
from kvstore.tiers.extent_io import ExtentIO, ExtentJob, plan_extents
from kvstore.tiers.segments import Segments
from kvstore.tiers.staging import StagingBuffers, read_via_buffer

logger = logging.getLogger(__name__)


class DiskTier(Tier):
    name = "disk"

    def __init__(self, page_shape: PageShape, capacity_bytes: int, path: str | Path,
                 max_keys: int, num_layers: int, max_pages: int, threads: int = 8,
                 fault: DiskFault | None = None, max_extent_bytes: int = 1 << 20,
                 read_gap_pages: int = 3, namespace: bytes = b"", summary_bytes: int = 0,
                 codec: PageCodec | None = None, stride: int | None = None):
        """namespace: the prefix cache's (segment logs of another one are left alone);
        summary_bytes: bytes of one page's summaries in a record; codec: store pages as
        8- or 4-bit codes (None: as they are); stride: bytes between pages on disk, a
        multiple of 512 (default: the codec's, else the page rounded up to 4096)."""
        if max_keys != num_layers * max_pages:
            raise ValueError(f"disk tier: max_keys ({max_keys}) must equal num_layers * "
                             f"max_pages ({num_layers} * {max_pages})")
        self.page_shape = page_shape
        self.max_keys, self.max_pages = int(max_keys), int(max_pages)
        self.codec = codec
        self.layout = DiskLayout(path, page_shape, num_layers,
                                 stride or (codec.stride if codec is not None else None))
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
        # NOTE: a stride that is no multiple of 4096 needs sector-aligned O_DIRECT (512)
        self.direct_io = probe_direct_io(self.layout.root, fault,
                                         ALIGN if self.layout.stride % ALIGN == 0 else 512)
        self._stored = np.zeros(self.max_keys, dtype=bool)      # [max_keys] write completed
        self._crc = np.zeros(self.max_keys, dtype=np.uint64)    # [max_keys] XXH64 of page
        # [max_keys, meta values] float16: the codec's scales (memory is committed as keys are
        # written: calloc'd pages)
        self._meta = np.zeros((self.max_keys, codec.meta_values) if codec else (0, 0),
                              dtype=np.float16)
        stored = codec.code_bytes if codec is not None else page_shape.nbytes
        self._io = ExtentIO(stored, self.layout.stride, self.direct_io, threads, self._crc,
                            self._stored, max_extent_bytes)
        self._staging = StagingBuffers()
        self.segments = Segments(self.layout, self.max_pages, self._stored, self.direct_io,
                                 namespace, summary_bytes, fault_of=lambda: self.fault,
                                 meta_bytes=num_layers * (codec.meta_bytes if codec else 0))

    # -- sizes and counters -----------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by requests and kept by cached pages (the budget, not what is
        written)."""
        return self.segments.reserved

    @property
    def capacity_pages(self) -> int:
        return self._capacity_bytes // self.layout.stride

    @property
    def num_pages(self) -> int:
        return int(np.count_nonzero(self._stored))

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes on disk (what reading or writing it moves)."""
        return self.layout.stride

    def bytes_of(self, keys: torch.Tensor) -> int:
        """Bytes the pages of `keys` take on disk."""
        return int(torch.as_tensor(keys).numel()) * self.layout.stride

    @property
    def stored_bytes(self) -> int:
        """Bytes of pages actually written and present now."""
        return self.num_pages * self.layout.stride

    def per_path(self) -> dict[str, dict[str, int]]:
        """Bytes the drive read and wrote so far (gap pages of reads too), by folder."""
        return {str(self.layout.root): {"bytes_read": self.bytes_read,
                                        "bytes_written": self.bytes_written,
                                        "reads": self.preadv_calls}}

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
        if handle in self.segments:
            raise ValueError(f"disk tier: request {handle} is already registered")
        if cap <= 0:
            raise ValueError(f"disk tier: capacity_pages_per_layer must be > 0, got {cap}")
        need = self.layout.file_bytes(cap)
        free = self._capacity_bytes - self.used_bytes
        if need > free:
            hint = ("the request can never fit: raise --kv-disk-gb"
                    if need > self._capacity_bytes else "retry when requests finish")
            raise TierFull(self.name, [], need, free, hint=hint)
        self.segments.create(handle, cap)

    def skip(self, request_handle: int, n: int) -> None:
        """The request's first n pages are shared (another file holds them): its own
        reservation shrinks by them."""
        self.segments.skip(request_handle, n)

    def bind(self, page_ids, request_handle: int, first_index: int) -> None:
        """Page ids [n] (int tensor or list; shared by all layers) now belong to the request,
        at indices first_index .. first_index + n - 1 of its page list. Their keys in every
        layer become absent (a reused page id holds nothing yet)."""
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        self.segments.bind(pids, int(request_handle), int(first_index))

    def occupants(self, request_handle: int, first_index: int, n: int) -> list[int]:
        """Live page ids at indices [first_index, first_index + n) of the request's file
        (pages of an earlier run of the request that the prefix cache kept)."""
        return self.segments.occupants(request_handle, first_index, n)

    def page_indices(self, page_ids: np.ndarray) -> np.ndarray:
        """int64 [n]: each bound page's index in its request's page list (its position / page
        size: a shared page sits at the same index in every request that holds it)."""
        return self.segments.page_index[page_ids]

    def unbind(self, page_ids) -> None:
        """Pages nobody holds any more: absent, and gone from their file."""
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        self.segments.unbind(pids)

    def release_request(self, request_handle: int) -> None:
        """Wait for the request's in-flight I/O; its file keeps only the pages still bound
        (deleted when there are none). Unknown handles are ignored (idempotent)."""
        self.segments.release(request_handle)

    def record(self, page_ids, keys: list[bytes], summaries: list[bytes | None]) -> np.ndarray:
        """Index cached pages whose bytes are on disk in every layer (they survive a
        restart). Returns bool [n]: recorded (best effort: a failed index write is logged)."""
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        at = self._layer_keys(pids)
        meta = None if self.codec is None else [m.tobytes() for m in self._meta[at]]
        return self.segments.record(pids, keys, self._crc[at], summaries, meta)

    def restore(self) -> list[RestoredPages]:
        """Segments a previous server left with indexed pages of this namespace: opened, with
        their pages to be taken (`adopt`). Files of other namespaces are left alone; request
        files without an index (a crash mid-request) are removed (disk_restore.py)."""
        return restore_segments(self.layout, self.segments)

    def adopt(self, handle: int, page_ids, indices: np.ndarray, crcs: np.ndarray,
              meta: list[bytes | None] | None = None) -> None:
        """Restored pages of segment `handle` take these page ids: present in every layer,
        checked against their recorded checksums when read (meta: their codec scales)."""
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        self.segments.bind_restored(handle, pids, indices)
        keys = self._layer_keys(pids)
        self._crc[keys] = crcs
        if self.codec is not None:
            self._meta[keys] = np.frombuffer(b"".join(meta), dtype=np.float16).reshape(
                *keys.shape, self.codec.meta_values)
        self._stored[keys] = True

    def finish_restore(self) -> None:
        """Restored pages not adopted (over the budget, or dropped) leave their files."""
        self.segments.finish_restore()

    @property
    def next_handle(self) -> int:
        """A handle no file under the path uses (handles must not collide across restarts)."""
        return self.layout.next_handle()

    def close(self) -> None:
        for handle in self.segments.handles():
            self.segments.release(handle)
        self.segments.close()
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
        return read_via_buffer(out, lambda tmp: self._submit(
            "read", k, self._rows_of(tmp), np.arange(k.shape[0]), tmp))

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

    def _layer_keys(self, pids: np.ndarray) -> np.ndarray:
        """int64 [n, layers]: the keys of page ids [n] in every layer."""
        return np.arange(self.layout.num_layers)[None, :] * self.max_pages + pids[:, None]

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
        """Run op over the pages buf[rows[i]] of keys[i]; with a codec the I/O goes through
        a staging buffer of codes, and the pages are encoded or decoded on the I/O thread."""
        segs = self.segments
        pids = keys % self.max_pages
        slot = segs.page_slot[pids]
        absent = slot < 0 if op == "write" else (slot < 0) | ~self._stored[keys]
        if absent.any():
            why = "pages not bound to a registered request (call bind first)" \
                if op == "write" else "pages not stored"
            raise PageMissing(self.name, keys[absent], why)
        pn = self.layout.page_numbers(keys // self.max_pages, segs.page_index[pids],
                                      segs.table[slot, 0])
        gap = self.read_gap_pages if op == "read" else 0
        order, starts, ends = plan_extents(slot, pn, self._io.max_pages, max_gap=gap)
        if op == "write":
            sk = (slot[order] << 40) | pn[order]
            if (sk[1:] == sk[:-1]).any():
                raise ValueError("disk tier: a key repeats in one put batch")
        first = order[starts]
        rows, transform, whole = rows[order], None, None           # job order from here
        if self.codec is not None:      # the I/O moves codes through a staging buffer
            whole = self._staging.take(keys.shape[0] * self.codec.code_bytes)
            transform, buf = self.codec.io_transform(op, whole, keys[order], buf, rows,
                                                     self._meta)
            rows, keep_alive = np.arange(keys.shape[0]), (keep_alive, buf)
        busy = np.unique(slot)
        segs.begin_io(busy)                 # descriptors of released files open until end_io
        try:
            job = ExtentJob(op, buf, rows, keys[order],
                            segs.table[slot[first], 1], segs.table[slot[first], 2],
                            self.layout.offsets(pn[first]), starts, ends, self.fault,
                            keep_alive, pn[order] if gap else None, transform)
            if op == "write":
                self._stored[keys] = False
            future = self._io.submit(job)
        except BaseException:
            segs.end_io(busy)
            if whole is not None:
                self._staging.give(whole)
            raise

        def done(_: Future) -> None:
            segs.end_io(busy)
            if whole is not None:
                self._staging.give(whole)
        future.add_done_callback(done)
        return future
