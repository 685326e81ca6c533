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
from pathlib import Path

import numpy as np
import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_members import DiskMembers
from kvstore.tiers.disk_restore import RestoredPages
from kvstore.tiers.errors import PageMissing, TierFull


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


class DiskSet(DiskMembers):

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

    # -- sizes (the rest: DiskMembers) ----------------------------------------------------
    capacity_bytes = property(lambda self: self._capacity_bytes)      # --kv-disk-gb
    capacity_pages = property(lambda self: self._capacity_bytes // self._stride)
    page_bytes = property(lambda self: self.members[0].page_bytes)

    def bytes_of(self, keys: torch.Tensor) -> int:
        """Bytes the pages of `keys` take on disk."""
        return int(torch.as_tensor(keys).numel()) * self.page_bytes

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

    # -- Tier interface (the rest: DiskMembers) ---------------------------------------------
    def keys(self) -> torch.Tensor:
        return torch.sort(torch.cat([m.keys() for m in self.members])).values

    # -- internals --------------------------------------------------------------------------
    def _split_pids(self, pids: np.ndarray):
        """(member, bool mask) per member holding some of the page ids (unbound: none)."""
        member = self._member[pids]
        for i in range(len(self.members)):
            part = member == i
            if part.any():
                yield i, part

    def _parts(self, keys: np.ndarray):
        member = self._member[keys % self.max_pages]
        for i in range(len(self.members)):
            part = member == i
            if part.any():
                yield i, part, keys[part]

    def _check_bound(self, keys: np.ndarray) -> None:
        unbound = self._member[keys % self.max_pages] < 0
        if unbound.any():
            raise PageMissing(self.name, keys[unbound], "pages not bound to a request")
