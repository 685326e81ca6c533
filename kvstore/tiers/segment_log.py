"""SegmentLog: the index of a disk segment's cached pages, an append-only log that survives
`kill -9` and reports, never serves, what a crash or the disk damaged.

A segment is one request's page file (`seg-<handle>.kv`, disk_layout.py). Its cached pages
are listed in `seg-<handle>.idx`:

  header  magic "STRKVIX1" | u32 version | u32 pages per layer | u32 layers |
          u32 summary bytes per page | 16-byte namespace | (version 2:) u32 codec meta bytes
          per page | u32 CRC32 of the bytes before
  record  u32 body length | u32 CRC32 of the body | body
  body    u8 kind | u32 page index, then for kind PAGE: 16-byte chain key | u8 has summaries |
          u64 XXH64 of the page in each layer | the codec's scales of the page in every layer
          (meta bytes; none without a codec) | the page's summaries (when it has them);
          kind GONE: nothing (the page left the cache)

A record is appended only once the page's bytes are on disk in every layer, so a record
names bytes that were written; a torn or corrupt record ends the log (the tail is cut off
at start-up, with a warning), and the per-layer checksums catch pages damaged later (read
back before a restored page is served). The last record of an index wins.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

KEY_BYTES = 16                  # a chain key (kvstore/prefix_cache.py)

logger = logging.getLogger(__name__)

MAGIC = b"STRKVIX1"
VERSION = 2                     # 1: no meta bytes (read as 0)
_HEAD = struct.Struct(f"<8sIIII{KEY_BYTES}s")
_META = struct.Struct("<I")
_REC = struct.Struct("<II")
_BODY = struct.Struct("<BI")
PAGE, GONE = 1, 2


@dataclass(frozen=True)
class Header:
    capacity: int          # pages per layer of the segment file
    num_layers: int
    summary_bytes: int     # bytes of one page's summaries
    namespace: bytes
    meta_bytes: int = 0    # bytes of one page's codec scales (all layers)

    def pack(self) -> bytes:
        head = _HEAD.pack(MAGIC, VERSION, self.capacity, self.num_layers, self.summary_bytes,
                          self.namespace) + _META.pack(self.meta_bytes)
        return head + struct.pack("<I", zlib.crc32(head))


def _header_bytes(version: int) -> int:
    return _HEAD.size + (_META.size if version >= 2 else 0) + 4


@dataclass
class PageRecord:
    index: int
    key: bytes
    crcs: np.ndarray               # uint64 [layers]
    summaries: bytes | None
    meta: bytes = b""              # the codec's scales, every layer (b"": no codec)


@dataclass
class Parsed:
    header: Header | None          # None: not a log of ours (or its header is damaged)
    pages: dict[int, PageRecord] = field(default_factory=dict)   # index -> live record
    good_bytes: int = 0            # the log's length up to its last valid record
    damaged: bool = False          # a torn or corrupt record ended it early


def page_body(rec: PageRecord) -> bytes:
    has = rec.summaries is not None
    return (_BODY.pack(PAGE, rec.index) + rec.key + bytes([has])
            + np.asarray(rec.crcs, dtype="<u8").tobytes() + rec.meta + (rec.summaries or b""))


def gone_body(index: int) -> bytes:
    return _BODY.pack(GONE, index)


def frame(body: bytes) -> bytes:
    return _REC.pack(len(body), zlib.crc32(body)) + body


def parse(path: Path) -> Parsed:
    """Read a log: its header and, per page index, the last record (GONE ones dropped)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        logger.warning("disk tier: cannot read %s (%s): its pages are dropped", path, exc)
        return Parsed(None)
    if len(data) < _header_bytes(1) or data[:8] != MAGIC:
        return Parsed(None)
    version = struct.unpack_from("<I", data, 8)[0]
    at = _header_bytes(version)
    if version not in (1, VERSION) or len(data) < at:
        return Parsed(None)
    head = data[:at - 4]
    if struct.unpack_from("<I", data, at - 4)[0] != zlib.crc32(head):
        return Parsed(None)
    _, version, cap, layers, sbytes, ns = _HEAD.unpack_from(head)
    mbytes = _META.unpack_from(head, _HEAD.size)[0] if version >= 2 else 0
    out = Parsed(Header(cap, layers, sbytes, ns, mbytes), good_bytes=at)
    crc_end = _BODY.size + KEY_BYTES + 1 + 8 * layers
    page_len = crc_end + mbytes
    while at < len(data):
        if at + _REC.size > len(data):
            out.damaged = True
            break
        n, crc = _REC.unpack_from(data, at)
        body = data[at + _REC.size:at + _REC.size + n]
        if len(body) != n or n < _BODY.size or zlib.crc32(body) != crc:
            out.damaged = True
            break
        kind, index = _BODY.unpack_from(body)
        if kind == GONE and n == _BODY.size and index < cap:
            out.pages.pop(index, None)
        elif kind == PAGE and n in (page_len, page_len + sbytes) and index < cap:
            k0 = _BODY.size
            has = body[k0 + KEY_BYTES] == 1 and n == page_len + sbytes
            crcs = np.frombuffer(body, dtype="<u8", count=layers, offset=k0 + KEY_BYTES + 1)
            out.pages[index] = PageRecord(index, body[k0:k0 + KEY_BYTES], crcs.astype(np.uint64),
                                          body[page_len:] if has else None,
                                          body[crc_end:page_len])
        else:
            out.damaged = True
            break
        at += _REC.size + n
        out.good_bytes = at
    return out


class SegmentLog:
    """Appends to one segment's index (the file is opened per append: a cached segment holds
    no descriptor). A failed append is undone (the log is cut back to its last good record),
    so a later record never follows a torn one."""

    def __init__(self, path: Path, header: Header, good_bytes: int | None = None):
        self.path = path
        self.broken = False
        if good_bytes is None:           # a new log
            self.length = 0
            self._write(header.pack(), os.O_CREAT | os.O_TRUNC)
        else:                            # an existing one, cut to its last valid record
            os.truncate(path, good_bytes)
            self.length = good_bytes

    def append(self, data: bytes, framed: bool = True) -> None:
        """Raises OSError (e.g. ENOSPC) after undoing the partial write."""
        if self.broken:
            raise OSError("the index log of this segment failed earlier")
        self._write(frame(data) if framed else data, 0)

    def _write(self, data: bytes, flags: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC | flags, 0o600)
        try:
            written = os.pwrite(fd, data, self.length)
            if written != len(data):
                raise OSError(f"short write to {self.path.name}")
        except OSError:
            try:
                os.ftruncate(fd, self.length)
            except OSError:
                self.broken = True
            raise
        finally:
            os.close(fd)
        self.length += len(data)
