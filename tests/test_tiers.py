"""KV tiers: one conformance suite run over device, host and disk (direct and buffered I/O),
then what only the memory pool promises (disk-only behaviour: test_disk_tier.py)."""
from __future__ import annotations

import pytest
import torch

from kvstore.tiers.base import PageShape, Tier
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_set import DiskSet
from kvstore.tiers.disk_fault import DiskFault
from kvstore.tiers.errors import PageMissing, TierFull
from kvstore.tiers.host import HostTier
from kvstore.tiers.memory_pool import copy_pages

NUM_LAYERS, MAX_PAGES, CAPACITY = 4, 64, 24  # CAPACITY: pages (keys) each test tier holds
SHAPES = {
    "bf16": PageShape(16, 3, 64, torch.bfloat16),  # SmolLM2 page: 12288 bytes, 4096-multiple
    "fp32": PageShape(4, 2, 8, torch.float32),     # 512 bytes: padded to 4096 on disk
}


def key(layer: int, page_id: int) -> int:
    return layer * MAX_PAGES + page_id


def keys_of(pairs) -> torch.Tensor:
    return torch.tensor([key(l, p) for l, p in pairs], dtype=torch.int64)


def random_pages(shape: PageShape, n: int, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs and infs included): equality is checked bit for bit."""
    g = torch.Generator().manual_seed(seed)
    int_dtype = {2: torch.int16, 4: torch.int32}[shape.nbytes // shape.numel]
    bits = torch.randint(-2**15, 2**15, (n, *shape.shape), generator=g, dtype=torch.int32)
    return bits.to(int_dtype).view(shape.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class Case:
    """A tier plus how to make keys storable (the disk tier needs them bound to requests)."""

    def __init__(self, tier: Tier):
        self.tier = tier

    def prepare(self, keys: torch.Tensor) -> None:
        pass

    def store(self, keys: torch.Tensor, pages: torch.Tensor) -> None:
        self.prepare(keys)
        self.tier.put(keys, pages)


class DiskCase(Case):
    def __init__(self, tier: DiskTier):
        super().__init__(tier)
        self.bound: set[int] = set()
        self.next_handle = 100

    def prepare(self, keys: torch.Tensor) -> None:
        new = sorted({int(k) % MAX_PAGES for k in keys} - self.bound)
        if new:
            self.tier.register_request(self.next_handle, len(new))
            self.tier.bind(new, self.next_handle, 0)
            self.bound.update(new)
            self.next_handle += 1


def make_disk(shape, path, capacity_pages=CAPACITY, **kw) -> DiskTier:
    return DiskTier(shape, capacity_pages * shape.nbytes_aligned, path,
                    max_keys=NUM_LAYERS * MAX_PAGES, num_layers=NUM_LAYERS,
                    max_pages=MAX_PAGES, threads=2, **kw)


@pytest.fixture(params=["bf16", "fp32"])
def shape(request) -> PageShape:
    return SHAPES[request.param]


@pytest.fixture(params=["device", "host", "disk", "disk-buffered", "disk-set"])
def case(request, shape, tmp_path):
    kind = request.param
    if kind == "disk-set":            # two folders, pages striped (kvstore/tiers/disk_set.py)
        tier = DiskSet(shape, CAPACITY * shape.nbytes_aligned, [tmp_path / "a", tmp_path / "b"],
                       max_keys=NUM_LAYERS * MAX_PAGES, num_layers=NUM_LAYERS,
                       max_pages=MAX_PAGES, threads=2)
        yield DiskCase(tier)
        tier.close()
    elif kind == "device":
        yield Case(DeviceTier(shape, CAPACITY * shape.nbytes, NUM_LAYERS * MAX_PAGES, "cpu"))
    elif kind == "host":
        yield Case(HostTier(shape, CAPACITY * shape.nbytes, NUM_LAYERS * MAX_PAGES))
    else:
        fault = DiskFault(no_direct_io=True) if kind == "disk-buffered" else None
        tier = make_disk(shape, tmp_path / "kv", fault=fault)
        yield DiskCase(tier)
        tier.close()


# -- conformance: every tier --------------------------------------------------------------

def test_put_then_get_is_bit_exact(case):
    keys = keys_of([(0, 3), (1, 3), (2, 7), (3, 0)])
    pages = random_pages(case.tier.page_shape, 4)
    case.store(keys, pages)
    out = torch.empty_like(pages)
    case.tier.get(keys, out)
    assert same_bits(out, pages)


def test_batch_in_random_order_round_trips(case):
    g = torch.Generator().manual_seed(1)
    keys = keys_of([(l, p) for l in range(NUM_LAYERS) for p in range(5)])  # 20 keys
    put_order, get_order = torch.randperm(20, generator=g), torch.randperm(20, generator=g)
    pages = random_pages(case.tier.page_shape, 20, seed=2)
    case.store(keys[put_order], pages[put_order])
    out = torch.empty_like(pages)
    case.tier.get(keys[get_order], out)
    assert same_bits(out, pages[get_order])


def test_put_overwrites_existing_keys(case):
    keys = keys_of([(0, 1), (2, 1), (3, 5)])
    first, second = (random_pages(case.tier.page_shape, 3, seed=s) for s in (3, 4))
    case.store(keys, first)
    case.store(keys[1:], second[1:])
    out = torch.empty_like(first)
    case.tier.get(keys, out)
    assert same_bits(out[0], first[0]) and same_bits(out[1:], second[1:])
    assert case.tier.num_pages == 3


def test_contains_reports_only_stored_keys(case):
    keys = keys_of([(0, 0), (1, 2), (3, 9)])
    case.store(keys[:2], random_pages(case.tier.page_shape, 2))
    assert case.tier.contains(keys).tolist() == [True, True, False]
    assert case.tier.contains(torch.empty(0, dtype=torch.int64)).numel() == 0


def test_delete_forgets_pages_and_ignores_absent_keys(case):
    keys = keys_of([(0, 0), (1, 0), (2, 0)])
    case.store(keys, random_pages(case.tier.page_shape, 3))
    case.tier.delete(torch.cat([keys[:2], keys_of([(3, 30)])]))
    assert case.tier.contains(keys).tolist() == [False, False, True]
    assert case.tier.num_pages == 1
    with pytest.raises(PageMissing):
        case.tier.get(keys[:1], random_pages(case.tier.page_shape, 1))


def test_get_of_absent_keys_raises_page_missing_naming_them_and_copies_nothing(case):
    keys = keys_of([(0, 4), (1, 4)])
    case.store(keys[:1], random_pages(case.tier.page_shape, 1))
    out = torch.zeros(2, *case.tier.page_shape.shape, dtype=case.tier.page_shape.dtype)
    with pytest.raises(PageMissing) as info:
        case.tier.get(keys, out)
    assert info.value.keys.tolist() == [key(1, 4)]
    assert not out.view(torch.uint8).any()


def test_put_beyond_capacity_raises_tier_full_and_stores_nothing(case):
    assert case.tier.capacity_pages == CAPACITY
    keys = keys_of([(l, p) for l in range(NUM_LAYERS) for p in range(CAPACITY // 4 + 1)])
    used = case.tier.used_bytes
    with pytest.raises(TierFull) as info:
        case.store(keys, random_pages(case.tier.page_shape, len(keys)))
    assert info.value.needed_bytes > info.value.free_bytes
    assert case.tier.num_pages == 0 and case.tier.used_bytes == used


def test_used_bytes_covers_stored_pages_within_capacity(case):
    assert case.tier.num_pages == 0
    keys = keys_of([(l, p) for l in range(NUM_LAYERS) for p in range(CAPACITY // 4)])
    case.store(keys, random_pages(case.tier.page_shape, len(keys)))
    assert case.tier.num_pages == CAPACITY
    assert CAPACITY * case.tier.page_shape.nbytes <= case.tier.used_bytes
    assert case.tier.used_bytes <= case.tier.capacity_bytes


def test_keys_lists_stored_keys_of_every_layer(case):
    keys = keys_of([(l, p) for l in range(NUM_LAYERS) for p in (1, 6)])
    pages = random_pages(case.tier.page_shape, len(keys), seed=5)
    case.store(keys, pages)
    assert sorted(case.tier.keys().tolist()) == sorted(keys.tolist())
    for layer in range(NUM_LAYERS):  # one layer at a time reads the right pages
        sel = (keys // MAX_PAGES) == layer
        out = torch.empty_like(pages[sel])
        case.tier.get(keys[sel], out)
        assert same_bits(out, pages[sel])


def test_keys_outside_the_key_space_are_rejected(case):
    with pytest.raises(ValueError):
        case.tier.contains(torch.tensor([NUM_LAYERS * MAX_PAGES]))
    with pytest.raises(ValueError):
        case.tier.contains(torch.tensor([-1]))


# -- memory pool (device and host) ----------------------------------------------------------

@pytest.fixture(params=["device", "host"])
def pool_tier(request, shape):
    cls = DeviceTier if request.param == "device" else HostTier
    return cls(shape, CAPACITY * shape.nbytes, NUM_LAYERS * MAX_PAGES)


def test_pool_is_4096_aligned_and_zeroed(pool_tier):
    pool = pool_tier.pool
    assert pool.shape == (CAPACITY, *pool_tier.page_shape.shape)
    assert pool.data_ptr() % 4096 == 0
    if pool_tier.page_shape.nbytes % 4096 == 0:
        assert all(pool[i].data_ptr() % 4096 == 0 for i in range(CAPACITY))
    assert not pool.view(torch.uint8).any()


def test_alloc_slots_then_in_place_copy_is_readable(pool_tier):
    keys = keys_of([(0, 2), (3, 2)])
    pages = random_pages(pool_tier.page_shape, 2)
    slots = pool_tier.alloc_slots(keys)
    assert slots.dtype == torch.int32 and (slots >= 0).all()
    pool_tier.pool.index_copy_(0, slots.long(), pages)
    assert torch.equal(pool_tier.slots(keys), slots)
    assert torch.equal(pool_tier.alloc_slots(keys), slots)  # stored keys keep their slot
    assert pool_tier.slots(keys_of([(1, 1)])).tolist() == [-1]
    out = torch.empty_like(pages)
    pool_tier.get(keys, out)
    assert same_bits(out, pages)


def test_repeated_key_in_a_batch_takes_one_slot(pool_tier):
    keys = keys_of([(0, 1), (0, 1), (1, 1), (0, 1)])
    slots = pool_tier.alloc_slots(keys)
    assert slots[0] == slots[1] == slots[3] != slots[2]
    assert pool_tier.num_pages == 2 and pool_tier.num_free == CAPACITY - 2
    pool_tier.delete(keys)
    assert pool_tier.num_pages == 0 and pool_tier.num_free == CAPACITY


def test_alloc_slots_beyond_free_slots_raises_and_reserves_nothing(pool_tier):
    pool_tier.alloc_slots(torch.arange(CAPACITY - 1))
    with pytest.raises(TierFull) as info:
        pool_tier.alloc_slots(torch.arange(CAPACITY - 2, CAPACITY + 1))
    assert sorted(info.value.keys.tolist()) == [CAPACITY - 1, CAPACITY]
    assert pool_tier.num_pages == CAPACITY - 1


def test_thousand_fill_and_delete_cycles_leak_no_slots(pool_tier):
    g = torch.Generator().manual_seed(0)
    pages = random_pages(pool_tier.page_shape, CAPACITY)
    for _ in range(1000):
        keys = torch.randperm(NUM_LAYERS * MAX_PAGES, generator=g)[:CAPACITY]
        pool_tier.put(keys, pages)
        pool_tier.delete(keys)
    assert pool_tier.num_pages == 0 and pool_tier.num_free == CAPACITY
    assert pool_tier.keys().numel() == 0
    assert sorted(pool_tier._free[:CAPACITY].tolist()) == list(range(CAPACITY))


def test_get_to_non_contiguous_out(pool_tier):
    keys = keys_of([(0, 0), (1, 0)])
    pages = random_pages(pool_tier.page_shape, 2)
    pool_tier.put(keys, pages)
    ps = pool_tier.page_shape
    out = torch.empty(2, 2, ps.page_size, ps.num_kv_heads, ps.head_dim, dtype=ps.dtype)
    out = out.transpose(2, 3)  # [2, 2, kvh, ps, hd] with non-contiguous strides
    assert not out.is_contiguous()
    pool_tier.get(keys, out)
    assert torch.equal(out.contiguous().view(torch.uint8), pages.view(torch.uint8))


def test_copy_pages_between_pools_is_bit_exact_and_checks_slots(shape):
    # the host <-> device page moves of the fetch stage (one memcpy per page, in C)
    src = HostTier(shape, CAPACITY * shape.nbytes, NUM_LAYERS * MAX_PAGES)
    dst = DeviceTier(shape, (CAPACITY // 2) * shape.nbytes, NUM_LAYERS * MAX_PAGES)
    pages = random_pages(shape, CAPACITY)
    src.pool.copy_(pages)
    s = torch.tensor([5, 0, CAPACITY - 1, 7], dtype=torch.int32)
    d = torch.tensor([3, CAPACITY // 2 - 1, 0, 1], dtype=torch.int64)
    copy_pages(dst.pool, d, src.pool, s)
    assert same_bits(dst.pool[d], pages[s.long()])
    untouched = [i for i in range(CAPACITY // 2) if i not in d.tolist()]
    assert not dst.pool[untouched].view(torch.uint8).any()
    before = dst.pool.clone()
    for bad_d, bad_s in [([CAPACITY // 2], [0]), ([0], [CAPACITY]), ([-1], [0]), ([0, 1], [0])]:
        with pytest.raises(ValueError):
            copy_pages(dst.pool, torch.tensor(bad_d), src.pool, torch.tensor(bad_s))
    assert same_bits(dst.pool, before)               # a rejected batch copies nothing
    other = HostTier(PageShape(shape.page_size * 2, shape.num_kv_heads, shape.head_dim,
                               shape.dtype), 4 * shape.nbytes, NUM_LAYERS * MAX_PAGES)
    with pytest.raises(ValueError, match="page shape"):
        copy_pages(other.pool, torch.tensor([0]), src.pool, torch.tensor([0]))
