"""Restart of a disk tier's folder: the segments a previous server left with indexed pages
(their index logs parsed, segment_log.py) are adopted by the tier's Segments, and what they
hold is listed as RestoredPages; request files without a usable index are removed, files of
another namespace are left alone (`DiskTier.restore`, disk.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kvstore.tiers.disk_layout import DiskLayout
from kvstore.tiers.segment_log import SegmentLog, parse
from kvstore.tiers.segments import Segments

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoredPages:
    """A segment's cached pages found at start-up (`DiskTier.restore`)."""
    handle: int
    indices: np.ndarray            # int64 [n] page indices in the file
    keys: list[bytes]              # their chain keys
    crcs: np.ndarray               # uint64 [n, layers] checksums of their bytes
    summaries: list[bytes | None]
    meta: list[bytes | None]        # the codec's scales of each page, all layers


def restore_segments(layout: DiskLayout, segments: Segments) -> list[RestoredPages]:
    """The segment files under `layout` with indexed pages of `segments`' namespace, adopted
    by `segments` (their pages to be taken: `DiskTier.adopt`). Files of other namespaces are
    left alone; request files without an index (a crash mid-request) are removed."""
    found, foreign = [], 0
    for handle, path in layout.segment_files():
        parsed = parse(layout.index_path(handle))
        head = parsed.header
        if head is not None and head.namespace != segments.namespace:
            foreign += 1
            continue
        if head is None or not parsed.pages or head.num_layers != layout.num_layers \
                or head.summary_bytes != segments.summary_bytes \
                or head.meta_bytes != segments.meta_bytes:
            path.unlink(missing_ok=True)
            layout.index_path(handle).unlink(missing_ok=True)
            continue
        if parsed.damaged:
            logger.warning("disk tier: the index of %s ends in a torn or corrupt record "
                           "(a crash mid-write?): cut after %d pages", path.name,
                           len(parsed.pages))
        log = SegmentLog(layout.index_path(handle), head, parsed.good_bytes)
        segments.adopt(handle, head.capacity, log)
        recs = sorted(parsed.pages.values(), key=lambda r: r.index)
        found.append(RestoredPages(handle, np.array([r.index for r in recs], np.int64),
                                   [r.key for r in recs], np.stack([r.crcs for r in recs]),
                                   [r.summaries for r in recs],
                                   [r.meta or None for r in recs]))
    if foreign:
        logger.info("disk tier: left alone %d cached files of another model or layout "
                    "under %s (`strata cache clear` removes them)", foreign, layout.root)
    return found
