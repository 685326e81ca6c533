"""DiskMembers: a disk tier made of member disk tiers, each holding a part of the keys.

Two shapes build on it: DiskSet (disk_set.py: pages striped over folders, one per drive) and
DiskLayers (disk_layers.py: some layers' pages as codec codes, the others as they are). Both
are a DiskTier to their callers. This base owns what they share: the counters (sums over the
members), the fault hook, closing, and the page I/O, which a subclass routes by `_parts`
(which member holds which of a batch's keys, under which of its own keys): every member's
share is submitted before any is waited on, and one Future joins them.
"""
from __future__ import annotations

import abc
import threading
from concurrent.futures import Future

import numpy as np
import torch

from kvstore.tiers.base import Tier
from kvstore.tiers.errors import TierError
from kvstore.tiers.staging import read_via_buffer


class DiskMembers(Tier):
    name = "disk"
    members: list            # DiskTier (or DiskSet) members
    max_keys: int

    # -- routing (the subclass's) -----------------------------------------------------------
    @abc.abstractmethod
    def _parts(self, keys: np.ndarray):
        """(member index, bool mask over keys, the member's keys for keys[mask]) per member
        holding some of `keys` (keys no member holds are left out)."""

    def _global_keys(self, member: int, keys: torch.Tensor) -> torch.Tensor:
        """Member `member`'s keys as the set's (what a member's TierError names)."""
        return keys

    def _check_bound(self, keys: np.ndarray) -> None:
        """Raise PageMissing, before any I/O, for keys no member can hold now."""

    # -- sizes and counters (sums over the members) ----------------------------------------
    def _sum(self, attr: str) -> int:
        return sum(getattr(m, attr) for m in self.members)

    used_bytes = property(lambda self: self._sum("used_bytes"))
    num_pages = property(lambda self: self._sum("num_pages"))
    stored_bytes = property(lambda self: self._sum("stored_bytes"))
    preadv_calls = property(lambda self: self._sum("preadv_calls"))
    pwritev_calls = property(lambda self: self._sum("pwritev_calls"))
    bytes_read = property(lambda self: self._sum("bytes_read"))
    bytes_written = property(lambda self: self._sum("bytes_written"))
    direct_io = property(lambda self: all(m.direct_io for m in self.members))

    def per_path(self) -> dict[str, dict[str, int]]:
        """Bytes read and written so far, per folder."""
        out = {}
        for m in self.members:
            out.update(m.per_path())
        return out

    @property
    def fault(self):
        return self.members[0].fault

    @fault.setter
    def fault(self, fault) -> None:
        for m in self.members:
            m.fault = fault

    # -- lifecycle shared by every member ----------------------------------------------------
    def release_request(self, request_handle: int) -> None:
        for m in self.members:
            m.release_request(request_handle)

    def finish_restore(self) -> None:
        for m in self.members:
            m.finish_restore()

    @property
    def next_handle(self) -> int:
        return max(m.next_handle for m in self.members)

    def close(self) -> None:
        errors = []
        for m in self.members:
            try:
                m.close()
            except BaseException as exc:       # noqa: BLE001 - close every member first
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- Tier interface ---------------------------------------------------------------------
    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        k = self._check_keys(keys, self.max_keys).numpy()
        out = np.zeros(k.shape[0], bool)
        for i, part, mk in self._parts(k):
            out[part] = self.members[i].contains(torch.from_numpy(mk)).numpy()
        return torch.from_numpy(out)

    def delete(self, keys: torch.Tensor) -> None:
        k = self._check_keys(keys, self.max_keys).numpy()
        for i, _, mk in self._parts(k):
            self.members[i].delete(torch.from_numpy(mk))

    def put(self, keys: torch.Tensor, pages: torch.Tensor) -> None:
        self.put_async(keys, pages).result()

    def get(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        self.get_async(keys, out).result()

    def put_async(self, keys: torch.Tensor, pages: torch.Tensor) -> Future:
        k = self._check_keys(keys, self.max_keys).numpy()
        self._check_pages(pages, k.shape[0], "pages")
        src = pages.detach().to("cpu").contiguous()
        return self._fan_out(k, lambda m, part, mk: m.put_async(
            torch.from_numpy(mk), src[torch.from_numpy(np.flatnonzero(part))]))

    def get_async(self, keys: torch.Tensor, out: torch.Tensor) -> Future:
        k = self._check_keys(keys, self.max_keys).numpy()
        self._check_pages(out, k.shape[0], "out")
        rows = torch.arange(k.shape[0])
        if out.device.type == "cpu" and out.is_contiguous():
            return self.get_into(torch.from_numpy(k), out, rows)
        return read_via_buffer(out, lambda tmp: self.get_into(torch.from_numpy(k), tmp, rows))

    def get_into(self, keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> Future:
        k = self._check_keys(keys, self.max_keys).numpy()
        slots = torch.as_tensor(slots).to("cpu", torch.int64)
        return self._fan_out(k, lambda m, part, mk: m.get_into(
            torch.from_numpy(mk), pool, slots[torch.from_numpy(part)]))

    def put_from(self, keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> Future:
        k = self._check_keys(keys, self.max_keys).numpy()
        slots = torch.as_tensor(slots).to("cpu", torch.int64)
        return self._fan_out(k, lambda m, part, mk: m.put_from(
            torch.from_numpy(mk), pool, slots[torch.from_numpy(part)]))

    def _fan_out(self, keys: np.ndarray, start) -> Future:
        """start(member, mask, member keys) for each member's share of `keys`, all submitted
        before any is waited on; one Future for all (the first error, once every share is
        done)."""
        self._check_bound(keys)
        futures = []
        for i, part, mk in self._parts(keys):
            try:
                futures.append((i, start(self.members[i], part, mk)))
            except BaseException as exc:
                for _, f in futures:            # what was submitted runs to its end
                    f.exception()
                if isinstance(exc, TierError):
                    exc.rekey(self._global_keys(i, exc.keys))
                raise
        return joined(futures, self._global_keys)


def joined(futures: list[tuple[int, Future]], global_keys) -> Future:
    """A Future done when all (member, future) are: the first one's error (naming the set's
    keys: global_keys(member, keys)), else None."""
    out: Future = Future()
    if not futures:
        out.set_result(None)
        return out
    left, lock = [len(futures)], threading.Lock()

    def one(_: Future) -> None:
        with lock:                  # the members' I/O threads finish their shares
            left[0] -= 1
            last = left[0] == 0
        if last:
            errors = []
            for i, f in futures:
                exc = f.exception()
                if exc is not None:
                    if isinstance(exc, TierError):
                        exc.rekey(global_keys(i, exc.keys))
                    errors.append(exc)
            if errors:
                first = errors[0]
                if len(errors) > 1 and all(isinstance(e, TierError) for e in errors):
                    # every member's failed pages, so the fill loses them all at once
                    first.rekey(torch.cat([e.keys for e in errors]))
                out.set_exception(first)
            else:
                out.set_result(None)
    for _, f in futures:
        f.add_done_callback(one)
    return out
