"""Placement: where a request's pages sit once its prompt is computed.

Recency (the default, ARCHITECTURE.md "placement"): per layer, the sink pages and the most
recent pages stay on the device tier, the next most recent start on the host tier, the rest
live only in the backing tiers. Each request gets an equal share of each tier
(capacity / max_num_seqs). KVDrive's importance-guided warm-up plugs in here.
"""
from __future__ import annotations

import torch


class RecencyPlacement:
    def place(self, tiers, page_ids: tuple[int, ...], cfg) -> None:
        """The pages of one request whose prompt is computed, over the tier set `tiers`
        (kvstore.tierset.TierSet: placement is one of its movers)."""
        if not page_ids:
            return
        L = tiers.num_layers
        n = len(page_ids)
        sink = min(cfg.sink_pages, n)
        order = list(range(sink)) + list(range(n - 1, sink - 1, -1))   # sinks, then newest first
        dev_quota = max(1, tiers.device_tier.capacity_pages // (cfg.max_num_seqs * L))
        host = tiers.host_tier
        host_quota = host.capacity_pages // (cfg.max_num_seqs * L) if tiers.host_is_cache else 0
        pids = torch.tensor(page_ids, dtype=torch.int64)
        hot = pids[torch.tensor(order[:dev_quota], dtype=torch.int64)]
        warm = pids[torch.tensor(order[dev_quota:dev_quota + host_quota], dtype=torch.int64)]
        cold = pids[torch.tensor(order[dev_quota:], dtype=torch.int64)]
        dev = tiers.device_tier
        # hot pages: most recently used on the device; cold ones: first to be evicted
        hot_keys = tiers.keys_of(hot)
        hot_slots = dev.slots(hot_keys)
        on = hot_slots >= 0
        tiers.residency.touch(hot_slots[on], tiers.clock_of(hot_keys[on]))
        tiers.residency.age(_present(dev, tiers.keys_of(cold)))
        if warm.numel():
            # warm pages resident on the device start on host too, so eviction is free later
            keys = tiers.keys_of(warm)
            slots = dev.slots(keys)
            ok = (slots >= 0) & ~host.contains(keys)
            k = min(int(ok.sum()), host.num_free)
            if k:
                sel = ok.nonzero().squeeze(1)[:k]
                host.put(keys[sel], dev.pool[slots[sel].long()])
                tiers.host_residency.touch(host.slots(keys[sel]), tiers.clock_of(keys[sel]))
                tiers.stats.add_transfer("device", "host", k * tiers.page_shape.nbytes)


def _present(tier, keys: torch.Tensor) -> torch.Tensor:
    slots = tier.slots(keys)
    return slots[slots >= 0]
