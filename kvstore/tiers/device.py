"""DeviceTier: the KV pages attention reads from.

On CUDA the slot pool lives in GPU memory; on a CPU-only machine it is a RAM pool standing in
for HBM (same code, same invariants). See memory_pool.py for the pool, the key -> slot map and
the in-place slot API (`slots`, `alloc_slots`, `pool`).
"""
from __future__ import annotations

import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.memory_pool import MemoryPool


class DeviceTier(MemoryPool):
    """pool: [capacity_bytes // page_shape.nbytes, 2, num_kv_heads, page_size, head_dim] on
    `device`. Copies to and from other devices are stream-ordered (`non_blocking`): a caller
    passing pinned host pages must not change them before the current stream syncs."""

    def __init__(self, page_shape: PageShape, capacity_bytes: int, max_keys: int,
                 device: torch.device | str = "cpu"):
        super().__init__("device", page_shape, capacity_bytes, max_keys, device=device)
