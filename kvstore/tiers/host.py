"""HostTier: KV pages in DRAM, between the device pool and the disk.

The pool is page-locked (pinned) when CUDA is available, so host <-> device copies are DMA and
can overlap compute; on CPU-only machines it is plain memory. See memory_pool.py.

With a codec (`--kv-tier-codec int8|int4`, kvstore/tiers/codec.py) a slot holds a page's codes
and then its (scale, min) meta instead of the page: a page is encoded when it enters the tier
(a demotion from the device, a backing write) and decoded where it leaves it (a fill into
device slots, or a staging buffer on a GPU), by the codec's C kernels between page addresses:
the same DRAM holds 1.9x (int8) or 3.6x (int4) the pages, at the codec's error for pages
read back from this tier.
"""
from __future__ import annotations

import numpy as np
import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.codec import PageCodec
from kvstore.tiers.memory_pool import MemoryPool


class HostTier(MemoryPool):
    """pool: [capacity_bytes // page_shape.nbytes, 2, num_kv_heads, page_size, head_dim] on CPU,
    4096-aligned slots when the page size allows (the disk tier reads straight into them); with
    a codec, uint8 [capacity_bytes // slot bytes, code_bytes + meta_bytes]."""

    def __init__(self, page_shape: PageShape, capacity_bytes: int, max_keys: int,
                 pin_memory: bool | None = None, codec: PageCodec | None = None):
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.codec = codec
        slot = None if codec is None else codec.code_bytes + codec.meta_bytes
        super().__init__("host", page_shape, capacity_bytes, max_keys, device="cpu",
                         pin_memory=pin_memory, slot_bytes=slot)

    # -- pages in and out of slots ------------------------------------------------------------

    def store_from(self, src: torch.Tensor, src_slots: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
        if self.codec is None:
            return super().store_from(src, src_slots, dst_slots)
        pages = self._page_addrs(src, src_slots)
        codes = self._slot_addrs(dst_slots)
        self.codec.encode(pages, codes, codes + np.uint64(self.codec.code_bytes))

    def load_into(self, dst: torch.Tensor, dst_slots: torch.Tensor,
                  src_slots: torch.Tensor) -> None:
        if self.codec is None:
            return super().load_into(dst, dst_slots, src_slots)
        pages = self._page_addrs(dst, dst_slots)
        codes = self._slot_addrs(src_slots)
        # NOTE: the C kernel runs the best path this CPU has
        self.codec.decode(codes, codes + np.uint64(self.codec.code_bytes), pages)

    def _slot_addrs(self, slots: torch.Tensor) -> np.ndarray:
        s = _checked(slots, self.num_slots, "host tier slots")
        return np.uint64(self._pool.data_ptr()) + s.astype(np.uint64) * np.uint64(self.page_bytes)

    def _page_addrs(self, pool: torch.Tensor, slots: torch.Tensor) -> np.ndarray:
        """Addresses of pool[slots] (a contiguous CPU page pool of this page shape)."""
        if pool.device.type != "cpu" or not pool.is_contiguous() \
                or pool.dtype != self.page_shape.dtype \
                or tuple(pool.shape[1:]) != self.page_shape.shape:
            raise ValueError(f"host tier codec: pages must be a contiguous CPU "
                             f"{self.page_shape.dtype} pool [n, {self.page_shape.shape}], got "
                             f"{pool.dtype} {tuple(pool.shape)} on {pool.device}")
        s = _checked(slots, pool.shape[0], "page slots")
        row = self.page_shape.nbytes
        return np.uint64(pool.data_ptr()) + s.astype(np.uint64) * np.uint64(row)

    # -- Tier interface -------------------------------------------------------------------------

    def put(self, keys: torch.Tensor, pages: torch.Tensor) -> None:
        if self.codec is None:
            return super().put(keys, pages)
        self._check_pages(pages, torch.as_tensor(keys).numel(), "pages")
        slots = self.alloc_slots(keys)
        src = pages.detach().to("cpu").contiguous()
        self.store_from(src, torch.arange(src.shape[0]), slots)

    def get(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        if self.codec is None:
            return super().get(keys, out)
        slots = self._slots_to_read(keys, out)
        direct = out.device.type == "cpu" and out.is_contiguous()
        dst = out if direct else torch.empty(out.shape, dtype=out.dtype)
        self.load_into(dst, torch.arange(slots.numel()), slots)
        if not direct:
            out.copy_(dst)


def _checked(slots: torch.Tensor, n: int, what: str) -> np.ndarray:
    s = torch.as_tensor(slots).to(torch.int64).numpy()
    if s.size and (s.min() < 0 or s.max() >= n):
        raise IndexError(f"{what} out of range [0, {n}): {s.min()}..{s.max()}")
    return s
