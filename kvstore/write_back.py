"""Write-back: pages that became full go to the backing tier once (asynchronously for disk,
so it overlaps with compute; behind a copy stream, down on it first)."""
from __future__ import annotations

import torch


def write_back(tiers, keys: torch.Tensor, slots: torch.Tensor, request_ids: list[str]) -> None:
    """Pages that became full (keys, in device slots; request_ids: each one's owner): copy them
    to the backing tier once. tiers: the kvstore.tierset.TierSet."""
    backing = tiers.backing
    if backing is tiers.device_tier:
        return          # device-only store: pages live (and stay) on the device
    copies = tiers.copies
    pool = tiers.device_tier.pool
    if backing is tiers.host_tier:
        if copies is None:      # a host pool: straight from its slots into the tier's
            backing.store_from(pool, slots.long(), backing.alloc_slots(keys))
        else:
            backing.put(keys, pool[slots.long()])
        tiers.clean[keys] = True
        tiers.stats.add_transfer("device", "host", keys.numel() * backing.page_bytes)
        return
    ready = None
    if copies is not None:
        # NOTE: down on the copy stream, after the kernels that wrote the pages; the
        # disk writes start once it is in (no wait on this thread)
        pages, ready = copies.to_host(pool, slots.long(), copies.mark())
    else:
        pages = pool[slots.long()]      # a copy the writer can own
    by_req: dict[str, list[int]] = {}
    for u, rid in enumerate(request_ids):
        by_req.setdefault(rid, []).append(u)
    for rid, rows in by_req.items():
        idx = torch.tensor(rows, dtype=torch.int64)
        k = keys[idx]
        if ready is None:
            p = pages[idx]
            fut = backing.put_async(k, p)
        else:       # NOTE: the rows are taken once the pages are in
            p = pages
            fut = copies.then(ready, lambda k=k, idx=idx: backing.put_async(k, pages[idx]))
        if tiers.recompute is not None:     # the pages' inputs go beside them
            fut, inputs = tiers.recompute.write_beside(k, slots[idx], fut)
            p = (p, inputs)
        # NOTE: the tier set keeps `p` alive with the future until the write is applied
        tiers.track_write(rid, fut, k, p)
