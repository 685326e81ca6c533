"""DiskFault: an injectable hook that makes the disk tier's I/O fail, for tests.

Reproduces disk full (ENOSPC), I/O errors (EIO) and filesystems without O_DIRECT on any
machine, without root or a tiny filesystem. Immutable (read by the I/O threads); to change the
fault mid-test assign a new one: `tier.fault = DiskFault(write_errno=errno.ENOSPC)`.
"""
from __future__ import annotations

import errno as _errno
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskFault:
    read_errno: int | None = None     # every preadv raises OSError(read_errno), e.g. EIO
    write_errno: int | None = None    # every pwritev raises OSError(write_errno), e.g. ENOSPC
    index_errno: int | None = None    # every append to a prefix cache index raises it
    handles: frozenset[int] | None = None  # only I/O on these request handles fails; None: all
    no_direct_io: bool = False        # the O_DIRECT probe fails with EINVAL (as on some fs)
    write_delay_s: float = 0.0        # every write of these handles first sleeps (a slow disk)

    def check(self, op: str, handle: int) -> None:
        """Raise the injected OSError for `op` ("read" | "write" | "index") on request
        `handle`."""
        if self.handles is not None and handle not in self.handles:
            return
        if op == "write" and self.write_delay_s > 0:
            time.sleep(self.write_delay_s)
        code = {"read": self.read_errno, "write": self.write_errno,
                "index": self.index_errno}[op]
        if code is not None:
            raise OSError(code, f"injected fault: {os.strerror(code)}")

    def check_probe(self) -> None:
        if self.no_direct_io:
            raise OSError(_errno.EINVAL, "injected fault: O_DIRECT not supported")
