"""The prefix cache's parts without a model: chain keys, LRU order, the allocator's cache
references, the index log's format and damage handling, and a disk tier's pages found again
by a second tier on the same folder (a restart)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.cache_files import clear_cache, list_cache
from kvstore.page_allocator import PageAllocator
from kvstore.prefix_cache import CachedPage, PrefixCache, namespace_key
from kvstore.tiers import segment_log
from kvstore.tiers.disk_layout import DiskPathInUse
from tests.test_disk_tier import register, request_keys
from tests.test_tiers import NUM_LAYERS, SHAPES, make_disk, random_pages, same_bits

NS = namespace_key(model="m", page_size=4)


def test_a_page_key_names_every_token_before_it():
    cache = PrefixCache(NS, 4)
    a = cache.keys(list(range(12)), 3)
    assert len(a) == 3 and len(set(a)) == 3
    assert cache.keys(list(range(12)) + [99] * 4, 4)[:3] == a       # a longer prompt
    changed = cache.keys([7] + list(range(1, 12)), 3)               # its first token differs
    assert all(x != y for x, y in zip(a, changed))
    assert cache.keys(list(range(8)) + [0, 0, 0, 0], 3)[:2] == a[:2]
    other = PrefixCache(namespace_key(model="m", page_size=4, kv_dtype="fp32"), 4)
    assert not set(other.keys(list(range(12)), 3)) & set(a)


def test_match_is_the_longest_cached_prefix_and_lru_evicts_a_chain_from_its_end():
    cache = PrefixCache(NS, 4)
    keys = cache.keys(list(range(16)), 4)
    entries = [CachedPage(k, pid, i, None) for i, (k, pid) in enumerate(zip(keys, (5, 6, 7, 8)))]
    for e in entries:
        assert cache.insert(e)
    assert not cache.insert(CachedPage(keys[0], 9, 0, None))        # one page per key
    cache.touch(entries)
    assert [e.page_id for e in cache.oldest()] == [8, 7, 6, 5]       # the end goes first
    cache.remove(6)
    assert [e.page_id for e in cache.match(keys)] == [5]             # a hole ends the match


def test_the_allocator_counts_pages_only_the_cache_holds():
    a = PageAllocator(8, 4)
    assert a.allocate("r", 12)
    pages = a.pages("r")
    a.hold(pages[:2])
    assert a.num_cache_only == 0 and a.refs(pages[0]) == 2
    assert a.release("r") == [pages[2]]                 # the cached ones stay
    assert a.num_cache_only == 2
    a.share("s", pages[:2])
    assert a.num_cache_only == 0
    a.release("s")
    taken = a.take(3)
    assert a.num_cache_only == 5 and a.num_free_pages == 3
    assert sorted(a.unhold(pages[:2] + tuple(taken))) == sorted(pages[:2] + tuple(taken))
    assert a.num_cache_only == 0 and a.num_free_pages == 8
    assert a.take(9) == []


def _records(n: int, layers: int = 3, sbytes: int = 8):
    return [segment_log.PageRecord(i, bytes([i]) * 16, np.arange(layers, dtype=np.uint64) + i,
                                   bytes([i]) * sbytes if i % 2 else None) for i in range(n)]


def test_the_index_log_round_trips_and_a_torn_or_corrupt_tail_is_cut(tmp_path):
    head = segment_log.Header(capacity=10, num_layers=3, summary_bytes=8, namespace=NS)
    path = tmp_path / "seg-1.idx"
    log = segment_log.SegmentLog(path, head)
    for rec in _records(4):
        log.append(segment_log.page_body(rec))
    log.append(segment_log.gone_body(2))
    parsed = segment_log.parse(path)
    assert parsed.header == head and not parsed.damaged
    assert sorted(parsed.pages) == [0, 1, 3]
    assert parsed.pages[1].summaries == b"\x01" * 8 and parsed.pages[0].summaries is None
    assert list(parsed.pages[3].crcs) == [3, 4, 5]
    good = path.stat().st_size
    whole = path.read_bytes()
    path.write_bytes(whole + segment_log.frame(segment_log.page_body(_records(6)[5]))[:20])
    torn = segment_log.parse(path)                     # a crash mid-append
    assert torn.damaged and torn.good_bytes == good and sorted(torn.pages) == [0, 1, 3]
    flipped = bytearray(whole)
    flipped[-3] ^= 0xFF                                # the last record's body
    path.write_bytes(bytes(flipped))
    bad = segment_log.parse(path)
    # the lost record said page 2 left: it looks live, and its checksums (the bytes were
    # punched out) drop it when it is read back
    assert bad.damaged and sorted(bad.pages) == [0, 1, 2, 3]
    reopened = segment_log.SegmentLog(path, head, bad.good_bytes)   # appends go after it
    reopened.append(segment_log.page_body(_records(6)[5]))
    assert sorted(segment_log.parse(path).pages) == [0, 1, 2, 3, 5]
    path.write_bytes(b"not an index")
    assert segment_log.parse(path).header is None


def test_cached_pages_of_a_disk_tier_are_found_again_by_the_next_one(tmp_path):
    root = tmp_path / "kv"
    shape = SHAPES["bf16"]
    disk = make_disk(shape, root, namespace=NS, summary_bytes=8)
    register(disk, 7, range(4))
    keys = torch.cat([request_keys(layer, range(4)) for layer in range(NUM_LAYERS)])
    pages = random_pages(shape, len(keys))
    disk.put(keys, pages)
    ok = disk.record([0, 1], [b"a" * 16, b"b" * 16], [b"s" * 8, None])
    assert ok.all()
    disk.unbind([2, 3])
    disk.release_request(7)
    disk.close()
    assert [(s.handle, s.pages) for s in list_cache(root)] == [(7, 2)]

    other = make_disk(shape, root, namespace=namespace_key(model="other"), summary_bytes=8)
    assert other.restore() == [] and other.next_handle == 8
    other.close()
    assert (root / "seg-7.kv").exists()                 # another namespace's: left alone

    again = make_disk(shape, root, namespace=NS, summary_bytes=8)
    (found,) = again.restore()
    assert found.handle == 7 and found.indices.tolist() == [0, 1]
    assert found.keys == [b"a" * 16, b"b" * 16] and found.summaries == [b"s" * 8, None]
    again.adopt(7, [5, 9], found.indices, found.crcs)    # new page ids in this process
    again.finish_restore()
    kept = torch.cat([request_keys(layer, [5, 9]) for layer in range(NUM_LAYERS)])
    out = torch.empty(len(kept), *shape.shape, dtype=shape.dtype)
    again.get(kept, out)
    want = torch.cat([pages[layer * 4:layer * 4 + 2] for layer in range(NUM_LAYERS)])
    assert same_bits(out, want)
    with pytest.raises(DiskPathInUse):
        clear_cache(root)                               # a server holds the folder
    again.close()
    assert clear_cache(root) == 2 and list_cache(root) == []
