"""A fill's copies up through a copy stream (kvstore/tiers/transfers.py), for the Fetcher
(kvstore/fetcher.py): pages gathered into a staging buffer go up into their device slots on
the copy stream after the resolution's `after` mark, the resolution's `ready` becomes the
copy's event, and a staging buffer is given back (at once when its pages never go up)."""
from __future__ import annotations

import torch

from kvstore.resolution import Resolution


def copy_up(tiers, res: Resolution, dst: torch.Tensor, gather) -> None:
    """Pages into device slots `dst` through the copy stream: `gather(buf)` writes them
    into a staging buffer, whose copy up then runs after `res.after`; `res.ready` becomes
    its event (the copy stream runs in order, so it covers the fill's earlier copies).
    tiers: the kvstore.tierset.TierSet."""
    buf = tiers.copies.staging.take(dst.numel())
    try:
        gather(buf)
    except BaseException:
        tiers.copies.staging.release(buf, None)
        raise
    send_up(tiers, res, dst, buf)


def send_up(tiers, res: Resolution, dst: torch.Tensor, buf: torch.Tensor) -> None:
    """The staging buffer `buf` into device slots `dst` on the copy stream, after
    `res.after`; `res.ready` becomes the copy's event, which frees the buffer."""
    copies = tiers.copies
    res.ready = copies.to_device(tiers.device_tier.pool, dst, buf, res.after)
    copies.staging.release(buf, res.ready)


def unstage(tiers, res: Resolution) -> None:
    """A staging buffer whose reads will never be copied up (a failure) is free again."""
    if res.staged is not None:
        tiers.copies.staging.release(res.staged, None)
        res.staged = None
