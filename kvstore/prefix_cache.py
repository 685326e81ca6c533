"""PrefixCache: full KV pages found again by the tokens they hold (content addressing).

A full page's key is a hash chain, as vLLM's block hashes and LMCache's chunk keys: BLAKE2b
of the parent page's key and the page's token ids; the first page's parent is the namespace,
a digest of everything that changes the page's bytes (the model's weights, the dtypes, the
page shape, the layout version), or a digest of it and a request's `cache_salt` (vLLM's: a
tenant's requests share pages with no one else's). Two prompts give page i the same key only
when they share tokens [0, (i + 1) * page_size) in one namespace and salt, so a key names its
bytes.

Bookkeeping only (no tensors but each entry's summaries): key -> page id, each entry's
flags, and least-recently-used order. The bytes live in the tiers; who holds a page is the
allocator's (kvstore/page_allocator.py); kvstore/prefix.py wires them.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.tiers.disk_layout import DiskLayout
from kvstore.tiers.segment_log import KEY_BYTES


def namespace_key(**parts) -> bytes:
    """The digest every chain starts from: sorted name=value pairs of what shapes the bytes."""
    text = "|".join(f"{k}={parts[k]}" for k in sorted(parts))
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def store_namespace(model_id: str, shape, num_layers: int, codec, coded: list[int],
                    projection) -> bytes:
    """A KV store's namespace: the model (`model_id`: its weights and activation dtype), the
    page shape (kvstore/tiers/base.PageShape), the disk layout, the disk tier's codec and the
    layers it codes, and the low-rank projection cached summaries are made with (None:
    summaries of the keys themselves)."""
    extra = {}
    if coded:                   # pages of another codec or layer share never hit
        extra["codec"] = codec.name if len(coded) == num_layers \
            else f"{codec.name} layers {coded}"
    if projection is not None:  # cached pages carry projected summaries
        extra["summaries"] = f"lowrank-{projection.digest}"
    return namespace_key(model=model_id, kv_dtype=str(shape.dtype), page_size=shape.page_size,
                         layers=num_layers, kv_heads=shape.num_kv_heads,
                         head_dim=shape.head_dim, layout=DiskLayout.version, **extra)


@dataclass
class CachedPage:
    key: bytes
    page_id: int
    depth: int                          # page `depth` of its chain: tokens [depth*ps, (depth+1)*ps)
    summaries: torch.Tensor | None      # [L, kvh, 3, hd] min | max | mean of its keys;
                                        # None: not kept
    recorded: bool = False              # its record is in the disk tier's index
    verified: bool = True               # read back and checked since start-up (False: restored)


class PrefixCache:
    def __init__(self, namespace: bytes, page_size: int):
        self.namespace = namespace
        self.page_size = page_size
        self._by_key: dict[bytes, CachedPage] = {}
        # page id -> entry, least recently used first
        self._lru: OrderedDict[int, CachedPage] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, page_id: int) -> bool:
        return page_id in self._lru

    def keys(self, token_ids, n_pages: int, salt: str | None = None) -> list[bytes]:
        """Chain keys of the first n_pages full pages of token_ids (salted: a chain of its
        own, which no other salt's or unsalted prompt meets)."""
        ps = self.page_size
        ids = np.asarray(token_ids[:n_pages * ps], dtype=np.int64).tobytes()
        out, parent = [], self.namespace
        if salt is not None:
            parent = hashlib.blake2b(parent + b"salt:" + salt.encode(),
                                     digest_size=KEY_BYTES).digest()
        step = ps * 8
        for i in range(n_pages):
            parent = hashlib.blake2b(parent + ids[i * step:(i + 1) * step],
                                     digest_size=KEY_BYTES).digest()
            out.append(parent)
        return out

    def match(self, keys: list[bytes]) -> list[CachedPage]:
        """The cached entries of the longest prefix of `keys` (in chain order)."""
        found = []
        for key in keys:
            entry = self._by_key.get(key)
            if entry is None:
                break
            found.append(entry)
        return found

    def get(self, page_id: int) -> CachedPage | None:
        return self._lru.get(page_id)

    def find(self, key: bytes) -> CachedPage | None:
        return self._by_key.get(key)

    def insert(self, entry: CachedPage) -> bool:
        """Add an entry (most recently used); False when its key or page is cached already."""
        if entry.key in self._by_key or entry.page_id in self._lru:
            return False
        self._by_key[entry.key] = entry
        self._lru[entry.page_id] = entry
        return True

    def remove(self, page_id: int) -> CachedPage | None:
        entry = self._lru.pop(page_id, None)
        if entry is not None:
            del self._by_key[entry.key]
        return entry

    def touch(self, entries: list[CachedPage]) -> None:
        """A chain was used: its entries become the most recent, the first page most of all
        (so a chain is evicted from its end: a later page is useless without its parents)."""
        for e in reversed(entries):
            if e.page_id in self._lru:
                self._lru.move_to_end(e.page_id)

    def oldest(self):
        """Entries, least recently used first (a snapshot: the caller may remove them)."""
        return list(self._lru.values())

    def entries(self):
        return self._lru.values()
