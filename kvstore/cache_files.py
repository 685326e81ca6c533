"""`strata cache ls | clear`: the prefix cache a disk tier keeps under --kv-disk-path.

Reads the segment files and their index logs (kvstore/tiers/segment_log.py) without loading
a model: what is cached, for which namespace (model, dtypes, page shape), how much disk it
takes. `clear` takes the folder's lock first, so it refuses while a server uses the path.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.tiers import segment_log
from kvstore.tiers.disk_layout import (INPUTS_FOLDER, RAW_FOLDER, SHARE_FILE, lock_folder,
                                       segment_files)


@dataclass(frozen=True)
class CachedSegment:
    handle: int
    namespace: str          # hex prefix of the namespace digest ("?" without a valid index)
    pages: int              # cached pages listed in its index
    disk_bytes: int         # blocks the file and its index take on disk
    damaged: bool           # its index ends in a torn or corrupt record


def list_cache(root: Path) -> list[CachedSegment]:
    """The segments under root; the disk bytes of a segment include its files in the
    subfolders (layer inputs, uncoded layers), which hold parts of the same pages."""
    out = []
    for handle, path in segment_files(root):
        index = path.with_suffix(".idx")
        parsed = segment_log.parse(index) if index.exists() else segment_log.Parsed(None)
        size = sum(_blocks(p) for p in (path, index) if p.exists())
        for sub in _subfolders(root):
            size += sum(_blocks(p) for p in (sub / path.name, sub / index.name) if p.exists())
        ns = parsed.header.namespace.hex()[:12] if parsed.header else "?"
        out.append(CachedSegment(handle, ns, len(parsed.pages), size, parsed.damaged))
    return out


def _subfolders(root: Path) -> list[Path]:
    return [p for p in (Path(root) / INPUTS_FOLDER, Path(root) / RAW_FOLDER) if p.is_dir()]


def clear_cache(root: Path) -> int:
    """Delete every segment file and index under root (and the layer inputs KV recompute
    kept beside them, the uncoded layers of a codec share, and the share `auto` chose);
    returns how many files went. Raises DiskPathInUse while a server holds
    the folder."""
    fd = lock_folder(root)
    try:
        gone = 0
        for folder in [root] + _subfolders(root):
            for _, path in segment_files(folder):
                for p in (path, path.with_suffix(".idx")):
                    if p.exists():
                        p.unlink()
                        gone += 1
        share = Path(root) / SHARE_FILE         # --kv-tier-codec-share auto measures again
        if share.exists():
            share.unlink()
            gone += 1
        return gone
    finally:
        os.close(fd)


def format_listing(segments: list[CachedSegment]) -> str:
    lines = [f"{'segment':>8} {'namespace':>12} {'pages':>7} {'disk MB':>9}  state"]
    for s in segments:
        state = "damaged tail" if s.damaged else ("no index" if s.namespace == "?" else "ok")
        lines.append(f"{s.handle:>8} {s.namespace:>12} {s.pages:>7} "
                     f"{s.disk_bytes / 2**20:>9.1f}  {state}")
    total = sum(s.pages for s in segments)
    mb = sum(s.disk_bytes for s in segments) / 2**20
    lines.append(f"{len(segments)} segments, {total} cached pages, {mb:.1f} MB on disk")
    return "\n".join(lines)


def _blocks(path: Path) -> int:
    st = path.stat()
    return getattr(st, "st_blocks", 0) * 512 or st.st_size
