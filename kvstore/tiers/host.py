"""HostTier: KV pages in DRAM, between the device pool and the disk.

The pool is page-locked (pinned) when CUDA is available, so host <-> device copies are DMA and
can overlap compute; on CPU-only machines it is plain memory. See memory_pool.py.
"""
from __future__ import annotations

import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.memory_pool import MemoryPool


class HostTier(MemoryPool):
    """pool: [capacity_bytes // page_shape.nbytes, 2, num_kv_heads, page_size, head_dim] on CPU,
    4096-aligned slots when the page size allows (the disk tier reads straight into them)."""

    def __init__(self, page_shape: PageShape, capacity_bytes: int, max_keys: int,
                 pin_memory: bool | None = None):
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__("host", page_shape, capacity_bytes, max_keys, device="cpu",
                         pin_memory=pin_memory)
