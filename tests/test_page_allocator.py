import random

import pytest

from kvstore.page_allocator import PageAllocator


def test_allocate_grows_pages_to_cover_tokens():
    a = PageAllocator(num_pages=8, page_size=4)
    assert a.pages_needed("r", 1) == 1
    assert a.allocate("r", 1)
    assert len(a.pages("r")) == 1
    assert a.pages_needed("r", 4) == 0
    assert a.allocate("r", 4) and len(a.pages("r")) == 1
    assert a.pages_needed("r", 5) == 1
    assert a.allocate("r", 9) and len(a.pages("r")) == 3
    assert a.allocate("r", 2) and len(a.pages("r")) == 3      # never shrinks
    assert (a.num_used_pages, a.num_free_pages, a.num_pages) == (3, 5, 8)


def test_allocate_is_all_or_nothing():
    a = PageAllocator(num_pages=4, page_size=2)
    assert a.allocate("a", 6)
    before = a.pages("b"), a.num_free_pages
    assert not a.allocate("b", 3)                              # needs 2 pages, 1 free
    assert (a.pages("b"), a.num_free_pages) == before == ((), 1)
    assert a.allocate("b", 2)
    assert a.num_free_pages == 0


def test_free_returns_all_pages_and_is_idempotent():
    a = PageAllocator(num_pages=5, page_size=16)
    a.allocate("a", 40)
    assert a.free("a") == 3
    assert a.free("a") == 0
    assert a.free("never-seen") == 0
    assert a.num_free_pages == 5 and a.pages("a") == ()


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        PageAllocator(0, 16)
    with pytest.raises(ValueError):
        PageAllocator(4, 0)


def test_random_allocate_free_never_leaks_or_double_owns():
    rng = random.Random(1234)
    a = PageAllocator(num_pages=37, page_size=rng.choice([1, 3, 16]))
    tokens: dict[str, int] = {}
    for step in range(5000):
        rid = f"r{rng.randrange(20)}"
        if rng.random() < 0.3:
            a.free(rid)
            tokens.pop(rid, None)
        else:
            want = tokens.get(rid, 0) + rng.randrange(0, 40)
            free_before = a.num_free_pages
            need = a.pages_needed(rid, want)
            ok = a.allocate(rid, want)
            assert ok == (need <= free_before)
            if ok:
                tokens[rid] = max(want, tokens.get(rid, 0))
                assert a.num_free_pages == free_before - need
            else:
                assert a.num_free_pages == free_before
        owned = [p for r in tokens for p in a.pages(r)]
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert all(0 <= p < a.num_pages for p in owned)
        assert len(owned) + a.num_free_pages == a.num_pages, "a page leaked"
        for r, n in tokens.items():
            assert len(a.pages(r)) == a.pages_for_tokens(n)
    for r in list(tokens):
        a.free(r)
    assert a.num_free_pages == a.num_pages and a.num_used_pages == 0
