"""DiskLayout: where a KV page lives on disk (file and byte offset).

Layout v2, "request segments, layer-major":
- one file per request under `root`, named `seg-<handle>.kv`, created when the request
  registers; it outlives the request while pages in it are cached (segments.py), and its
  cached pages are listed in `seg-<handle>.idx` (segment_log.py). Handles are never reused,
  across restarts too (`next_handle`);
- a request reserves `capacity` pages per layer; page `index` (position in the request's page
  list) of `layer` sits at page number `layer * capacity + index`, byte offset
  `page_number * stride`, where `stride` is the page size in bytes rounded up to 4096 (so every
  page is an O_DIRECT-aligned extent and padding, if any, follows each page), or with the KV
  tier codec the size of a page's codes rounded up to 512 (codec.py);
- consequence: a request's pages of one layer are contiguous, so neighbours coalesce into one
  read or write;
- a page's bytes are the page tensor's, in the cache's page layout (HND, base.py), opaque here;
  the version is part of the prefix cache's namespace, so pages of another layout never hit.

One process owns `root`: `lock` takes an exclusive advisory lock (flock) on the directory
itself (two servers on one path would truncate each other's request files), released when the
process exits, however it exits; no file is added to the folder.

The layout does arithmetic over numpy arrays and names files; the disk tier owns the files
and their bookkeeping.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import re
from pathlib import Path

import numpy as np

from kvstore.tiers.base import PageShape

logger = logging.getLogger(__name__)
_V1_RE = re.compile(r"^req-(-?\d+)\.kv$")          # layout v1's request files
_SEG_RE = re.compile(r"^seg-(\d+)\.(kv|idx)$")
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_PUNCH = 0x01 | 0x02                     # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
INPUTS_FOLDER = "inputs"     # under the KV folder: the pages' layer inputs (disk_inputs.py)
RAW_FOLDER = "raw-layers"    # under the KV folder: the layers a codec share leaves uncoded
#                              (disk_layers.py)
SHARE_FILE = "codec-share.json"     # in the KV folder: what --kv-tier-codec-share auto chose


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give a file range's blocks back to the filesystem (fallocate PUNCH_HOLE); False where
    the filesystem cannot."""
    fallocate = getattr(_LIBC, "fallocate", None)
    if fallocate is None:
        return False
    fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if fallocate(fd, _PUNCH, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        logger.debug("fallocate punch hole failed: %s", os.strerror(err))
    return False


class DiskPathInUse(RuntimeError):
    """Another process holds the disk tier's directory."""


def lock_folder(root: Path) -> int:
    """An exclusive flock on the directory `root`; returns the descriptor to keep open.
    Raises DiskPathInUse when another process holds it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskPathInUse(f"the KV disk path {root} is in use by another Strata server (it "
                            "holds the folder's lock); give each server its own "
                            "--kv-disk-path") from None
    return fd


def segment_files(root: Path) -> list[tuple[int, Path]]:
    """(handle, path) of the segment files under root, oldest handle first."""
    found = []
    for p in Path(root).iterdir():
        m = _SEG_RE.match(p.name)
        if m and m.group(2) == "kv" and p.is_file() and not p.is_symlink():
            found.append((int(m.group(1)), p))
    return sorted(found)


class DiskLayout:
    version = 2

    def __init__(self, root: str | Path, page_shape: PageShape, num_layers: int,
                 stride: int | None = None):
        """stride: bytes per page on disk (default: the page rounded up to 4096; the codec's
        pages are smaller, codec.py)."""
        if num_layers <= 0:
            raise ValueError(f"DiskLayout needs num_layers > 0, got {num_layers}")
        self.root = Path(root)
        self.page_shape = page_shape
        self.num_layers = num_layers
        # bytes between consecutive pages in a file
        self.stride = int(stride) if stride else page_shape.nbytes_aligned

    def file_path(self, handle: int) -> Path:
        return self.root / f"seg-{int(handle)}.kv"

    def index_path(self, handle: int) -> Path:
        return self.root / f"seg-{int(handle)}.idx"

    def segment_files(self) -> list[tuple[int, Path]]:
        return segment_files(self.root)

    def next_handle(self) -> int:
        handles = [int(m.group(1)) for p in self.root.iterdir() if (m := _SEG_RE.match(p.name))]
        return max(handles, default=-1) + 1

    def lock(self) -> int:
        """Take root for this process (an exclusive flock on the directory); returns the
        descriptor to keep open. Raises DiskPathInUse when another process holds it."""
        return lock_folder(self.root)

    def clear_stale_files(self) -> int:
        """Delete request files a previous process left that no index lists (layout v1's, and
        segments of a request that was cut off before any page of it was cached); returns how
        many. Anything else under root is left alone."""
        names = {p.name for p in self.root.iterdir()}
        stale = [p for p in self.root.iterdir()
                 if _V1_RE.match(p.name) or (_SEG_RE.match(p.name) and p.suffix == ".kv"
                                             and p.with_suffix(".idx").name not in names)]
        odd = [p for p in stale if p.is_symlink() or not p.is_file()]
        if odd:
            logger.warning("disk tier: leaving %d entries under %s that are not request files "
                           "(e.g. %s)", len(odd), self.root, odd[0].name)
        stale = [p for p in stale if p not in odd]
        for p in stale:
            p.unlink(missing_ok=True)
        if stale:
            logger.info("disk tier: removed %d stale request files from %s", len(stale), self.root)
        return len(stale)

    def file_bytes(self, capacity: int) -> int:
        """Bytes reserved by a request of `capacity` pages per layer (all layers)."""
        return capacity * self.num_layers * self.stride

    def page_numbers(self, layers: np.ndarray, indices: np.ndarray,
                     capacities: np.ndarray) -> np.ndarray:
        """Position of pages in their request file, in units of `stride`.

        layers, indices, capacities: int64 [n] (capacity = the owning request's pages per
        layer) -> int64 [n] = layer * capacity + index.
        """
        return layers * capacities + indices

    def offsets(self, page_numbers: np.ndarray) -> np.ndarray:
        """int64 [n] byte offsets of pages in their request file."""
        return page_numbers * self.stride
