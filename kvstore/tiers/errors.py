"""Errors raised by the KV tiers. Each carries the offending page keys (int64 tensor [n]).

The store turns them into per-request failures: `TierFull` means "choose a victim or refuse
admission", `PageMissing` is a bookkeeping bug, `PageCorrupted` and `TierIOError` fail the
requests owning those keys while the server keeps serving.
"""
from __future__ import annotations

from typing import Iterable

import torch


def _as_keys(keys: Iterable[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(keys, torch.Tensor):
        return keys.detach().to("cpu", torch.int64).reshape(-1)
    return torch.as_tensor(list(keys), dtype=torch.int64)


def _preview(keys: torch.Tensor, limit: int = 8) -> str:
    shown = ", ".join(str(int(k)) for k in keys[:limit])
    more = f", ... ({keys.numel()} keys)" if keys.numel() > limit else ""
    return f"[{shown}{more}]"


class TierError(Exception):
    """Base class. `keys`: int64 tensor [n] of the page keys the error is about."""

    def __init__(self, tier: str, keys, message: str):
        self.tier = tier
        self.keys = _as_keys(keys)
        super().__init__(f"{tier} tier: {message} (keys {_preview(self.keys)})")

    def rekey(self, keys) -> None:
        """Name other keys for the same pages (a disk tier of member tiers names its own),
        in the message too."""
        self.keys = _as_keys(keys)
        head = str(self.args[0]).rsplit(" (keys ", 1)[0]
        self.args = (f"{head} (keys {_preview(self.keys)})", *self.args[1:])


class TierFull(TierError):
    """Not enough free room for the pages (or for a disk reservation). Tiers never evict on
    their own: the residency policy picks victims and calls `delete`."""

    def __init__(self, tier: str, keys, needed_bytes: int, free_bytes: int, hint: str = ""):
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        msg = f"needs {needed_bytes} bytes, {free_bytes} free"
        super().__init__(tier, keys, msg + (f"; {hint}" if hint else ""))


class PageMissing(TierError, KeyError):
    """`get` of keys the tier does not hold (or, on disk, keys not bound to a request)."""

    def __init__(self, tier: str, keys, message: str = "pages not stored"):
        super().__init__(tier, keys, message)

    def __str__(self) -> str:  # NOTE: KeyError would otherwise repr() the message
        return self.args[0]


class PageCorrupted(TierError):
    """Pages read back from disk whose checksum differs from the one computed at write."""

    def __init__(self, tier: str, keys):
        super().__init__(tier, keys, "checksum mismatch on read: page corrupted on disk")


class TierIOError(TierError):
    """An OSError (EIO, ENOSPC, short read, ...) while reading or writing the keys' pages.
    `errno` is the OS error number (None for a short read)."""

    def __init__(self, tier: str, keys, errno: int | None, message: str):
        self.errno = errno
        super().__init__(tier, keys, message)
