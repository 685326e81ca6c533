"""ExtentIO: coalesced, checksummed, thread-pooled page I/O for the disk tier.

A batch of pages becomes *extents*: runs of pages adjacent in one file (sorted by file and
offset, capped at `max_extent_bytes` and IOV_MAX). Each extent is ONE `os.preadv`/`os.pwritev`:
- straight into/out of the page buffers (scatter/gather iovecs) when the buffers allow it
  (buffered I/O, or O_DIRECT with 4096-aligned page buffers whose size is a multiple of 4096);
- otherwise through a per-thread 4096-aligned staging buffer plus a copy.
Extents are split into one task per thread; reads go to one task instead when io_uring works
here (`ring_depth`): one thread then keeps up to that many extents in flight at a few us of
CPU each, where 8 threads blocked in preadv cost ~9-14 us of CPU per request on this 2-core box
(measured with 12 KB O_DIRECT random reads: the same ~45-50K requests/s either way), CPU the
engine thread computing beside the I/O wants. A task's extents go to the C extension
`kvstore.tiers._pageio` as arrays (addresses and lengths of every iovec, built with numpy): one
call reads or writes them all and one call hashes every page, both without the GIL. Per-extent
Python (iovec lists, os.preadv, a hash call per page) held the GIL ~20-30 us per extent, ~200
ms per decode step at the thousands of extents a sparse step reads, which the engine thread
selecting and computing beside the I/O waited for.

A job may carry a `transform` (the disk tier's codec, codec.py): run on the I/O thread over the
task's pages, before the checksums and the write (it fills the buffer rows being written) or
after the read and its checksums (it turns the rows read into the pages wanted).

Checksums: XXH64 of each page's bytes (in C, ~10 GB/s here), recorded at write in `crc[key]`
(uint64 [max_keys]) and verified at read.
`stored[key]` (bool [max_keys]) is set once a page's write has completed.
Errors are collected per extent and raised once per batch through the batch's Future:
`TierIOError` (OSError or short transfer) takes precedence over `PageCorrupted`.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.tiers import _pageio
from kvstore.tiers.base import ALIGN
from kvstore.tiers.disk_fault import DiskFault
from kvstore.tiers.errors import PageCorrupted, TierIOError

logger = logging.getLogger(__name__)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
RING_DEPTH = 64        # extents in flight per io_uring read task


def page_hashes(buf: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """XXH64 of each row `rows` of buf (uint8 [rows, nbytes], rows contiguous): uint64 [n]."""
    out = np.empty(len(rows), dtype=np.uint64)
    _pageio.hash_pages(_row_addrs(buf, rows), buf.shape[1], out)
    return out


def _row_addrs(buf: np.ndarray, rows: np.ndarray) -> np.ndarray:
    if buf.strides[1] != 1:
        raise ValueError("page buffers must have contiguous rows")
    return (np.uint64(buf.ctypes.data)
            + np.asarray(rows, dtype=np.uint64) * np.uint64(buf.strides[0]))


def plan_extents(file_ids: np.ndarray, page_numbers: np.ndarray, max_pages: int,
                 max_gap: int = 0):
    """Group pages into extents of nearby pages.

    file_ids, page_numbers: int64 [n] (page_numbers < 2**40).
    Returns (order int64 [n], starts int64 [e], ends int64 [e]): extent i covers the pages
    `order[starts[i]:ends[i]]`, ascending page numbers of one file spanning at most
    `max_pages` page positions, with at most `max_gap` absent pages between two neighbours
    (reads only: the gap pages are read and dropped, trading bytes for fewer syscalls; a write
    must never span a gap). A repeated page starts a new extent.
    """
    n = file_ids.shape[0]
    sort_key = (file_ids << 40) | page_numbers
    order = np.argsort(sort_key, kind="stable")
    sk = sort_key[order]
    brk = np.ones(n, dtype=bool)
    step = sk[1:] - sk[:-1]
    brk[1:] = (step < 1) | (step > 1 + max_gap)
    run_start = np.flatnonzero(brk)
    span = sk - sk[run_start[np.cumsum(brk) - 1]]           # position within the run
    chunk = span // max_pages
    brk[1:] |= chunk[1:] != chunk[:-1]
    starts = np.flatnonzero(brk)
    return order, starts, np.append(starts[1:], n)[:len(starts)]


@dataclass(frozen=True)
class ExtentJob:
    """One batch, in extent order. Arrays are never mutated after construction.

    buf:  uint8 [rows, nbytes] page buffers (destination of reads, source of writes)
    rows: int64 [n] row of `buf` of each page; keys: int64 [n] key of each page
    fds, handles, offsets, starts, ends: int64 [e] per extent (pages keys[starts:ends])
    """

    op: str
    buf: np.ndarray
    rows: np.ndarray
    keys: np.ndarray
    fds: np.ndarray
    handles: np.ndarray
    offsets: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    fault: DiskFault | None
    keep_alive: object = None  # NOTE: the tensor behind `buf`, held until the job completes
    pns: np.ndarray | None = None  # page numbers in order (reads with gaps: where pages land)
    # pages [s0, s1) (job order) of a task: called before a write, after a read is checked
    transform: Callable[[int, int], None] | None = None


@dataclass(frozen=True)
class _Vectors:
    """A job's iovecs for _pageio, built once per batch (numpy ops hold the GIL: once per
    batch, not once per thread). Per extent i: iovecs iov_ptr[i]:iov_ptr[i+1] of base/length,
    want[i] bytes; per page (job order): its row's address, and its hash once read/written.
    Each task writes only its own extents' fds/got and its own pages' hashes."""
    addrs: np.ndarray      # uint64 [n]
    iov_ptr: np.ndarray    # int64 [e + 1]
    base: np.ndarray       # uint64 [iovecs]
    length: np.ndarray     # int64 [iovecs]
    want: np.ndarray       # int64 [e]
    fds: np.ndarray        # int64 [e] (-1 where a fault is injected)
    offsets: np.ndarray    # int64 [e]
    got: np.ndarray        # int64 [e] bytes moved, or -errno
    hashes: np.ndarray     # uint64 [n]


class _Batch:
    """Collects per-task results; resolves `future` when the last task finishes."""

    def __init__(self, tasks: int):
        self.future: Future = Future()
        self._left = tasks
        self._lock = threading.Lock()
        self.io_errors: list[tuple[np.ndarray, int | None, str]] = []
        self.corrupt: list[np.ndarray] = []
        self.bug: BaseException | None = None

    def task_done(self, io_errors, corrupt, bug: BaseException | None = None) -> None:
        with self._lock:
            self.io_errors += io_errors
            self.corrupt += corrupt
            self.bug = self.bug or bug
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        if self.bug is not None:
            self.future.set_exception(self.bug)
        elif self.io_errors:
            keys = np.concatenate([k for k, _, _ in self.io_errors])
            _, code, msg = self.io_errors[0]
            if code == errno.ENOSPC:
                msg = f"disk full: {msg}"
                logger.error("disk tier: %s (%d pages not written)", msg, len(keys))
            self.future.set_exception(TierIOError("disk", keys, code, msg))
        elif self.corrupt:
            self.future.set_exception(PageCorrupted("disk", np.concatenate(self.corrupt)))
        else:
            self.future.set_result(None)


class ExtentIO:
    def __init__(self, nbytes: int, stride: int, direct_io: bool, threads: int,
                 crc: np.ndarray, stored: np.ndarray, max_extent_bytes: int = 1 << 20,
                 ring_depth: int = RING_DEPTH):
        """nbytes: the bytes of a page as stored; stride: its extent on disk (nbytes rounded
        up to the O_DIRECT alignment; the pad is zeros)."""
        self.nbytes = nbytes
        self.stride = stride
        self.direct_io = direct_io
        self.threads = max(1, threads)
        self.max_pages = max(1, min(max_extent_bytes // self.stride, _IOV_MAX // 2))
        self._crc, self._stored = crc, stored
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kv-disk")
        # NOTE: asked on an I/O thread, which sets up its ring (0: no io_uring here)
        self.ring_depth = ring_depth if ring_depth > 0 and \
            self._pool.submit(_pageio.ring_available).result() else 0
        self._local = threading.local()
        # zeros written after each page whose size is not a multiple of 4096 (buffered I/O)
        self._pad_zero_buf = np.zeros(max(1, self.stride - self.nbytes), dtype=np.uint8)
        # gap pages of reads land here (and are dropped), as do the pads of reads whose page
        # size is not a multiple of 4096 (anonymous mmap: 4096-aligned, as O_DIRECT needs)
        self._junk = np.frombuffer(mmap.mmap(-1, self.stride), dtype=np.uint8)
        self._lock = threading.Lock()
        self.preadv_calls = self.pwritev_calls = 0
        self.bytes_read = self.bytes_written = 0

    def direct_ok(self, buf: np.ndarray) -> bool:
        """Can extents use `buf`'s page rows as iovecs (no staging copy)?"""
        if not self.direct_io:
            return True
        return self.nbytes == self.stride and buf.ctypes.data % ALIGN == 0

    def submit(self, job: ExtentJob) -> Future:
        """Run the job's extents on the thread pool; the Future resolves when all are done."""
        e = job.starts.shape[0]
        if e == 0:
            f: Future = Future()
            f.set_result(None)
            return f
        pages = np.cumsum(job.ends - job.starts)
        vec = self._vectors(job) if self.direct_ok(job.buf) else None
        ring = self.ring_depth if job.op == "read" and vec is not None else 0
        tasks = 1 if ring else min(self.threads, e)
        cuts = np.searchsorted(pages, pages[-1] * np.arange(1, tasks) / tasks, side="right")
        bounds = np.unique(np.concatenate([[0], cuts, [e]]))
        batch = _Batch(len(bounds) - 1)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            self._pool.submit(self._task, job, vec, int(lo), int(hi), batch, ring)
        return batch.future

    def _vectors(self, job: ExtentJob) -> _Vectors:
        """Every extent's iovecs straight into/out of the page rows: a wanted page is one iovec
        (plus its pad when the page size is not a multiple of 4096), a gap page (reads) one
        iovec into the junk page."""
        n = job.keys.shape[0]
        gap = np.zeros(n, dtype=np.int64)
        if job.pns is not None:
            gap[1:] = job.pns[1:] - job.pns[:-1] - 1
            gap[job.starts] = 0
        pad = self.stride - self.nbytes
        first = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(gap + 1 + (pad > 0), out=first[1:])
        base = np.full(int(first[-1]), self._junk.ctypes.data, dtype=np.uint64)
        length = np.full(int(first[-1]), self.stride, dtype=np.int64)
        at = first[:-1] + gap
        addrs = _row_addrs(job.buf, job.rows)
        base[at], length[at] = addrs, self.nbytes
        if pad:
            base[at + 1] = (self._pad_zero_buf if job.op == "write" else self._junk).ctypes.data
            length[at + 1] = pad
        span = job.ends - job.starts + np.add.reduceat(gap, job.starts)
        e = job.starts.shape[0]
        return _Vectors(addrs, first[np.append(job.starts, n)], base, length,
                        span * self.stride, job.fds.astype(np.int64),
                        job.offsets.astype(np.int64), np.empty(e, dtype=np.int64),
                        np.empty(n, dtype=np.uint64))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- worker side ------------------------------------------------------------------------

    def _task(self, job: ExtentJob, vec: _Vectors | None, lo: int, hi: int,
              batch: _Batch, ring: int = 0) -> None:
        io_errors, corrupt, nbytes, bug = [], [], 0, None
        pages = (int(job.starts[lo]), int(job.ends[hi - 1]))
        try:
            if job.transform is not None and job.op == "write":
                job.transform(*pages)
            if vec is not None:
                io_errors, corrupt, nbytes = self._vector_io(job, vec, lo, hi, ring)
            else:
                io_errors, corrupt, nbytes = self._staged_io(job, lo, hi)
            if job.transform is not None and job.op == "read":
                job.transform(*pages)
        except Exception as err:  # NOTE: a bug must fail the batch, not hang its waiters
            bug = err
        with self._lock:
            if job.op == "read":
                self.preadv_calls += hi - lo
                self.bytes_read += nbytes
            else:
                self.pwritev_calls += hi - lo
                self.bytes_written += nbytes
        batch.task_done(io_errors, corrupt, bug)

    def _vector_io(self, job: ExtentJob, vec: _Vectors, lo: int, hi: int, ring: int = 0):
        """Extents lo..hi-1: one _pageio call for the I/O (through io_uring, `ring` in flight,
        when ring > 0) and one for the checksums, without the GIL. Returns (io errors, corrupt
        keys, bytes moved)."""
        s0, s1 = int(job.starts[lo]), int(job.ends[hi - 1])
        injected: dict[int, OSError] = {}
        if job.fault is not None:
            for i in range(lo, hi):
                try:
                    job.fault.check(job.op, int(job.handles[i]))
                except OSError as err:
                    injected[i] = err
                    vec.fds[i] = -1                       # EBADF in C: this extent is not run
        io = (vec.fds[lo:hi], vec.offsets[lo:hi], vec.iov_ptr[lo:hi + 1], vec.base, vec.length,
              vec.got[lo:hi])
        hashes = vec.hashes[s0:s1]
        if job.op == "write":
            _pageio.hash_pages(vec.addrs[s0:s1], self.nbytes, hashes)
            _pageio.pwritev_extents(*io)
        else:
            if not _pageio.preadv_extents(*io, ring) and self.ring_depth:
                # io_uring failed here (this batch still completed, without it): read batches
                # go back to the pool of threads
                self.ring_depth = 0
                logger.warning("disk tier: io_uring failed; reading with %d threads instead",
                               self.threads)
            _pageio.hash_pages(vec.addrs[s0:s1], self.nbytes, hashes)
        ok = vec.got[lo:hi] == vec.want[lo:hi]
        keys = job.keys[s0:s1]
        io_errors = []
        if not ok.all():
            for i in np.flatnonzero(~ok) + lo:
                io_errors.append(self._extent_error(job, vec, i, injected.get(i)))
            page_ok = np.repeat(ok, job.ends[lo:hi] - job.starts[lo:hi])
            keys, hashes = keys[page_ok], hashes[page_ok]
        corrupt = []
        if job.op == "write":
            self._crc[keys] = hashes
            self._stored[keys] = True
        else:
            bad = hashes != self._crc[keys]
            if bad.any():
                corrupt.append(keys[bad])
        return io_errors, corrupt, int(vec.want[lo:hi][ok].sum())

    @staticmethod
    def _extent_error(job: ExtentJob, vec: _Vectors, i: int, injected: OSError | None):
        """(keys, errno or None, message) of extent i, which moved got[i] of want[i] bytes."""
        keys = job.keys[int(job.starts[i]):int(job.ends[i])]
        where = f"{job.op} of {keys.shape[0]} pages at offset {int(job.offsets[i])} failed"
        got = int(vec.got[i])
        if injected is not None:
            return keys, injected.errno, f"{where}: {injected.strerror or injected}"
        if got < 0:
            return keys, -got, f"{where}: {os.strerror(-got)}"
        what, hint = ("read", "file truncated?") if job.op == "read" else ("write", "disk full?")
        return keys, None, f"{where}: short {what}: {got} of {int(vec.want[i])} bytes ({hint})"

    def _staged_io(self, job: ExtentJob, lo: int, hi: int):
        """Extents lo..hi-1 one at a time through an aligned staging buffer (O_DIRECT with
        page buffers it cannot use in place)."""
        run = self._read if job.op == "read" else self._write
        io_errors, corrupt, nbytes = [], [], 0
        for i in range(lo, hi):
            s, t = int(job.starts[i]), int(job.ends[i])
            keys = job.keys[s:t]
            try:
                if job.fault is not None:
                    job.fault.check(job.op, int(job.handles[i]))
                # page positions within the extent when it spans gaps (reads only)
                at = None if job.pns is None else job.pns[s:t] - job.pns[s]
                bad = run(job, int(job.fds[i]), int(job.offsets[i]), job.rows[s:t], keys, at)
                nbytes += (t - s if at is None else int(at[-1]) + 1) * self.stride
                if bad is not None:
                    corrupt.append(bad)
            except OSError as err:
                io_errors.append((keys, err.errno, f"{job.op} of {t - s} pages at offset "
                                  f"{int(job.offsets[i])} failed: {err.strerror or err}"))
        return io_errors, corrupt, nbytes

    def _staging(self, length: int) -> np.ndarray:
        stage = getattr(self._local, "stage", None)
        if stage is None or stage.shape[0] < length:
            # NOTE: anonymous mmap is page-aligned, as O_DIRECT needs.
            stage = np.frombuffer(mmap.mmap(-1, max(length, self.max_pages * self.stride)),
                                  dtype=np.uint8)
            self._local.stage = stage
        return stage[:length]

    def _read(self, job: ExtentJob, fd: int, offset: int, rows: np.ndarray, keys: np.ndarray,
              at: np.ndarray | None = None) -> np.ndarray | None:
        """One preadv of the extent into the staging buffer, then page i to buf[rows[i]];
        `at` (ascending) gives its position in the extent when the extent spans gaps."""
        buf = job.buf
        span = len(rows) if at is None else int(at[-1]) + 1
        length = span * self.stride
        stage = self._staging(length)
        got = os.preadv(fd, [stage], offset)
        if got != length:
            raise OSError(None, f"short read: {got} of {length} bytes (file truncated?)")
        pages = stage.reshape(span, self.stride)
        buf[rows] = pages[:, :self.nbytes] if at is None else pages[at, :self.nbytes]
        bad = page_hashes(buf, rows) != self._crc[keys]
        return keys[bad] if bad.any() else None

    def _write(self, job: ExtentJob, fd: int, offset: int, rows: np.ndarray, keys: np.ndarray,
               at: None = None) -> None:
        # NOTE: `at` is always None: a write never spans a gap (it would overwrite other pages)
        buf, length = job.buf, len(rows) * self.stride
        crcs = page_hashes(buf, rows)
        stage = self._staging(length)
        stage.reshape(len(rows), self.stride)[:, :self.nbytes] = buf[rows]
        got = os.pwritev(fd, [stage], offset)
        if got != length:
            raise OSError(None, f"short write: {got} of {length} bytes (disk full?)")
        self._crc[keys] = crcs
        self._stored[keys] = True
