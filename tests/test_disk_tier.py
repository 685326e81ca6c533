"""What only the disk tier promises: request files and budget, coalesced I/O, checksums, real
and injected I/O failures, async I/O, no leaks. The shared conformance suite is test_tiers.py."""
from __future__ import annotations

import errno
import gc
import logging
import os
import time

import numpy as np
import pytest
import torch

from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_fault import DiskFault
from kvstore.tiers.errors import PageCorrupted, PageMissing, TierFull, TierIOError
from kvstore.tiers.extent_io import plan_extents
from kvstore.tiers.host import HostTier
from tests.test_tiers import (MAX_PAGES, NUM_LAYERS, SHAPES, key, make_disk, random_pages,
                              same_bits)


@pytest.fixture(params=["direct", "buffered"])
def disk(request, tmp_path):
    fault = DiskFault(no_direct_io=True) if request.param == "buffered" else None
    tier = make_disk(SHAPES["bf16"], tmp_path / "kv", capacity_pages=4 * NUM_LAYERS * MAX_PAGES,
                     fault=fault)
    yield tier
    tier.close()


def request_keys(layer: int, page_ids) -> torch.Tensor:
    return torch.tensor([key(layer, p) for p in page_ids], dtype=torch.int64)


def register(tier: DiskTier, handle: int, page_ids, capacity: int | None = None) -> None:
    tier.register_request(handle, capacity or len(page_ids))
    tier.bind(list(page_ids), handle, 0)


def page_offset(tier: DiskTier, handle: int, layer: int, index: int, capacity: int) -> int:
    pn = tier.layout.page_numbers(np.array([layer]), np.array([index]), np.array([capacity]))
    return int(tier.layout.offsets(pn)[0])


def test_plan_extents_coalesces_adjacent_pages_of_one_file_up_to_the_cap():
    files = np.array([1, 0, 0, 0, 1, 0, 0], dtype=np.int64)
    pages = np.array([5, 2, 1, 3, 4, 7, 2], dtype=np.int64)
    order, starts, ends = plan_extents(files, pages, max_pages=2)
    runs = [[(int(files[i]), int(pages[i])) for i in order[s:e]] for s, e in zip(starts, ends)]
    assert runs == [[(0, 1), (0, 2)], [(0, 2), (0, 3)], [(0, 7)], [(1, 4), (1, 5)]]


def test_plan_extents_spans_small_gaps_when_allowed_and_caps_the_span():
    files = np.zeros(6, dtype=np.int64)
    pages = np.array([0, 2, 3, 7, 8, 20], dtype=np.int64)
    order, starts, ends = plan_extents(files, pages, max_pages=8, max_gap=3)
    runs = [[int(pages[i]) for i in order[s:e]] for s, e in zip(starts, ends)]
    # 0..3 and 7..8 are 3 apart (gap 3 pages) but the span cap (8 positions) cuts at 8
    assert runs == [[0, 2, 3, 7], [8], [20]]
    order, starts, ends = plan_extents(files, pages, max_pages=8, max_gap=0)
    runs = [[int(pages[i]) for i in order[s:e]] for s, e in zip(starts, ends)]
    assert runs == [[0], [2, 3], [7, 8], [20]]


def test_reads_with_gaps_return_exactly_the_wanted_pages(disk):
    ids = range(40)
    register(disk, 1, ids)
    keys = request_keys(2, ids)
    pages = random_pages(disk.page_shape, 40)
    disk.put(keys, pages)
    want = torch.tensor([0, 2, 3, 7, 8, 12, 13, 14, 30, 39])       # gaps of 1, 3, 3, 15, 8
    r0 = disk.preadv_calls
    out = torch.empty(len(want), *pages.shape[1:], dtype=pages.dtype)
    disk.get(keys[want], out)
    assert torch.equal(out.view(torch.int16), pages[want].view(torch.int16))   # bit-exact
    # gaps of <= 3 pages are read through: [0..14], [30], [39]
    assert disk.preadv_calls - r0 == 3


def test_sixty_four_contiguous_pages_of_one_layer_take_one_preadv_and_one_pwritev(disk):
    ids = range(64)
    register(disk, 1, ids)
    keys = request_keys(2, ids)[torch.randperm(64)]  # order of the batch does not matter
    pages = random_pages(disk.page_shape, 64)
    r0, w0 = disk.preadv_calls, disk.pwritev_calls
    disk.put(keys, pages)
    out = torch.empty_like(pages)
    disk.get(keys, out)
    assert (disk.preadv_calls - r0, disk.pwritev_calls - w0) == (1, 1)
    assert same_bits(out, pages)
    # every other page: gaps of one page are read through (one extent) ...
    keys_by_id = request_keys(2, range(0, 64, 2))
    disk.get(keys_by_id, out[:32])
    assert disk.preadv_calls - r0 == 1 + 1
    ordered = torch.empty_like(pages)
    disk.get(request_keys(2, ids), ordered)
    assert same_bits(out[:32], ordered[0:64:2])
    # ... and without gap reads every page is its own call
    disk.read_gap_pages = 0
    disk.get(keys_by_id, out[:32])
    assert disk.preadv_calls - r0 == 1 + 1 + 1 + 32


def test_extent_cap_splits_long_runs(tmp_path):
    shape = SHAPES["bf16"]
    tier = make_disk(shape, tmp_path, capacity_pages=4 * 64,
                     max_extent_bytes=8 * shape.nbytes_aligned)
    register(tier, 1, range(64))
    pages = random_pages(shape, 64)
    tier.put(request_keys(0, range(64)), pages)
    assert tier.pwritev_calls == 8
    tier.close()


def _tier_fds(root) -> int:
    """This process's descriptors a disk tier can hold: files and the lock under `root`, and
    io_uring rings (sockets, pipes and files of other tests' objects are not counted)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:                  # closed between the listing and the readlink
            continue
        n += target.startswith(str(root)) or "io_uring" in target
    return n


def test_thousand_request_cycles_leak_no_files_or_fds(disk):
    root = disk.layout.root
    gc.collect()                     # earlier tests' tiers close their fds now, not mid-test
    files0, fds0 = len(os.listdir(root)), _tier_fds(root)
    pages = random_pages(disk.page_shape, 8)
    out = torch.empty_like(pages)
    fds = []
    for handle in range(1000):
        ids = [(handle * 3 + i) % MAX_PAGES for i in range(4)]
        register(disk, handle, ids)
        keys = torch.cat([request_keys(0, ids), request_keys(3, ids)])
        disk.put(keys, pages)
        disk.get(keys, out)
        disk.unbind(ids)                 # the store lets freed pages go, then the request
        disk.release_request(handle)
        if handle in (99, 999):
            fds.append(_tier_fds(root))
    assert same_bits(out, pages)
    assert len(os.listdir(root)) == files0 == 0
    # each I/O thread keeps one io_uring (set up on its first read) for its life, nothing more
    assert fds[0] == fds[1] <= fds0 + disk._io.threads
    assert disk.used_bytes == 0 and disk.num_pages == 0
    disk.close()                   # the I/O threads exit: their rings go with them
    # (fds0 counts the ring of the thread that checked for io_uring; a ring is closed when its
    # thread's exit runs its destructor, just after the join returns; and the folder's lock)
    left = fds0 - bool(disk._io.ring_depth) - 1
    deadline = time.monotonic() + 5
    while _tier_fds(root) > left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _tier_fds(root) == left


def test_flipped_byte_on_disk_is_detected_as_corruption_of_that_page(disk):
    register(disk, 7, range(8))
    keys = request_keys(1, range(8))
    pages = random_pages(disk.page_shape, 8)
    disk.put(keys, pages)
    with open(disk.layout.file_path(7), "r+b") as f:
        f.seek(page_offset(disk, 7, layer=1, index=5, capacity=8) + 100)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(PageCorrupted) as info:
        disk.get(keys, torch.empty_like(pages))
    assert info.value.keys.tolist() == [key(1, 5)]
    out = torch.empty_like(pages[:5])
    disk.get(keys[:5], out)  # the other pages still read fine
    assert same_bits(out, pages[:5])


def test_truncated_file_gives_tier_io_error(disk):
    register(disk, 3, range(4))
    keys = request_keys(0, range(4))
    disk.put(keys, random_pages(disk.page_shape, 4))
    os.truncate(disk.layout.file_path(3), 0)
    with pytest.raises(TierIOError) as info:
        disk.get(keys, random_pages(disk.page_shape, 4))
    assert "short read" in str(info.value)
    assert sorted(info.value.keys.tolist()) == sorted(keys.tolist())


def test_injected_enospc_fails_only_the_faulty_request_and_leaves_its_keys_absent(disk):
    register(disk, 1, range(0, 4))
    register(disk, 2, range(4, 8))
    a, b = request_keys(0, range(0, 4)), request_keys(0, range(4, 8))
    pages = random_pages(disk.page_shape, 4)
    disk.fault = DiskFault(write_errno=errno.ENOSPC, handles=frozenset({2}))
    disk.put(a, pages)
    with pytest.raises(TierIOError) as info:
        disk.put(b, pages)
    assert info.value.errno == errno.ENOSPC and sorted(info.value.keys.tolist()) == b.tolist()
    assert "disk full" in str(info.value)
    assert disk.contains(torch.cat([a, b])).tolist() == [True] * 4 + [False] * 4


def test_injected_eio_on_read_raises_tier_io_error(disk):
    register(disk, 1, range(4))
    keys = request_keys(2, range(4))
    disk.put(keys, random_pages(disk.page_shape, 4))
    disk.fault = DiskFault(read_errno=errno.EIO)
    with pytest.raises(TierIOError) as info:
        disk.get(keys, random_pages(disk.page_shape, 4))
    assert info.value.errno == errno.EIO
    disk.fault = None
    disk.get(keys, random_pages(disk.page_shape, 4))


def test_o_direct_fallback_is_logged_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers"):
        tier = make_disk(SHAPES["fp32"], tmp_path, fault=DiskFault(no_direct_io=True))
        register(tier, 1, range(4))
        keys = request_keys(0, range(4))
        pages = random_pages(tier.page_shape, 4)
        for _ in range(3):
            tier.put(keys, pages)
            tier.get(keys, torch.empty_like(pages))
        tier.close()
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert not tier.direct_io and len(warnings) == 1


def test_async_put_then_async_get_round_trips(disk):
    register(disk, 1, range(16))
    keys = torch.cat([request_keys(l, range(16)) for l in range(NUM_LAYERS)])
    pages = random_pages(disk.page_shape, len(keys))
    assert disk.put_async(keys, pages).result() is None
    out = torch.empty_like(pages)
    disk.get_async(keys, out).result()
    assert same_bits(out, pages)


def test_get_into_host_slots_reads_in_place(disk):
    host = HostTier(disk.page_shape, 16 * disk.page_shape.nbytes, NUM_LAYERS * MAX_PAGES)
    register(disk, 1, range(8))
    keys = torch.cat([request_keys(0, range(8)), request_keys(3, range(4))])
    pages = random_pages(disk.page_shape, len(keys))
    disk.put(keys, pages)
    disk.get_into(keys, host.pool, host.alloc_slots(keys)).result()
    out = torch.empty_like(pages)
    host.get(keys, out)
    assert same_bits(out, pages)
    slots = host.slots(keys)  # and back: write from the host slots
    disk.delete(keys)
    disk.put_from(keys, host.pool, slots).result()
    disk.get(keys, out)
    assert same_bits(out, pages)


def test_registering_beyond_the_budget_raises_tier_full_until_a_release(tmp_path):
    tier = make_disk(SHAPES["bf16"], tmp_path, capacity_pages=3 * NUM_LAYERS)
    tier.register_request(1, 2)
    assert tier.used_bytes == 2 * NUM_LAYERS * tier.layout.stride
    with pytest.raises(TierFull, match="retry"):
        tier.register_request(2, 2)
    with pytest.raises(TierFull, match="never fit"):
        tier.register_request(3, 4)
    tier.release_request(1)
    tier.register_request(2, 3)
    assert tier.used_bytes == tier.capacity_bytes
    tier.close()
    assert tier.used_bytes == 0


def test_put_of_unbound_keys_raises_page_missing(disk):
    with pytest.raises(PageMissing, match="bind"):
        disk.put(request_keys(0, [1]), random_pages(disk.page_shape, 1))


def test_rebinding_a_page_id_to_another_request_forgets_its_pages(disk):
    register(disk, 1, range(2))
    keys = torch.cat([request_keys(0, [1]), request_keys(2, [1])])
    disk.put(keys, random_pages(disk.page_shape, 2))
    assert disk.contains(keys).all()
    register(disk, 2, [1])
    assert not disk.contains(keys).any()


def test_a_released_file_keeps_its_bound_pages_and_goes_with_the_last(disk):
    register(disk, 1, range(4))
    keys = torch.cat([request_keys(l, range(4)) for l in range(NUM_LAYERS)])
    pages = random_pages(disk.page_shape, len(keys))
    disk.put(keys, pages)
    disk.unbind([2, 3])
    disk.release_request(1)                 # pages 0 and 1 are still held (cached)
    assert disk.layout.file_path(1).exists()
    assert disk.used_bytes in (2 * NUM_LAYERS * disk.layout.stride,     # holes punched
                               4 * NUM_LAYERS * disk.layout.stride)     # or not possible
    kept = torch.cat([request_keys(l, [0, 1]) for l in range(NUM_LAYERS)])
    out = torch.empty_like(pages[:len(kept)])
    disk.get(kept, out)
    assert same_bits(out, pages[[i for i in range(len(keys)) if int(keys[i]) in
                                 set(kept.tolist())]])
    disk.unbind([0, 1])
    assert not disk.layout.file_path(1).exists() and disk.used_bytes == 0


def test_release_waits_for_writes_in_flight(disk):
    register(disk, 1, range(64))
    keys = torch.cat([request_keys(l, range(64)) for l in range(NUM_LAYERS)])
    future = disk.put_async(keys, random_pages(disk.page_shape, len(keys)))
    disk.unbind(list(range(64)))
    disk.release_request(1)
    assert future.done() and future.exception() is None
    assert not disk.layout.file_path(1).exists() and disk.num_pages == 0


def test_stale_request_files_are_removed_at_start(tmp_path):
    (tmp_path / "req-42.kv").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("keep")
    make_disk(SHAPES["fp32"], tmp_path).close()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_page_checksums_are_xxh64_as_the_reference_library_computes_it():
    """kvstore/tiers/_pageio.c's XXH64 against the xxhash package, at every tail length and
    offset the algorithm branches on, and on a real page size."""
    import xxhash

    from kvstore.tiers.extent_io import page_hashes
    rng = np.random.default_rng(0)
    for n in (1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 100, 4096, 12288):
        buf = rng.integers(0, 256, size=(5, n), dtype=np.uint8)
        got = page_hashes(buf, np.array([4, 0, 2]))
        assert got.tolist() == [xxhash.xxh64_intdigest(buf[r].tobytes()) for r in (4, 0, 2)]


def test_ring_reads_match_preadv_reads_including_errors(tmp_path):
    """_pageio's io_uring path (one thread, many extents in flight) returns what the preadv
    loop does: the same bytes, byte counts, a short count past the end of the file, and
    -EBADF for an extent whose fd is -1 (how ExtentIO fails an extent with an injected fault)."""
    from kvstore.tiers import _pageio
    if not _pageio.ring_available():
        pytest.skip("io_uring is not available on this kernel")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        n = 200
        offsets = rng.integers(0, (1 << 20) - 8192, n).astype(np.int64)
        offsets[7] = (1 << 20) - 1000                      # runs past the end: short read
        fds = np.full(n, fd, dtype=np.int64)
        fds[11] = -1
        # two iovecs per extent: 3000 + 5000 bytes into consecutive rows of the destination
        lens = np.tile(np.array([3000, 5000], dtype=np.int64), n)
        iov_ptr = np.arange(0, 2 * n + 1, 2, dtype=np.int64)
        outs, gots = [], []
        for depth in (0, 64):
            out = np.zeros((n, 8000), dtype=np.uint8)
            base = np.uint64(out.ctypes.data) + np.repeat(np.arange(n, dtype=np.uint64)
                                                          * np.uint64(8000), 2)
            base[1::2] += np.uint64(3000)
            got = np.zeros(n, dtype=np.int64)
            _pageio.preadv_extents(fds, offsets, iov_ptr, base, lens, got, depth)
            outs.append(out)
            gots.append(got)
        assert np.array_equal(gots[0], gots[1]) and np.array_equal(outs[0], outs[1])
        assert gots[1][11] == -errno.EBADF and gots[1][7] == 1000
        ok = np.ones(n, dtype=bool)
        ok[[7, 11]] = False
        assert (gots[1][ok] == 8000).all()
        for i in np.flatnonzero(ok)[:20]:
            assert np.array_equal(outs[1][i], data[offsets[i]:offsets[i] + 8000])
    finally:
        os.close(fd)


def test_a_second_tier_on_a_held_path_is_refused_until_the_first_closes(tmp_path):
    """Two servers on one --kv-disk-path truncated each other's request files: a path has
    one owner."""
    from kvstore.tiers.disk_layout import DiskPathInUse
    first = make_disk(SHAPES["fp32"], tmp_path / "kv")
    with pytest.raises(DiskPathInUse, match="in use by another Strata server"):
        make_disk(SHAPES["fp32"], tmp_path / "kv")
    first.close()
    make_disk(SHAPES["fp32"], tmp_path / "kv").close()


def test_leftovers_that_are_not_request_files_are_left_alone(tmp_path):
    root = tmp_path / "kv"
    (root / "req-99.kv").mkdir(parents=True)          # crashed start-up (IsADirectoryError)
    (root / "req-7.kv").write_bytes(b"stale")
    (root / "notes.txt").write_text("mine")
    tier = make_disk(SHAPES["fp32"], root)
    assert (root / "req-99.kv").is_dir() and (root / "notes.txt").exists()
    assert not (root / "req-7.kv").exists()
    tier.close()
