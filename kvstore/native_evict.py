"""The device tier's eviction pass in C without the GIL (kvstore/_evict.c), for the stock
residency policies (`cycle`, `lru`, `score`): victims, their demotion to the host tier with host
admission, and both tiers' slot maps, in one call.

The torch path (Fetcher._evictable, the policy's `victims`, Fetcher.evict_device) is the
reference and serves any other policy. It is ~60 small ops a pass, each handing the GIL back and
forth with the engine thread's decode when the pipeline's resolve thread evicts (~30 passes a
step on bench/pipeline.py): 1.36 against 0.17 ms a pass in C at that benchmark's tier sizes
(bench/evict_pass.py).
"""
from __future__ import annotations

import torch

from kvstore import _evict
from kvstore.residency import CycleResidency, LRUResidency, ScoreResidency

_KINDS = {CycleResidency: 1, LRUResidency: 0, ScoreResidency: 2}


def serves(tiers) -> bool:
    """Whether the C pass implements the tier set's residency policies."""
    return type(tiers.residency) in _KINDS and (
        not tiers.host_is_cache or type(tiers.host_residency) in _KINDS)


def _tier(tier, pinned: torch.Tensor, policy) -> tuple:
    stamps = policy.last_used
    if stamps.dtype != torch.int64 or not stamps.is_contiguous() or \
            stamps.numel() != tier.num_slots or pinned.dtype != torch.bool or \
            not pinned.is_contiguous() or pinned.numel() != tier.num_slots:
        raise ValueError(f"{tier.name} tier: residency stamps or pins do not match its slots")
    slot_of, key_of, free, n, top = tier.maps()
    return (slot_of, key_of, free, pinned.data_ptr(), stamps.data_ptr(), n, top,
            _KINDS[type(policy)], getattr(policy, "period", 0))


class NativeEviction:
    """The C pass over one tier set's tiers (its scratch allocated once)."""

    def __init__(self, tiers):
        self.tiers = tiers
        dev, host = tiers.device_tier, tiers.host_tier
        words = _evict.scratch_words(dev.num_slots, host.num_slots if host else 0)
        self.scratch = torch.zeros(words, dtype=torch.int64).numpy()

    def evict(self, want: int, protect: torch.Tensor, need: int = 0) -> bool:
        """Fetcher._evict in C (`serves` must hold). Only the thread that resolves calls it."""
        tiers = self.tiers
        dev, host = tiers.device_tier, tiers.host_tier
        cache = tiers.host_is_cache
        keys = torch.as_tensor(protect).to("cpu", torch.int64).contiguous()
        if tiers.clean.dtype != torch.bool or tiers.clean.numel() != dev.max_keys:
            raise ValueError("the tier set's clean mask does not match the tiers' keys")
        out = torch.empty(2 * max(want, 1), dtype=torch.int64)
        n_dev, dev_free, n_host, host_free, k = _evict.evict_pass(
            _tier(dev, tiers.device_pinned, tiers.residency),
            _tier(host, tiers.host_pinned, tiers.host_residency) if cache else None,
            tiers.clean.data_ptr(), tiers.clean.numel(), keys.numpy(), want, need,
            tiers.clock_now, out.numpy(), self.scratch)
        if n_dev == 0:
            return need == 0
        dev.set_num_free(dev_free)
        if cache:
            host.set_num_free(host_free)
            if n_host:
                tiers.stats.count("evictions", "host", n_host)
            if k:
                tiers.demotions.append((out[:k], out[want:want + k]))
                tiers.stats.add_transfer("device", "host", k * host.page_bytes)
        tiers.stats.count("evictions", "device", n_dev)
        return True
