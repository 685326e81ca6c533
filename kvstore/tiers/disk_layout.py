"""DiskLayout: where a KV page lives on disk (file and byte offset).

Layout v1, "request files, layer-major":
- one file per request under `root`, named `req-<handle>.kv`, created when the request
  registers and deleted when it is released;
- a request reserves `capacity` pages per layer; page `index` (position in the request's page
  list) of `layer` sits at page number `layer * capacity + index`, byte offset
  `page_number * stride`, where `stride` is the page size in bytes rounded up to 4096 (so every
  page is an O_DIRECT-aligned extent and padding, if any, follows each page);
- consequence: a request's pages of one layer are contiguous, so neighbours coalesce into one
  read or write;
- a page's bytes are the page tensor's, in the cache's page layout (HND, base.py), opaque here.
  Pages do not outlive the process in v1, so a layout change needs no file format version.

One process owns `root`: `lock` takes an exclusive advisory lock (flock) on the directory
itself (two servers on one path would truncate each other's request files), released when the
process exits, however it exits; no file is added to the folder.

The layout only does arithmetic over numpy arrays; the disk tier owns files and bookkeeping.
Another layout (e.g. content-addressed pages for prefix reuse) can replace this class.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
from pathlib import Path

import numpy as np

from kvstore.tiers.base import PageShape

logger = logging.getLogger(__name__)
_FILE_RE = re.compile(r"^req-(-?\d+)\.kv$")


class DiskPathInUse(RuntimeError):
    """Another process holds the disk tier's directory."""


class DiskLayout:
    version = 1

    def __init__(self, root: str | Path, page_shape: PageShape, num_layers: int):
        if num_layers <= 0:
            raise ValueError(f"DiskLayout needs num_layers > 0, got {num_layers}")
        self.root = Path(root)
        self.page_shape = page_shape
        self.num_layers = num_layers
        self.stride = page_shape.nbytes_aligned  # bytes between consecutive pages in a file

    def file_path(self, handle: int) -> Path:
        return self.root / f"req-{int(handle)}.kv"

    def lock(self) -> int:
        """Take root for this process (an exclusive flock on the directory); returns the
        descriptor to keep open. Raises DiskPathInUse when another process holds it."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskPathInUse(f"the KV disk path {self.root} is in use by another Strata "
                                "server (it holds the folder's lock); give each server its own "
                                "--kv-disk-path") from None
        return fd

    def clear_stale_files(self) -> int:
        """Delete request files left under root by a previous process; returns how many.
        Anything else under root, such as a directory with a request file's name, is left
        alone. NOTE: pages do not survive a restart in layout v1 (no content keys yet)."""
        stale = [p for p in self.root.iterdir() if _FILE_RE.match(p.name)]
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
