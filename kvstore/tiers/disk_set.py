"""DiskSet: the disk tier striped over several folders, one per drive (SWARM's several disks).

`--kv-disk-path A,B,...` gives one folder per drive. Each folder holds a whole DiskTier of its
own (files, locks, index logs, I/O threads: disk.py), with an equal share of `--kv-disk-gb`.
A request's page list is dealt out page by page: index i lives in member i % N at its local
index i // N, in every layer. So a run of neighbouring pages (what a step reads of a layer)
is split evenly over the drives and stays a run in each member (coalesced reads), and a page
is in one member in all its layers (its index record, checksums and restart with it).

The set is a DiskTier to its callers: the request lifecycle (register, skip, bind, unbind,
release) goes to every member with the indices translated, page I/O is split by member and
submitted to all before waiting on any (the drives' queues fill at once), and a restart joins
the members' restored pages back into whole segments. Each member's index logs carry the
namespace with the set's shape (`member_namespace`), so files written by a set of another
shape are another namespace's: left alone, never restored into the wrong member.
"""
from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from kvstore.tiers.base import PageShape, Tier
from kvstore.tiers.disk import DiskTier, RestoredPages
from kvstore.tiers.staging import read_via_buffer
from kvstore.tiers.errors import PageMissing, TierError, TierFull


def member_namespace(namespace: bytes, member: int, members: int) -> bytes:
    """The 16-byte namespace member `member` of a set of `members` folders writes."""
    return hashlib.blake2b(namespace + f"/disk-set {member} of {members}".encode(),
                           digest_size=16).digest()


def probe_stride(page_shape: PageShape, kw: dict) -> int:
    """Bytes a page takes on disk in a member (DiskLayout's stride: as DiskTier sets it)."""
    codec = kw.get("codec")
    return kw.get("stride") or (codec.stride if codec is not None else page_shape.nbytes_aligned)


def local_count(n: int, member: int, members: int) -> int:
    """How many of the indices 0 .. n-1 member `member` holds."""
    return max(0, (n - member + members - 1) // members)


class DiskSet(Tier):
    name = "disk"

    def __init__(self, page_shape: PageShape, capacity_bytes: int, paths: list[str | Path],
                 max_keys: int, num_layers: int, max_pages: int, namespace: bytes = b"",
                 **kw):
        if len(paths) < 2:
            raise ValueError("a disk set needs two or more folders (one: DiskTier)")
        if len({Path(p).resolve() for p in paths}) != len(paths):
            raise ValueError(f"--kv-disk-path lists a folder twice: {paths}")
        n = len(paths)
        self.page_shape = page_shape
        self.max_keys, self.max_pages = int(max_keys), int(max_pages)
        self.members: list[DiskTier] = []
        # NOTE: a request of `cap` pages takes ceil(cap / N) of them in its first folders:
        # each folder gets a page per layer beyond its share, so that any request the whole
        # budget holds fits; the budget itself is checked over the set (register_request)
        self._stride = probe_stride(page_shape, kw)
        self._num_layers = num_layers
        self._capacity_bytes = int(capacity_bytes)
        share = capacity_bytes // n + num_layers * self._stride
        try:
            for m, path in enumerate(paths):
                self.members.append(DiskTier(page_shape, share, path, max_keys,
                                             num_layers, max_pages,
                                             namespace=member_namespace(namespace, m, n), **kw))
        except BaseException:
            self.close()
            raise
        self.codec = self.members[0].codec
        self.layout = self.members[0].layout          # the first folder names the set
        self._member = np.full(max_pages, -1, np.int64)     # page id -> member (bound pages)

    # -- sizes and counters (sums over the members) ----------------------------------------
    def _sum(self, attr: str) -> int:
        return sum(getattr(m, attr) for m in self.members)

    capacity_bytes = property(lambda self: self._capacity_bytes)      # --kv-disk-gb
    used_bytes = property(lambda self: self._sum("used_bytes"))
    capacity_pages = property(lambda self: self._capacity_bytes // self._stride)
    num_pages = property(lambda self: self._sum("num_pages"))
    stored_bytes = property(lambda self: self._sum("stored_bytes"))
    preadv_calls = property(lambda self: self._sum("preadv_calls"))
    pwritev_calls = property(lambda self: self._sum("pwritev_calls"))
    bytes_read = property(lambda self: self._sum("bytes_read"))
    bytes_written = property(lambda self: self._sum("bytes_written"))
    page_bytes = property(lambda self: self.members[0].page_bytes)
    direct_io = property(lambda self: all(m.direct_io for m in self.members))

    def per_path(self) -> dict[str, dict[str, int]]:
        """Bytes read and written so far, per folder."""
        return {str(m.layout.root): {"bytes_read": m.bytes_read, "bytes_written": m.bytes_written,
                                     "reads": m.preadv_calls} for m in self.members}

    @property
    def fault(self):
        return self.members[0].fault

    @fault.setter
    def fault(self, fault) -> None:
        for m in self.members:
            m.fault = fault

    # -- requests ---------------------------------------------------------------------------
    def register_request(self, request_handle: int, capacity_pages_per_layer: int) -> None:
        """As DiskTier.register_request, over the set's budget (TierFull reserves nothing)."""
        n = len(self.members)
        shares = [max(1, local_count(capacity_pages_per_layer, i, n)) for i in range(n)]
        need = sum(shares) * self._num_layers * self._stride
        free = self._capacity_bytes - self.used_bytes
        if need > free:
            hint = ("the request can never fit: raise --kv-disk-gb"
                    if need > self._capacity_bytes else "retry when requests finish")
            raise TierFull(self.name, [], need, free, hint=hint)
        done = []
        try:
            for m, share in zip(self.members, shares):
                m.register_request(request_handle, share)
                done.append(m)
        except BaseException:
            for m in done:
                m.release_request(request_handle)
            raise

    def skip(self, request_handle: int, n: int) -> None:
        for i, m in enumerate(self.members):
            m.skip(request_handle, local_count(n, i, len(self.members)))

    def bind(self, page_ids, request_handle: int, first_index: int) -> None:
        """As DiskTier.bind, all or nothing: a folder that refuses unbinds what the others
        bound. A page id still bound in another folder leaves it first."""
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        idx = first_index + np.arange(pids.shape[0])
        n = len(self.members)
        moved = (self._member[pids] >= 0) & (self._member[pids] != idx % n)
        if moved.any():
            self.unbind(pids[moved])
        done = []
        try:
            for i, m in enumerate(self.members):
                sel = idx % n == i
                if sel.any():
                    m.bind(pids[sel], request_handle, int(idx[sel][0]) // n)
                    done.append((m, pids[sel]))
        except BaseException:
            for m, part in done:
                m.unbind(part)
            raise
        self._member[pids] = idx % n

    def occupants(self, request_handle: int, first_index: int, n: int) -> list[int]:
        out = []
        k = len(self.members)
        for i, m in enumerate(self.members):
            first = local_count(first_index, i, k)             # its first local index >= first
            count = local_count(first_index + n, i, k) - first
            if count > 0:
                out += m.occupants(request_handle, first, count)
        return out

    def page_indices(self, page_ids: np.ndarray) -> np.ndarray:
        member = self._member[page_ids]
        local = np.zeros(len(page_ids), np.int64)
        for i, m in enumerate(self.members):
            sel = member == i
            if sel.any():
                local[sel] = m.page_indices(page_ids[sel])
        return local * len(self.members) + member

    def unbind(self, page_ids) -> None:
        """As DiskTier.unbind (page ids not bound are ignored)."""
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        for i, part in self._split_pids(pids):
            self.members[i].unbind(pids[part])
        self._member[pids] = -1

    def release_request(self, request_handle: int) -> None:
        for m in self.members:
            m.release_request(request_handle)

    # -- the prefix cache's index and restart ----------------------------------------------
    def record(self, page_ids, keys: list[bytes], summaries: list[bytes | None]) -> np.ndarray:
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        ok = np.zeros(pids.shape[0], bool)
        for i, part in self._split_pids(pids):
            at = np.flatnonzero(part)
            ok[at] = self.members[i].record(pids[at], [keys[j] for j in at],
                                            [summaries[j] for j in at])
        return ok

    def restore(self) -> list[RestoredPages]:
        """The members' restored pages joined per segment, at their set-wide indices."""
        n = len(self.members)
        parts: dict[int, list] = {}
        for i, m in enumerate(self.members):
            for seg in m.restore():
                for j in range(len(seg.indices)):
                    parts.setdefault(seg.handle, []).append(
                        (int(seg.indices[j]) * n + i, seg.keys[j], seg.crcs[j],
                         seg.summaries[j], seg.meta[j]))
        out = []
        for handle, recs in sorted(parts.items()):
            recs.sort(key=lambda r: r[0])
            out.append(RestoredPages(handle, np.array([r[0] for r in recs], np.int64),
                                     [r[1] for r in recs], np.stack([r[2] for r in recs]),
                                     [r[3] for r in recs], [r[4] for r in recs]))
        return out

    def adopt(self, handle: int, page_ids, indices: np.ndarray, crcs: np.ndarray,
              meta: list[bytes | None] | None = None) -> None:
        pids = np.asarray(torch.as_tensor(page_ids, dtype=torch.int64).cpu(), dtype=np.int64)
        indices = np.asarray(indices, np.int64)
        n = len(self.members)
        for i, m in enumerate(self.members):
            at = np.flatnonzero(indices % n == i)
            if at.size:
                m.adopt(handle, pids[at], indices[at] // n, crcs[at],
                        None if meta is None else [meta[j] for j in at])
        self._member[pids] = indices % n

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
        for i, part in self._split_keys(k):
            out[part] = self.members[i].contains(torch.from_numpy(k[part])).numpy()
        return torch.from_numpy(out)

    def keys(self) -> torch.Tensor:
        return torch.sort(torch.cat([m.keys() for m in self.members])).values

    def delete(self, keys: torch.Tensor) -> None:
        for m in self.members:      # a member forgets keys it does not hold at no cost
            m.delete(keys)

    def put(self, keys: torch.Tensor, pages: torch.Tensor) -> None:
        self.put_async(keys, pages).result()

    def get(self, keys: torch.Tensor, out: torch.Tensor) -> None:
        self.get_async(keys, out).result()

    def put_async(self, keys: torch.Tensor, pages: torch.Tensor) -> Future:
        k = self._check_keys(keys, self.max_keys).numpy()
        self._check_pages(pages, k.shape[0], "pages")
        src = pages.detach().to("cpu").contiguous()
        return self._fan_out(k, lambda m, part: m.put_async(
            torch.from_numpy(k[part]), src[torch.from_numpy(np.flatnonzero(part))]))

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
        return self._fan_out(k, lambda m, part: m.get_into(
            torch.from_numpy(k[part]), pool, slots[torch.from_numpy(part)]))

    def put_from(self, keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> Future:
        k = self._check_keys(keys, self.max_keys).numpy()
        slots = torch.as_tensor(slots).to("cpu", torch.int64)
        return self._fan_out(k, lambda m, part: m.put_from(
            torch.from_numpy(k[part]), pool, slots[torch.from_numpy(part)]))

    # -- internals --------------------------------------------------------------------------
    def _split_pids(self, pids: np.ndarray):
        """(member, bool mask) per member holding some of the page ids (unbound: none)."""
        member = self._member[pids]
        for i in range(len(self.members)):
            part = member == i
            if part.any():
                yield i, part

    def _split_keys(self, keys: np.ndarray):
        member = self._member[keys % self.max_pages]
        for i in range(len(self.members)):
            part = member == i
            if part.any():
                yield i, part

    def _fan_out(self, keys: np.ndarray, start) -> Future:
        """start(member, mask) for each member's share of `keys`, all submitted before any is
        waited on; one Future for all (the first error, once every share is done)."""
        unbound = self._member[keys % self.max_pages] < 0
        if unbound.any():
            raise PageMissing(self.name, keys[unbound], "pages not bound to a request")
        futures = []
        try:
            for i, part in self._split_keys(keys):
                futures.append(start(self.members[i], part))
        except BaseException:
            for f in futures:               # what was submitted runs to its end
                f.exception()
            raise
        return _joined(futures)


def _joined(futures: list[Future]) -> Future:
    """A Future done when all are: the first one's error, else None."""
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
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                first = errors[0]
                if len(errors) > 1 and all(isinstance(e, TierError) for e in errors):
                    # every folder's failed pages, so the fill loses them all at once
                    first.keys = torch.cat([e.keys for e in errors])
                out.set_exception(first)
            else:
                out.set_result(None)
    for f in futures:
        f.add_done_callback(one)
    return out
