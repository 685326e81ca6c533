"""Probe whether a directory's filesystem supports O_DIRECT (once, at disk tier start-up)."""
from __future__ import annotations

import logging
import mmap
import os
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
