"""A new request's file on the disk tier: registered at admission, once room is made when the
tier is full for now (TieredKVStore.add_request).

Room comes from files of finished requests that still wait for their last writes (`release`
defers their close) and from cached pages only the prefix cache holds (least recently used
first); without either, the request is refused with KVFull and retried later.
"""
from __future__ import annotations

from kvstore.errors import KVFull
from kvstore.prefix import PrefixReuse
from kvstore.tiers.errors import TierFull
from kvstore.tierset import TierSet


def register_on_disk(tiers: TierSet, prefix: PrefixReuse | None, handle: int, cap: int) -> None:
    """Register the request's file (`cap` pages per layer) with the disk tier, if there is
    one, making room first when it is full."""
    disk = tiers.disk_tier
    if disk is not None:
        try:
            disk.register_request(handle, cap)
        except TierFull:
            make_disk_room(tiers, prefix, handle, cap)


def make_disk_room(tiers: TierSet, prefix: PrefixReuse | None, handle: int, cap: int) -> None:
    """Register the request's file once room is made: files of finished requests may
    still wait for their last writes (`release` defers their close), and cached pages
    only the prefix cache holds give their space back (least recently used first)."""
    disk = tiers.disk_tier
    tiers.reap(block=True)
    while True:
        try:
            disk.register_request(handle, cap)
            return
        except TierFull as exc:
            if prefix is None or not prefix.reclaim(64):
                raise KVFull(f"disk tier is full for now ({exc}); retry later") from exc
