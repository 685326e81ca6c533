"""MemoryPool: a preallocated slot pool of KV pages; the implementation of the device and host
tiers (device.py and host.py only choose where the memory lives).

Memory: `pool` [num_slots, 2, num_kv_heads, page_size, head_dim], allocated ONCE at start-up and
pre-touched (zero-filled), 4096-byte aligned at its base; every slot is 4096-aligned too when
the page size in bytes is a multiple of 4096 (so the disk tier can O_DIRECT-read into slots).

Bookkeeping (all CPU tensors, so a batch of keys is a handful of vectorized ops, no Python loop):
- `_slot_of`  int32 [max_keys]  key -> slot, -1 when absent
- `_key_of`   int64 [num_slots] slot -> key, -1 when free
- `_free`     int32 [num_slots] free-slot stack; `_free[:_top]` are the free slots
Invariants: `_slot_of[k] == s  <=>  _key_of[s] == k`; free slots are exactly the slots with
`_key_of == -1`; `num_pages + num_free == num_slots`.

NOTE: why a dense tensor map and not a dict: for batches of 64-4096 keys a gather
`_slot_of[keys]` costs a few microseconds, while a dict costs ~100 ns per key in a Python loop
plus building a tensor of the result (~0.5 ms for 4096 keys). The price is 4 bytes per possible
key (`max_keys = num_layers * max_pages`: 30 layers x 64K pages = 7.5 MiB).
"""
from __future__ import annotations

import weakref

import torch

from kvstore.tiers import _pageio
from kvstore.tiers.base import ALIGN, PageShape, Tier, page_rows
from kvstore.tiers.errors import PageMissing, TierFull


def aligned_zeros(nbytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """A pre-touched (zero-filled) uint8 tensor [nbytes] whose data starts 4096-aligned.

    Allocates `nbytes + ALIGN` bytes and slices at the first aligned offset; the slice keeps
    the whole buffer alive. `pin`: register the host buffer with CUDA (page-locked) in place,
    so no power-of-two rounding of the pinned caching allocator applies.
    """
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device)
    offset = (-raw.data_ptr()) % ALIGN
    buf = raw[offset:offset + nbytes]
    buf.zero_()
    if pin and nbytes:
        _register_pinned(buf)
    return buf


def _register_pinned(buf: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    ptr, size = buf.data_ptr(), buf.numel()
    err = int(cudart.cudaHostRegister(ptr, size, 1))  # NOTE: 1 = cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"host tier: cudaHostRegister of {size} bytes failed (cudaError "
                           f"{err}); lower --kv-host-gb or raise the locked-memory limit")
    weakref.finalize(buf.untyped_storage(), cudart.cudaHostUnregister, ptr)


def copy_pages(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
               src_slots: torch.Tensor) -> None:
    """dst[dst_slots] = src[src_slots] between two slot pools in host memory, [S, 2, kvh, ps,
    hd] of one page shape: one memcpy per page in C, without the GIL (slots checked there).
    NOTE: torch needs index_select into a buffer and index_copy_ out of it, two copies of
    every page; the fetch stage's host -> device fills and the demotions of evicted device
    pages are this copy."""
    if dst.device.type != "cpu" or src.device.type != "cpu" or not dst.is_contiguous() \
            or not src.is_contiguous() or dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"copy_pages: two contiguous host pools of one page shape, got "
                         f"{dst.dtype} {tuple(dst.shape)} on {dst.device} and {src.dtype} "
                         f"{tuple(src.shape)} on {src.device}")
    nbytes = dst[0].numel() * dst.element_size() if dst.shape[0] else 0
    _pageio.copy_pages(dst.data_ptr(), dst.shape[0], src.data_ptr(), src.shape[0], nbytes,
                       dst_slots.to(torch.int64).numpy(), src_slots.to(torch.int64).numpy())


class MemoryPool(Tier):
    """A Tier over a preallocated slot pool (see module docstring).

    Beyond the Tier interface, attention and fetches use slots in place:
    `slots(keys)` -> int32 [n] (-1 when absent), `alloc_slots(keys)` reserves slots for keys
    about to be written in place (e.g. `pool.index_copy_(0, slots, fetched)`), and `pool` is
    the tensor itself.
    """

    def __init__(self, name: str, page_shape: PageShape, capacity_bytes: int, max_keys: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 slot_bytes: int | None = None):
        """slot_bytes: a slot's bytes when pages are stored otherwise than as they are (a
        codec's): the pool is then uint8 [num_slots, slot_bytes], its reading the subclass's."""
        if capacity_bytes < 0 or max_keys <= 0:
            raise ValueError(f"{name} tier: capacity_bytes must be >= 0 and max_keys > 0, "
                             f"got {capacity_bytes} and {max_keys}")
        self.name = name
        self.page_shape = page_shape
        self.device = torch.device(device)
        self.max_keys = int(max_keys)
        self._capacity_bytes = int(capacity_bytes)
        nbytes = slot_bytes or page_shape.nbytes
        self.page_bytes = nbytes                # bytes a page takes in this tier
        self.num_slots = self._capacity_bytes // nbytes
        buf = aligned_zeros(self.num_slots * nbytes, self.device, pin=pin_memory)
        # [num_slots, 2, num_kv_heads, page_size, head_dim] (or [num_slots, slot_bytes])
        self._pool = buf.view(self.num_slots, nbytes) if slot_bytes else \
            buf.view(page_shape.dtype).view(self.num_slots, *page_shape.shape)
        self._slot_of = torch.full((self.max_keys,), -1, dtype=torch.int32)
        self._key_of = torch.full((self.num_slots,), -1, dtype=torch.int64)
        self._free = torch.arange(self.num_slots - 1, -1, -1, dtype=torch.int32)
        self._top = self.num_slots

    # -- sizes ------------------------------------------------------------------------------

    @property
    def pool(self) -> torch.Tensor:
        """The slot pool [num_slots, 2, num_kv_heads, page_size, head_dim] (read in place)."""
        return self._pool

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def capacity_pages(self) -> int:
        return self.num_slots

    @property
    def num_pages(self) -> int:
        return self.num_slots - self._top

    @property
    def slot_keys(self) -> torch.Tensor:
        """int64 [num_slots]: the key stored in each slot, -1 for free slots (read-only view)."""
        return self._key_of

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def used_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    # -- slots ------------------------------------------------------------------------------

    def slots(self, keys: torch.Tensor) -> torch.Tensor:
        """keys int64 [n] -> int32 [n] slot of each key in `pool`, -1 where absent."""
        return self._slot_of[self._check_keys(keys, self.max_keys)]

    def alloc_slots(self, keys: torch.Tensor) -> torch.Tensor:
        """Reserve slots for keys [n] about to be written in place; keys already stored keep
        their slot. Returns int32 [n]. Raises TierFull (reserving nothing) if the absent keys
        do not fit. A key repeated in the batch gets one slot."""
        keys = self._check_keys(keys, self.max_keys)
        slots = self._slot_of[keys]
        absent = slots < 0
        if not bool(absent.any()):
            return slots
        new_keys = keys[absent]
        if new_keys.numel() > self._top:
            new_keys = torch.unique(new_keys)  # NOTE: only pay for dedup when it matters
            if new_keys.numel() > self._top:
                nb = self.page_bytes
                raise TierFull(self.name, new_keys, new_keys.numel() * nb, self._top * nb,
                               hint="delete (evict) pages first or raise the tier's budget")
        n = new_keys.numel()
        # the top of the stack first: a fresh pool hands out ascending slots, so a request's
        # pages, written in token order, lie in ascending addresses, which the attention
        # kernel streams faster than descending ones (docs/perf-notes.md, 2026-11-27)
        new_slots = self._free[self._top - n:self._top].flip(0)
        self._top -= n
        self._slot_of[new_keys] = new_slots
        # NOTE: with a key repeated in new_keys, one of its slots won the scatter above; the
        # losers go back on the free stack.
        won = self._slot_of[new_keys] == new_slots
        if not bool(won.all()):
            self._push_free(new_slots[~won])
            new_keys, new_slots = new_keys[won], new_slots[won]
        self._key_of[new_slots.long()] = new_keys
        return self._slot_of[keys]

    def _push_free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        self._free[self._top:self._top + n] = slots
        self._top += n

    def maps(self) -> tuple[int, int, int, int, int]:
        """Addresses of the slot maps and the free stack, the slot count and the free count,
        for bookkeeping in C (kvstore/_evict.c), which updates them in place; it then hands the
        new free count back through `set_num_free`."""
        return (self._slot_of.data_ptr(), self._key_of.data_ptr(), self._free.data_ptr(),
                self.num_slots, self._top)

    def set_num_free(self, n: int) -> None:
        if not 0 <= n <= self.num_slots:
            raise ValueError(f"{self.name} tier: {n} free slots of {self.num_slots}")
        self._top = n

    # -- Tier interface ---------------------------------------------------------------------

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        return self.slots(keys) >= 0

    def put(self, keys: torch.Tensor, pages: torch.Tensor) -> None:
        """pages [n, 2, kvh, ps, hd], any device: one `index_copy_` into the slots. If a key
        repeats in the batch, which of its pages is kept is unspecified."""
        self._check_pages(pages, torch.as_tensor(keys).numel(), "pages")
        slots = self.alloc_slots(keys)
        # NOTE: blocking across devices: the copy must be in before the pool is read
        src = pages.to(self.device)
        idx = slots.to(self.device, torch.int64)
        if src.is_contiguous():
            page_rows(self._pool).index_copy_(0, idx, page_rows(src))
        else:
            self._pool.index_copy_(0, idx, src)

    def get(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        """out [n, 2, kvh, ps, hd], any device: one `index_select` from the slots."""
        slots = self._slots_to_read(keys, out)
        index = slots.to(self.device, torch.int64)
        if out.device == self.device and out.is_contiguous():
            torch.index_select(self._pool, 0, index, out=out)
        else:           # NOTE: blocking: `out` holds the pages on return
            out.copy_(self._pool.index_select(0, index))

    def store_from(self, src: torch.Tensor, src_slots: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
        """pool[dst_slots] = src[src_slots]: pages of a host pool (or any contiguous CPU
        [n, 2, kvh, ps, hd]) into this tier's slots, stored as this tier stores them."""
        copy_pages(self._pool, dst_slots, src, src_slots)

    def load_into(self, dst: torch.Tensor, dst_slots: torch.Tensor,
                  src_slots: torch.Tensor) -> None:
        """dst[dst_slots] = the pages in this tier's slots src_slots (dst as in `store_from`)."""
        copy_pages(dst, dst_slots, self._pool, src_slots)

    def _slots_to_read(self, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The slots of keys [n] that `get` reads into out [n, ...]; PageMissing if any is
        absent."""
        keys = self._check_keys(keys, self.max_keys)
        self._check_pages(out, keys.numel(), "out")
        slots = self._slot_of[keys]
        missing = slots < 0
        if bool(missing.any()):
            raise PageMissing(self.name, keys[missing])
        return slots

    def delete(self, keys: torch.Tensor) -> None:
        keys = self._check_keys(keys, self.max_keys)
        slots = self._slot_of[keys]
        present = slots >= 0
        if not bool(present.any()):
            return
        freed = torch.unique(slots[present])  # NOTE: a repeated key must free its slot once
        self._slot_of[keys[present]] = -1
        self._key_of[freed.long()] = -1
        self._push_free(freed.flip(0))        # the lowest slot on top: handed out first

    def keys(self) -> torch.Tensor:
        return self._key_of[self._key_of >= 0]
