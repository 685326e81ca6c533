"""Probe a directory's filesystem at start-up: whether it supports O_DIRECT (the disk tier),
how fast random extent reads are (the recompute planner)."""
from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.tiers.base import ALIGN
from kvstore.tiers.disk_fault import DiskFault

logger = logging.getLogger(__name__)


def probe_direct_io(root: Path, fault: DiskFault | None = None, align: int = ALIGN) -> bool:
    """Write and read back one block of `align` bytes, at offset and address `align`, with
    O_DIRECT under `root` (align: 4096 for whole pages, 512 for the codec's packed codes).

    Returns False, logging ONE warning, when that fails (EINVAL on filesystems without
    O_DIRECT, no O_DIRECT on this OS, or an injected `fault.no_direct_io`): the caller then
    uses buffered I/O.
    """
    probe = Path(root) / ".odirect-probe"
    try:
        if fault is not None:
            fault.check_probe()
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            buf = memoryview(mmap.mmap(-1, 2 * ALIGN))[align:2 * align]
            os.pwrite(fd, buf, align)
            os.preadv(fd, [buf], align)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError) as err:
        logger.warning("disk tier: O_DIRECT%s is not supported under %s (%s); using buffered "
                       "I/O (disk pages will also occupy the page cache)",
                       f" at {align}-byte alignment" if align != ALIGN else "", root, err)
        return False
    finally:
        probe.unlink(missing_ok=True)


def read_seconds_per_byte(root: Path, extent: int = 1 << 17, total: int = 1 << 25,
                          depth: int = 8) -> float:
    """Seconds per byte of reads of `extent` bytes at random offsets of a `total`-byte scratch
    file under `root`, `depth` in flight, with O_DIRECT where the filesystem allows it (else
    through the page cache, which is then what a fill reads from): the link a KV fill reads
    over, measured once at start-up (kvstore/recompute.py)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f".read-probe-{os.getpid()}"
    n = max(depth, total // extent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            block = os.urandom(extent)
            for i in range(n):
                os.pwrite(fd, block, i * extent)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        order = [(i * 7919) % n for i in range(n)]       # a fixed scatter over the file

        def stripe(j: int) -> None:
            buf = mmap.mmap(-1, extent)
            for i in order[j::depth]:
                os.preadv(fd, [buf], i * extent)
        try:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(depth) as pool:
                list(pool.map(stripe, range(depth)))
            return (time.perf_counter() - t0) / (n * extent)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
