"""The requests a KV store serves: per request, what outlives preemption.

A request's pages are the page allocator's (kvstore/page_allocator.py); its backing writes in
flight are the tier set's (kvstore/tierset.py). What is here is the request's own: its disk
file handle, its reserved capacity, the page summaries sparse decode selects with, the
observation-window prior and the centroid index (--selector centroid).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.centroids import CentroidIndex


@dataclass
class RequestKV:
    """Per-request KV state that outlives preemption (released when the request ends)."""
    request_id: str
    handle: int
    capacity_pages: int                      # pages per layer reserved for prompt + max_tokens
    summaries: torch.Tensor                  # [L, capacity_pages, kvh, 3, hd] min | max | mean
    # [L, capacity_pages, kvh] float32: attention mass from the prompt's observation window,
    # set at the end of prefill (-inf: none, e.g. pages generated later)
    prior: torch.Tensor | None = None
    prefilled: bool = False                  # placement applied after the prompt was computed
    centroids: CentroidIndex | None = None   # --selector centroid: built by the first selection

    @classmethod
    def new(cls, request_id: str, handle: int, cap: int, num_layers: int, shape,
            summary_dim: int, sparse: bool, observe: bool) -> RequestKV:
        """A request's state for `cap` pages of `shape` (kvstore/tiers/base.PageShape): its
        summaries zeroed (sparse decode), its prior (the observation window's) none yet."""
        # NOTE: in the KV dtype; min rounded down and max up, so Quest's bound stays an upper
        # bound. Only sparse decode reads them. Zeros: a partial page's row is scored (never
        # selected by it) before it fills
        summaries = torch.zeros(num_layers, cap if sparse else 0, shape.num_kv_heads, 3,
                                summary_dim, dtype=shape.dtype)
        prior = torch.full((num_layers, cap, shape.num_kv_heads), -float("inf")) \
            if sparse and observe else None
        return cls(request_id, handle, cap, summaries, prior=prior,
                   centroids=CentroidIndex(cap))


class RequestTable:
    """request id -> RequestKV, with handles that are never reused."""

    def __init__(self, first_handle: int = 0):
        """first_handle: handles below it are taken (files a previous server left)."""
        self._by_id: dict[str, RequestKV] = {}
        self._next_handle = first_handle

    def new_handle(self) -> int:
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def add(self, rkv: RequestKV) -> None:
        if rkv.request_id in self._by_id:
            # NOTE: the engine refuses a duplicate id before it gets here
            raise ValueError(f"request id {rkv.request_id!r} is already in the KV store")
        self._by_id[rkv.request_id] = rkv

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __getitem__(self, request_id: str) -> RequestKV:
        return self._by_id[request_id]

    def get(self, request_id: str) -> RequestKV | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: str) -> RequestKV | None:
        return self._by_id.pop(request_id, None)

    def __iter__(self):
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)
