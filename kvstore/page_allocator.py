"""PageAllocator: which KV pages (of the device pool) belong to which request.

Pure bookkeeping over integer page ids; the KV tensors live elsewhere (kvstore/kv_cache.py).
Invariants: every page id in [0, num_pages) is either free or owned by exactly one request;
a request's pages are listed in token order (page i holds tokens [i * page_size, (i+1) * page_size)).
Not thread-safe: only the engine's step loop calls it.
"""
from __future__ import annotations

from collections import deque


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owned: dict[str, list[int]] = {}

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self._num_pages - len(self._free)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages that hold num_tokens tokens (ceil division)."""
        return -(-num_tokens // self.page_size)

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra pages the request needs so that its pages cover num_tokens tokens."""
        have = len(self._owned.get(request_id, ()))
        return max(0, self.pages_for_tokens(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_needed(request_id, num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's pages to cover num_tokens tokens. All or nothing: returns False
        (and changes nothing) when there are not enough free pages. Never shrinks."""
        need = self.pages_needed(request_id, num_tokens)
        if need > len(self._free):
            return False
        if need:
            pages = self._owned.setdefault(request_id, [])
            pages.extend(self._free.popleft() for _ in range(need))
        return True

    def pages(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._owned.get(request_id, ()))

    def free(self, request_id: str) -> int:
        """Return all of the request's pages to the free list. Idempotent; returns how many."""
        pages = self._owned.pop(request_id, None)
        if not pages:
            return 0
        # NOTE: most recently freed pages are reused last, so a page is not reused in the same step
        # it was freed in unless the pool is nearly exhausted.
        self._free.extend(pages)
        return len(pages)
