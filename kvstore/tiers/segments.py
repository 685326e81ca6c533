"""Segments: the disk tier's files and which page lives where in them.

A segment is the file of one request (`seg-<handle>.kv`, layout in disk_layout.py), created
when the request registers. A page id bound to a segment sits at an index of it (its place
in the request's page list). The segment outlives its request while pages bound to it live
(pages the prefix cache keeps, or other requests share): when its request is released the
ranges of its unbound indices are punched out of the file (their space goes back to the
budget) and the file goes with its last page. Cached pages are listed in the segment's index
log (segment_log.py), which lets a restarted server find them again (`restore`).

Reservations (`reserved`): a running request reserves every page it may write, from the
first one that is its own (`skip`: the pages before it are shared); a released segment
only its live pages (all it had, where the filesystem cannot punch holes).

Descriptors: a running request's file stays open; a released one's is opened for a batch of
I/O and closed after it (`begin_io` / `end_io`), so cached segments cost no descriptor and
their number is bounded by the disk budget alone.

Threading: the engine's thread calls everything; the disk tier's I/O threads only end their
batches (`end_io`), under the same lock as `begin_io`.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.tiers.disk_layout import DiskLayout, punch_hole
from kvstore.tiers.segment_log import Header, PageRecord, SegmentLog, frame, gone_body, page_body

logger = logging.getLogger(__name__)


@dataclass
class Segment:
    handle: int
    fd: int                                 # -1: closed (a released file between batches)
    path: Path
    capacity: int                           # pages per layer
    first: int = 0                          # indices below it are shared pages, not its own
    running: bool = True                    # its request is not released yet
    pending: int = 0                        # I/O batches in flight (guarded by Segments._cond)
    log: SegmentLog | None = None
    page_at: np.ndarray = field(default=None)     # int64 [capacity]: page id at index, -1
    recorded: np.ndarray = field(default=None)    # bool [capacity]: in the index log
    # page ids unbound while writes to the file were in flight: a write completing later
    # marks them stored again, so `release` clears them once the I/O is done
    late: list = field(default_factory=list)

    def __post_init__(self):
        if self.page_at is None:
            self.page_at = np.full(self.capacity, -1, np.int64)
            self.recorded = np.zeros(self.capacity, bool)

    @property
    def live(self) -> int:
        return int(np.count_nonzero(self.page_at >= 0))


class Segments:
    def __init__(self, layout: DiskLayout, max_pages: int, stored: np.ndarray,
                 direct_io: bool, namespace: bytes, summary_bytes: int, fault_of=lambda: None,
                 meta_bytes: int = 0):
        """fault_of: the disk tier's injected fault (tests), checked by index appends."""
        self.layout = layout
        self.max_pages = max_pages
        self._stored = stored.reshape(-1, max_pages)    # [layers, pages] view of the tier's
        self.direct_io = direct_io
        self.namespace = namespace
        self.summary_bytes = summary_bytes
        self.meta_bytes = meta_bytes                        # codec scales per page, all layers
        self.page_slot = np.full(max_pages, -1, np.int64)   # page id -> segment slot
        self.page_index = np.zeros(max_pages, np.int64)     # page id -> index in it
        self.table = np.zeros((0, 3), np.int64)             # [slots, (capacity, fd, handle)]
        self._segs: list[Segment | None] = []
        self._slot_of: dict[int, int] = {}                  # handle -> slot
        self._cond = threading.Condition()
        self._can_punch = True
        self._log_warned = False
        self._fault_of = fault_of

    # ---------------------------------------------------------------- sizes
    def reserved_bytes(self, seg: Segment) -> int:
        if seg.running or not self._can_punch:
            return self.layout.file_bytes(seg.capacity - seg.first)
        return self.layout.file_bytes(seg.live)

    @property
    def reserved(self) -> int:
        return sum(self.reserved_bytes(s) for s in self._segs if s is not None)

    def __contains__(self, handle: int) -> bool:
        return int(handle) in self._slot_of

    def segment(self, handle: int) -> Segment:
        slot = self._slot_of.get(int(handle))
        if slot is None:
            raise ValueError(f"disk tier: request {handle} is not registered")
        return self._segs[slot]

    # ---------------------------------------------------------------- lifecycle
    def create(self, handle: int, capacity: int) -> None:
        path = self.layout.file_path(handle)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        fd = os.open(path, flags | (os.O_DIRECT if self.direct_io else 0), 0o600)
        self._add(Segment(handle, fd, path, capacity))

    def _add(self, seg: Segment) -> int:
        slot = self._segs.index(None) if None in self._segs else len(self._segs)
        if slot == len(self._segs):
            self._segs.append(None)
            self.table = np.concatenate([self.table, np.zeros((1, 3), np.int64)])
        self._segs[slot] = seg
        self.table[slot] = (seg.capacity, seg.fd, seg.handle)
        self._slot_of[seg.handle] = slot
        return slot

    def skip(self, handle: int, n: int) -> None:
        """The request's first n pages are shared ones: its file never holds them."""
        seg = self.segment(handle)
        seg.first = max(seg.first, min(int(n), seg.capacity))

    def bind(self, page_ids: np.ndarray, handle: int, first_index: int) -> None:
        slot = self._slot_of.get(int(handle))
        if slot is None:
            raise ValueError(f"disk tier: request {handle} is not registered")
        seg = self._segs[slot]
        n = page_ids.shape[0]
        if first_index < 0 or first_index + n > seg.capacity:
            raise ValueError(f"disk tier: indices [{first_index}, {first_index + n}) outside "
                             f"request {handle}'s {seg.capacity} pages per layer")
        if n and (page_ids.min() < 0 or page_ids.max() >= self.max_pages):
            raise ValueError(f"disk tier: page ids outside [0, {self.max_pages})")
        idx = first_index + np.arange(n)
        taken = seg.page_at[idx]
        if (taken >= 0).any() and (taken[taken >= 0] != page_ids[taken >= 0]).any():
            raise ValueError("disk tier: those indices of the file hold live pages "
                             "(occupants() lists them; free them first)")
        self.unbind(page_ids[self.page_slot[page_ids] >= 0])
        self.page_slot[page_ids] = slot
        self.page_index[page_ids] = idx
        seg.page_at[idx] = page_ids
        self._stored[:, page_ids] = False

    def occupants(self, handle: int, first_index: int, n: int) -> list[int]:
        """Live pages at indices [first_index, first_index + n) of the request's file."""
        seg = self.segment(handle)
        at = seg.page_at[first_index:first_index + n]
        return at[at >= 0].tolist()

    def unbind(self, page_ids: np.ndarray) -> None:
        """The pages left every holder: forgotten here; a released file loses their ranges
        (and goes with its last page)."""
        page_ids = page_ids[self.page_slot[page_ids] >= 0]
        if not page_ids.size:
            return
        slots = self.page_slot[page_ids]
        idx = self.page_index[page_ids]
        self.page_slot[page_ids] = -1
        self._stored[:, page_ids] = False
        for s in np.unique(slots):
            seg, mine = self._segs[s], idx[slots == s]
            if seg.running and seg.pending:         # writes to it may be in flight
                seg.late.append(page_ids[slots == s])
            seg.page_at[mine] = -1
            gone = mine[seg.recorded[mine]]
            if gone.size:
                seg.recorded[gone] = False
                self._append(seg, [gone_body(int(i)) for i in gone])
            if not seg.running:
                self._punch(seg, mine)
                if seg.live == 0:
                    self._delete(s)

    def release(self, handle: int) -> None:
        """The request ended: wait for its I/O; its file keeps only its live pages."""
        slot = self._slot_of.get(int(handle))
        if slot is None or not self._segs[slot].running:
            return
        seg = self._segs[slot]
        with self._cond:
            self._cond.wait_for(lambda: seg.pending == 0)
        for ids in seg.late:
            self._stored[:, ids[self.page_slot[ids] < 0]] = False
        seg.late.clear()
        seg.running = False
        if seg.live == 0:
            self._delete(slot)
            return
        self._punch(seg, np.flatnonzero(seg.page_at < 0))
        with self._cond:
            self._close_fd(slot)

    def close(self) -> None:
        """Segments with recorded pages stay (for the next start); the others go."""
        for slot, seg in enumerate(self._segs):
            if seg is None:
                continue
            with self._cond:
                self._cond.wait_for(lambda: seg.pending == 0)
            if seg.recorded.any():
                self._close_fd(slot)
                self._segs[slot] = None
                self._slot_of.pop(seg.handle, None)
            else:
                self._delete(slot)

    def _delete(self, slot: int) -> None:
        seg = self._segs[slot]
        with self._cond:
            self._cond.wait_for(lambda: seg.pending == 0)
            self._close_fd(slot)
        seg.path.unlink(missing_ok=True)
        self.layout.index_path(seg.handle).unlink(missing_ok=True)
        self._segs[slot] = None
        self._slot_of.pop(seg.handle, None)

    def _punch(self, seg: Segment, indices: np.ndarray) -> None:
        if not self._can_punch or not indices.size:
            return
        # NOTE: a descriptor of its own: the segment's may be closed by an I/O thread
        # (`end_io`) at any time once its request is released
        fd = os.open(seg.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._punch_fd(seg, fd, indices)
        finally:
            os.close(fd)

    def _punch_fd(self, seg: Segment, fd: int, indices: np.ndarray) -> None:
        stride, cap = self.layout.stride, seg.capacity
        runs = np.split(indices, np.flatnonzero(np.diff(indices) != 1) + 1)
        for layer in range(self.layout.num_layers):
            for run in runs:
                off = (layer * cap + int(run[0])) * stride
                if not punch_hole(fd, off, len(run) * stride):
                    logger.warning("disk tier: %s cannot punch holes into files: a finished "
                                   "request's file keeps its whole reservation while any of "
                                   "its pages stays cached", self.layout.root)
                    self._can_punch = False
                    return

    # ---------------------------------------------------------------- I/O accounting
    def begin_io(self, slots: np.ndarray) -> None:
        """A batch will touch these segments: open the closed ones (their descriptors are in
        `table` from now until `end_io`)."""
        with self._cond:
            for s in slots:
                seg = self._segs[s]
                if seg.fd < 0:
                    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct_io else 0)
                    seg.fd = os.open(seg.path, flags)
                    self.table[s, 1] = seg.fd
                seg.pending += 1

    def end_io(self, slots: np.ndarray) -> None:
        with self._cond:
            for s in slots:
                seg = self._segs[s]
                seg.pending -= 1
                if not seg.running and seg.pending == 0:
                    self._close_fd(s)
            self._cond.notify_all()

    def _close_fd(self, slot: int) -> None:
        """(under _cond, no I/O in flight on it)"""
        seg = self._segs[slot]
        if seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            self.table[slot, 1] = -1

    # ---------------------------------------------------------------- the index logs
    def record(self, page_ids: np.ndarray, keys: list[bytes], crcs: np.ndarray,
               summaries: list[bytes | None], meta: list[bytes] | None = None) -> np.ndarray:
        """Append the pages' records to their segments' logs (their bytes are on disk);
        crcs [n, layers], meta: each page's codec scales (meta_bytes each). Returns bool [n]:
        recorded (a failed append records nothing)."""
        done = np.zeros(len(page_ids), bool)
        slots = self.page_slot[page_ids]
        for s in np.unique(slots[slots >= 0]):
            seg, rows = self._segs[s], np.flatnonzero(slots == s)
            idx = self.page_index[page_ids[rows]]
            bodies = [page_body(PageRecord(int(i), keys[r], crcs[r], summaries[r],
                                           meta[r] if meta is not None else b""))
                      for r, i in zip(rows, idx)]
            if self._append(seg, bodies):
                seg.recorded[idx] = True
                done[rows] = True
        return done

    def _append(self, seg: Segment, bodies: list[bytes]) -> bool:
        try:
            fault = self._fault_of()
            if fault is not None:
                fault.check("index", seg.handle)
            if seg.log is None:
                seg.log = SegmentLog(self.layout.index_path(seg.handle),
                                     Header(seg.capacity, self.layout.num_layers,
                                            self.summary_bytes, self.namespace,
                                            self.meta_bytes))
            seg.log.append(b"".join(frame(b) for b in bodies), framed=False)
            return True
        except OSError as exc:
            if not self._log_warned:
                logger.warning("disk tier: cannot write the prefix cache's index (%s): pages "
                               "stay cached in this process but are not kept across restarts",
                               exc)
                self._log_warned = True
            return False

    def adopt(self, handle: int, capacity: int, log: SegmentLog) -> Segment:
        """A segment found at start-up (restore): open, released, nothing bound yet."""
        seg = Segment(handle, -1, self.layout.file_path(handle), capacity, running=False,
                      log=log)
        self._add(seg)
        return seg

    def bind_restored(self, handle: int, page_ids: np.ndarray, indices: np.ndarray) -> None:
        slot = self._slot_of[int(handle)]
        seg = self._segs[slot]
        self.page_slot[page_ids] = slot
        self.page_index[page_ids] = indices
        seg.page_at[indices] = page_ids
        seg.recorded[indices] = True

    def finish_restore(self) -> None:
        """Restored segments none of whose pages were taken go; the others lose the ranges of
        pages that were not (or were dropped)."""
        for slot, seg in enumerate(self._segs):
            if seg is None or seg.running:
                continue
            if seg.live == 0:
                self._delete(slot)
                continue
            dropped = np.flatnonzero(seg.recorded & (seg.page_at < 0))
            if dropped.size:
                seg.recorded[dropped] = False
                self._append(seg, [gone_body(int(i)) for i in dropped])
            self._punch(seg, np.flatnonzero(seg.page_at < 0))

    def handles(self) -> list[int]:
        return list(self._slot_of)

