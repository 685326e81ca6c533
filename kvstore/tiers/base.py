"""The one batched interface behind the device, host and disk KV tiers.

A KV *page* is `page_size` tokens x all KV heads x K and V of ONE layer of one request:
a tensor [2, num_kv_heads, page_size, head_dim] in the KV dtype (K at index 0, V at 1), i.e.
FlashInfer's "HND" layout: one KV head's K (or V) of a page is one contiguous run of
page_size * head_dim values, which is what per-head sparse attention gathers.

A page *key* is a flat int64: `key = layer * max_pages + page_id`, where `page_id` is the
logical page id from `PageAllocator` and `max_pages` its capacity, so keys live in
[0, num_layers * max_pages) =: [0, max_keys). Every method takes keys as an int64 tensor [n]
(batched everywhere); pages move as one tensor [n, 2, num_kv_heads, page_size, head_dim].

Invariants shared by every tier (pinned by tests/test_tiers.py):
- `put` overwrites existing keys and never evicts: it raises `TierFull` (storing nothing)
  when the new keys do not fit. The residency policy chooses victims and calls `delete`.
- `get` is bit-exact with what was `put`; absent keys raise `PageMissing` (nothing copied).
- `delete` ignores absent keys. `used_bytes == num_pages * page bytes` for the memory tiers;
  the disk tier reports the bytes reserved by registered requests (see disk.py).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

ALIGN = 4096  # NOTE: O_DIRECT alignment (file offsets, lengths and buffer addresses)


def round_up(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class PageShape:
    """Geometry of one KV page: [2, num_kv_heads, page_size, head_dim] of `dtype` (HND)."""

    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self):
        if min(self.page_size, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"PageShape needs positive sizes, got {self}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def numel(self) -> int:
        return 2 * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes_aligned(self) -> int:
        """Bytes of one page rounded up to the 4096-byte O_DIRECT alignment (disk stride)."""
        return round_up(self.nbytes)


class Tier(abc.ABC):
    """A byte-budgeted store of KV pages addressed by int64 keys (see the module docstring).

    Not thread-safe: the engine's step loop is the only caller (the disk tier's async I/O is
    internal and documented there).
    """

    name: str  # "device" | "host" | "disk"
    page_shape: PageShape

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """The byte budget this tier was built with."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes taken from the budget now."""

    @property
    @abc.abstractmethod
    def capacity_pages(self) -> int:
        """Most pages the tier can hold at once."""

    @property
    @abc.abstractmethod
    def num_pages(self) -> int:
        """Pages stored now."""

    @abc.abstractmethod
    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """keys: int64 [n] -> bool [n] (CPU), True where the page is stored."""

    @abc.abstractmethod
    def put(self, keys: torch.Tensor, pages: torch.Tensor) -> None:
        """Store pages [n, 2, kvh, ps, hd] under keys [n]; overwrite existing keys.
        Raises `TierFull` (storing nothing) when the new keys do not fit."""

    @abc.abstractmethod
    def get(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the pages of keys [n] into out [n, 2, kvh, ps, hd].
        Raises `PageMissing` for absent keys (then nothing is copied)."""

    @abc.abstractmethod
    def delete(self, keys: torch.Tensor) -> None:
        """Drop the pages of keys [n]; absent keys are ignored."""

    @abc.abstractmethod
    def keys(self) -> torch.Tensor:
        """int64 [num_pages] (CPU) of the stored keys, in no particular order."""

    # -- shared argument checks -------------------------------------------------------------

    def _check_keys(self, keys: torch.Tensor, max_keys: int) -> torch.Tensor:
        """Validate keys [n] and return them as a contiguous CPU int64 tensor."""
        keys = torch.as_tensor(keys)
        if keys.dim() != 1 or keys.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{self.name} tier: keys must be an int64 tensor [n], "
                             f"got {keys.dtype} {tuple(keys.shape)}")
        keys = keys.to("cpu", torch.int64).contiguous()
        if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= max_keys):
            bad = keys[(keys < 0) | (keys >= max_keys)]
            raise ValueError(f"{self.name} tier: keys outside [0, {max_keys}): "
                             f"{bad[:8].tolist()}")
        return keys

    def _check_pages(self, pages: torch.Tensor, n: int, what: str) -> None:
        want = (n, *self.page_shape.shape)
        if tuple(pages.shape) != want or pages.dtype != self.page_shape.dtype:
            raise ValueError(f"{self.name} tier: {what} must be {self.page_shape.dtype} {want}, "
                             f"got {pages.dtype} {tuple(pages.shape)}")


def page_rows(pages: torch.Tensor) -> torch.Tensor:
    """[n, 2, kvh, ps, hd] (contiguous) -> [n, words]: one row per page, as int64 words when
    the page's bytes allow. NOTE: row copies (index_select / index_copy_) of that 2-D view ran
    ~1.5x faster than of the 5-D tensor on our CPU."""
    flat = pages.view(pages.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 8 == 0:
        return flat.view(torch.int64)
    return flat
