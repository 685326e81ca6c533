"""DiskLayers: the disk tier with some layers' pages as codec codes and the others as they are
(`--kv-tier-codec-share`, LeoAM's share of compressed pages: kvstore/codec_share.py).

Two member tiers, each a whole DiskTier (or a DiskSet over several folders): the coded layers'
in the `--kv-disk-path` folder(s) with the codec, the others' in a `raw-layers` folder under
each, without. A key `layer * max_pages + page_id` lives in the member that holds its layer, at
`layer's place among the member's layers * max_pages + page_id`. Every request registers,
binds and releases in both, at the same page indices, so a page is in both members (its coded
layers in one, its other layers in the other) and the disk budget is split between them in
proportion to their layers' bytes. The prefix cache's records go to both (the summaries and
codec scales to the coded member only), and a restart restores a page only where both members
have it. Each member's index logs carry a namespace that names the layer split, so files
written with another share are another namespace's.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.codec import PageCodec
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_layout import RAW_FOLDER
from kvstore.tiers.disk_members import DiskMembers
from kvstore.tiers.disk_restore import RestoredPages
from kvstore.tiers.disk_set import DiskSet
from kvstore.tiers.errors import PageMissing, TierFull


def raw_paths(paths: list[str | Path]) -> list[Path]:
    return [Path(p) / RAW_FOLDER for p in paths]


class DiskLayers(DiskMembers):
    def __init__(self, page_shape: PageShape, capacity_bytes: int, paths: list[str | Path],
                 num_layers: int, max_pages: int, codec: PageCodec, coded: list[int],
                 namespace: bytes = b"", summary_bytes: int = 0, **kw):
        """coded: the layers stored as codes (some, not all or none); kw: the members'
        DiskTier arguments (threads, ...)."""
        raw = [layer for layer in range(num_layers) if layer not in set(coded)]
        if not coded or not raw or any(not 0 <= c < num_layers for c in coded):
            raise ValueError(f"DiskLayers needs some but not all of {num_layers} layers "
                             f"coded, got {coded}")
        self.page_shape, self.codec = page_shape, codec
        self.max_pages, self.num_layers = int(max_pages), int(num_layers)
        self.max_keys = self.num_layers * self.max_pages
        self.layer_lists = (sorted(coded), raw)
        self._member = np.zeros(num_layers, np.int64)       # layer -> member
        self._place = np.zeros(num_layers, np.int64)        # layer -> place in its member
        for i, layers in enumerate(self.layer_lists):
            self._member[layers] = i
            self._place[layers] = np.arange(len(layers))
        strides = (codec.stride, page_shape.nbytes_aligned)
        self._layer_bytes = [len(ls) * s for ls, s in zip(self.layer_lists, strides)]
        self._capacity_bytes = int(capacity_bytes)
        coded_bytes = capacity_bytes * self._layer_bytes[0] // sum(self._layer_bytes)
        shares = (coded_bytes, capacity_bytes - coded_bytes)
        folders = ([Path(p) for p in paths], raw_paths(paths))
        self.members = []
        try:
            for i, (layers, share, where) in enumerate(zip(self.layer_lists, shares, folders)):
                ns = hashlib.blake2b(namespace + f"/layers {self.layer_lists[0]} coded, "
                                     f"member {i}".encode(), digest_size=16).digest()
                args = (page_shape, share)
                mkw = dict(kw, namespace=ns, codec=codec if i == 0 else None,
                           summary_bytes=summary_bytes if i == 0 else 0)
                n = len(layers)
                self.members.append(
                    DiskTier(*args, where[0], n * max_pages, n, max_pages, **mkw)
                    if len(where) == 1 else
                    DiskSet(*args, where, n * max_pages, n, max_pages, **mkw))
        except BaseException:
            self.close()
            raise
        self.layout = self.members[0].layout

    # -- sizes ------------------------------------------------------------------------------
    capacity_bytes = property(lambda self: self._capacity_bytes)      # --kv-disk-gb
    capacity_pages = property(lambda self: min(
        m.capacity_pages // len(ls) for m, ls in zip(self.members, self.layer_lists))
        * self.num_layers)

    @property
    def page_bytes(self) -> int:
        """Bytes of a page of one layer on disk, on average over the layers."""
        return sum(self._layer_bytes) // self.num_layers

    def bytes_of(self, keys: torch.Tensor) -> int:
        """Bytes the pages of `keys` take on disk (coded layers' less)."""
        member = self._member[np.asarray(torch.as_tensor(keys).cpu()) // self.max_pages]
        return sum(int(np.count_nonzero(member == i)) * m.page_bytes
                   for i, m in enumerate(self.members))

    # -- requests (both members, the same indices) ------------------------------------------
    def register_request(self, request_handle: int, capacity_pages_per_layer: int) -> None:
        """As DiskTier.register_request, in both members or neither."""
        done = []
        try:
            for m in self.members:
                m.register_request(request_handle, capacity_pages_per_layer)
                done.append(m)
        except TierFull as exc:
            for m in done:
                m.release_request(request_handle)
            need = capacity_pages_per_layer * sum(self._layer_bytes)
            hint = ("the request can never fit: raise --kv-disk-gb"
                    if need > self._capacity_bytes else "retry when requests finish")
            raise TierFull(self.name, [], need, self._capacity_bytes - self.used_bytes,
                           hint=hint) from exc
        except BaseException:
            for m in done:
                m.release_request(request_handle)
            raise

    def skip(self, request_handle: int, n: int) -> None:
        for m in self.members:
            m.skip(request_handle, n)

    def bind(self, page_ids, request_handle: int, first_index: int) -> None:
        """As DiskTier.bind, in both members or neither."""
        done = []
        try:
            for m in self.members:
                m.bind(page_ids, request_handle, first_index)
                done.append(m)
        except BaseException:
            for m in done:
                m.unbind(page_ids)
            raise

    def occupants(self, request_handle: int, first_index: int, n: int) -> list[int]:
        return self.members[0].occupants(request_handle, first_index, n)

    def page_indices(self, page_ids: np.ndarray) -> np.ndarray:
        return self.members[0].page_indices(page_ids)

    def unbind(self, page_ids) -> None:
        for m in self.members:
            m.unbind(page_ids)

    # -- the prefix cache's index and restart ----------------------------------------------
    def record(self, page_ids, keys: list[bytes], summaries: list[bytes | None]) -> np.ndarray:
        """Recorded where both members recorded the page (the summaries: the coded one's)."""
        ok = self.members[0].record(page_ids, keys, summaries)
        return ok & self.members[1].record(page_ids, keys, [None] * len(keys))

    def restore(self) -> list[RestoredPages]:
        """The pages both members restored, per segment; the checksums of every layer."""
        coded, raw = ({s.handle: s for s in m.restore()} for m in self.members)
        out = []
        for handle in sorted(coded.keys() & raw.keys()):
            a, b = coded[handle], raw[handle]
            common, ia, ib = np.intersect1d(a.indices, b.indices, return_indices=True)
            same = np.array([a.keys[i] == b.keys[j] for i, j in zip(ia, ib)], bool)
            common, ia, ib = common[same], ia[same], ib[same]     # the same page in both
            if not common.size:
                continue
            crcs = np.zeros((common.size, self.num_layers), np.uint64)
            crcs[:, self.layer_lists[0]] = a.crcs[ia]
            crcs[:, self.layer_lists[1]] = b.crcs[ib]
            out.append(RestoredPages(handle, common.astype(np.int64),
                                     [a.keys[j] for j in ia], crcs,
                                     [a.summaries[j] for j in ia], [a.meta[j] for j in ia]))
        return out

    def adopt(self, handle: int, page_ids, indices: np.ndarray, crcs: np.ndarray,
              meta: list[bytes | None] | None = None) -> None:
        crcs = np.asarray(crcs)
        self.members[0].adopt(handle, page_ids, indices, crcs[:, self.layer_lists[0]], meta)
        self.members[1].adopt(handle, page_ids, indices, crcs[:, self.layer_lists[1]], None)

    def get_into(self, keys: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor):
        """As DiskTier.get_into; PageMissing names every absent page, whichever member's
        (a member raises it for its own; the other's are looked up on that error path)."""
        try:
            return super().get_into(keys, pool, slots)
        except PageMissing:
            k = self._check_keys(keys, self.max_keys)
            raise PageMissing(self.name, k[~self.contains(k)], "pages not stored") from None

    # -- keys -------------------------------------------------------------------------------
    def keys(self) -> torch.Tensor:
        return torch.sort(torch.cat([self._global_keys(i, m.keys())
                                     for i, m in enumerate(self.members)])).values

    def _parts(self, keys: np.ndarray):
        layer, pid = keys // self.max_pages, keys % self.max_pages
        member = self._member[layer]
        for i in range(len(self.members)):
            part = member == i
            if part.any():
                yield i, part, self._place[layer[part]] * self.max_pages + pid[part]

    def _global_keys(self, member: int, keys: torch.Tensor) -> torch.Tensor:
        layers = torch.as_tensor(self.layer_lists[member], dtype=torch.int64)
        k = torch.as_tensor(keys, dtype=torch.int64)
        return layers[k // self.max_pages] * self.max_pages + k % self.max_pages
