"""Placement: where a request's pages sit once its prompt is computed.

Each request gets an equal share of each memory tier (capacity / max_num_seqs): its quota of
device slots per layer, and of host slots when the host tier is a cache. The pages within the
device quota stay there and count as just used; the next ones are copied to the host tier too
(so their eviction costs no copy); the rest are the first the device gives up, living on in the
backing tiers. Which pages come first is the policy's (ARCHITECTURE.md "placement",
--kv-placement):

- `recency` (the default): per layer, the sink pages, then the newest.
- `mass` (KVDrive's importance-guided warm-up): the pages that decode will certainly read
  first (every page of the dense layers, sinks and the newest `local` pages), then the rest by
  the attention mass the prompt's observation window gave them (summed over a page's KV heads:
  the prior sparse decode selects its first pages by, kvstore/step.py), across layers: a
  request's quota over all layers goes to its heaviest pages wherever they are. Without a
  prior (no observation window) it places as `recency` does.
"""
from __future__ import annotations

import torch

from kvstore.config import PLACEMENTS


class RecencyPlacement:
    def place(self, tiers, page_ids: tuple[int, ...], cfg,
              prior: torch.Tensor | None = None) -> None:
        """The pages of one request whose prompt is computed, over the tier set `tiers`
        (kvstore.tierset.TierSet: placement is one of its movers). `prior`: the request's
        observation-window mass [layers, pages, KVH] (or None)."""
        if not page_ids:
            return
        n = len(page_ids)
        sink = min(cfg.sink_pages, n)
        order = list(range(sink)) + list(range(n - 1, sink - 1, -1))   # sinks, then newest first
        dev_quota, host_quota = _quotas(tiers, cfg)
        pids = torch.tensor(page_ids, dtype=torch.int64)
        ranked = pids[torch.tensor(order, dtype=torch.int64)]
        # layer-major keys of the first `a:b` pages of every layer
        _apply(tiers, tiers.keys_of(ranked[:dev_quota]),
               tiers.keys_of(ranked[dev_quota:dev_quota + host_quota]),
               tiers.keys_of(ranked[dev_quota:]))


class MassPlacement(RecencyPlacement):
    def place(self, tiers, page_ids: tuple[int, ...], cfg,
              prior: torch.Tensor | None = None) -> None:
        n = len(page_ids)
        if not n or prior is None:
            return super().place(tiers, page_ids, cfg, prior)
        L = tiers.num_layers
        weight = prior[:, :n].float().nan_to_num(0.0, 0.0, 0.0).clamp(min=0).sum(-1)  # [L, n]
        weight = weight / weight.max().clamp(min=1e-30)                   # in [0, 1]
        sure = torch.zeros(L, n, dtype=torch.bool)
        sure[:min(cfg.dense_layers, L)] = True
        sure[:, :min(cfg.sink_pages, n)] = True
        sure[:, max(0, n - cfg.local_pages):] = True
        # certain pages first (dense layers before the others: read first in a step), then
        # by mass; ties (no mass) newest first
        layer_rank = torch.arange(L, dtype=torch.float32)[:, None].expand(L, n)
        score = torch.where(sure, 2.0 + 1.0 / (1.0 + layer_rank), weight).flip(1).reshape(-1)
        # stable on pages newest first (flipped), so equal scores keep the newest first
        order = torch.argsort(score, descending=True, stable=True)
        order = (order // n) * n + (n - 1 - order % n)            # back to page order
        dev_quota, host_quota = _quotas(tiers, cfg)
        pids = torch.tensor(page_ids, dtype=torch.int64)
        keys = (torch.arange(L, dtype=torch.int64)[:, None] * tiers.max_pages
                + pids[None, :]).reshape(-1)[order]
        d, h = dev_quota * L, host_quota * L
        _apply(tiers, keys[:d], keys[d:d + h], keys[d:])


def make_placement(name: str) -> RecencyPlacement:
    if name == "recency":
        return RecencyPlacement()
    if name == "mass":
        return MassPlacement()
    raise ValueError(f"--kv-placement must be one of {', '.join(PLACEMENTS)}, got {name!r}")


def _quotas(tiers, cfg) -> tuple[int, int]:
    """A request's device and host slots per layer."""
    per = cfg.max_num_seqs * tiers.num_layers
    dev = max(1, tiers.device_tier.capacity_pages // per)
    host = tiers.host_tier.capacity_pages // per if tiers.host_is_cache else 0
    return dev, host


def _apply(tiers, hot: torch.Tensor, warm: torch.Tensor, cold: torch.Tensor) -> None:
    """hot keys: most recently used on the device; warm: copied to the host tier too, so that
    their eviction is free later; cold: the first the device evicts."""
    dev = tiers.device_tier
    hot_slots = dev.slots(hot)
    on = hot_slots >= 0
    tiers.residency.touch(hot_slots[on], tiers.clock_of(hot[on]))
    tiers.residency.age(_present(dev, cold))
    if warm.numel():
        host = tiers.host_tier
        slots = dev.slots(warm)
        ok = (slots >= 0) & ~host.contains(warm)
        k = min(int(ok.sum()), host.num_free)
        if k:
            sel = ok.nonzero().squeeze(1)[:k]
            host.put(warm[sel], dev.pool[slots[sel].long()])
            tiers.host_residency.touch(host.slots(warm[sel]), tiers.clock_of(warm[sel]))
            tiers.stats.add_transfer("device", "host", k * host.page_bytes)


def _present(tier, keys: torch.Tensor) -> torch.Tensor:
    slots = tier.slots(keys)
    return slots[slots >= 0]
