"""PageAllocator: which logical KV pages each request holds, with reference counts.

Pure bookkeeping over integer page ids; the KV data lives in the tiers (kvstore/tierset.py).
Invariants: every page id in [0, num_pages) is either free (count 0) or held by the requests
that list it (count = how many); a request's pages are listed in token order (page i holds
tokens [i * page_size, (i+1) * page_size)). A page held by several requests is shared (a
common prefix): `share` adds references to pages in use, `free` drops a request's references
and returns to the free list only the pages nobody holds any more. The prefix cache holds
pages too (`hold`, `take`, `unhold`): one reference per cached page, never listed among the
requests (`holders`).
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
        self._refs = [0] * num_pages
        self._held: set[int] = set()        # pages the prefix cache holds (one reference each)
        self._cache_only = 0                # held pages no request holds (evictable)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self._num_pages - len(self._free)

    @property
    def num_cache_only(self) -> int:
        """Pages the prefix cache holds and no request does (it can let them go at once)."""
        return self._cache_only

    def capacity_tokens(self) -> int:
        """The most tokens one request can hold."""
        return self._num_pages * self.page_size

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
            for _ in range(need):
                page = self._free.popleft()
                self._refs[page] = 1
                pages.append(page)
        return True

    def share(self, request_id: str, page_ids) -> None:
        """The request starts with pages other requests hold (a shared prefix, in token
        order): one more reference each. Only for a request that holds no pages yet."""
        if self._owned.get(request_id):
            raise ValueError(f"request {request_id!r} already holds pages")
        pages = [int(p) for p in page_ids]
        if any(not 0 <= p < self._num_pages or self._refs[p] < 1 for p in pages):
            raise ValueError("only pages in use can be shared")
        if len(set(pages)) != len(pages):
            raise ValueError("a request cannot hold a page twice")
        for p in pages:
            self._refs[p] += 1
            if self._refs[p] == 2 and p in self._held:
                self._cache_only -= 1
        if pages:
            self._owned[request_id] = pages

    def reuse_prefix(self, request_id: str, token_ids, salt: str | None = None) -> int | None:
        """How many leading tokens of `token_ids` the request starts with, computed (pages it
        now shares); None: not now (a running request computes the pages that follow). A bare
        allocator caches nothing: the KV store's prefix cache does."""
        return 0

    def publish(self, request_id: str, token_ids, salt: str | None = None) -> None:
        """The request computed the KV of `token_ids` (its full pages may be cached for later
        requests); a bare allocator caches nothing."""

    def hold(self, page_ids) -> None:
        """The prefix cache keeps these pages (in use, not held by it yet): one more reference."""
        pages = [int(p) for p in page_ids]
        if any(self._refs[p] < 1 or p in self._held for p in pages):
            raise ValueError("the cache holds only pages in use, once")
        for p in pages:
            self._refs[p] += 1
            self._held.add(p)

    def take(self, n: int) -> list[int]:
        """n free pages the prefix cache holds alone (pages restored from disk); all or
        nothing: [] when fewer are free."""
        if n > len(self._free):
            return []
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
            self._held.add(p)
        self._cache_only += n
        return pages

    def unhold(self, page_ids) -> list[int]:
        """The prefix cache lets these pages go; returns those nobody holds any more (now
        free). Pages it does not hold are ignored."""
        gone = []
        for p in (int(p) for p in page_ids):
            if p not in self._held:
                continue
            self._held.discard(p)
            self._refs[p] -= 1
            if self._refs[p] == 0:
                gone.append(p)
                self._cache_only -= 1
        self._free.extend(gone)
        return gone

    def held(self, page_id: int) -> bool:
        """The prefix cache holds the page."""
        return page_id in self._held

    def refs(self, page_id: int) -> int:
        """How many holders the page has, requests and the prefix cache (0: free)."""
        return self._refs[page_id]

    def holders(self, page_ids: set[int]) -> list[str]:
        """The requests that hold any of `page_ids`."""
        return [rid for rid, pages in self._owned.items() if page_ids.intersection(pages)]

    def holders_at(self, index: int, page_id: int) -> list[str]:
        """The requests that hold the page at `index` of their pages (where prefix sharing
        puts it in every holder)."""
        return [rid for rid, pages in self._owned.items()
                if len(pages) > index and pages[index] == page_id]

    def cache_only(self) -> list[int]:
        """The pages only the prefix cache holds."""
        return [p for p in self._held if self._refs[p] == 1]

    def pages(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._owned.get(request_id, ()))

    def free(self, request_id: str) -> int:
        """Drop the request's references. Idempotent; returns how many pages became free."""
        return len(self.release(request_id))

    def release(self, request_id: str) -> list[int]:
        """Drop the request's references; returns the pages nobody holds any more (now free)."""
        pages = self._owned.pop(request_id, None)
        if not pages:
            return []
        gone = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                gone.append(p)
            elif self._refs[p] == 1 and p in self._held:
                self._cache_only += 1
        # NOTE: most recently freed pages are reused last, so a page is not reused in the same step
        # it was freed in unless the pool is nearly exhausted.
        self._free.extend(gone)
        return gone
