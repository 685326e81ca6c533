"""Sparse decode attention (own page list per sequence and KV head) and its page table: the
torch and C backends (FlashInfer's: test_sparse_attention_flashinfer.py)."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kernels.attention import AttentionBatch, TorchPagedAttention
from kernels.page_topk import select_pages
from kernels.page_table import build_head_page_table
from kernels.page_table import PageTable
from kernels.backends import make_sparse_decode
from kernels.sparse_attention import (NativeSparseDecode, TorchSparseDecode, _decode,
                                      reference_sparse_decode_attention,
                                      sparse_decode_attention)

AWKWARD_LENS = [27, 61, 113, 577]
HEAD_DIM = 64


def _pool(kv_lens, page_size, kv_heads, dtype, seed=0, head_dim=HEAD_DIM):
    """Random slot pool with each sequence's pages on shuffled slots: (pool, slot_table)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // page_size) for n in kv_lens]
    slots = list(range(sum(need) + 5))
    rng.shuffle(slots)
    table = torch.full((len(kv_lens), max(need)), -1, dtype=torch.int64)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(slots[at:at + n])
        at += n
    pool = torch.randn(len(slots), 2, kv_heads, page_size, head_dim, generator=gen).to(dtype)
    return pool, table


def _all_pages(kv_lens, page_size, kv_heads):
    rows = [list(range(-(-n // page_size))) for n in kv_lens for _ in range(kv_heads)]
    indptr = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    return indptr, torch.tensor([p for r in rows for p in r])


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [16, 8])
def test_sparse_equals_dense_when_every_row_lists_every_page(page_size, group, dtype, atol):
    kv_heads = 3
    pool, slots = _pool(AWKWARD_LENS, page_size, kv_heads, dtype)
    indptr, pages = _all_pages(AWKWARD_LENS, page_size, kv_heads)
    table = build_head_page_table(indptr, pages, slots, AWKWARD_LENS, page_size)
    q = torch.randn(len(AWKWARD_LENS), kv_heads * group, HEAD_DIM).to(dtype)
    scale = HEAD_DIM ** -0.5
    got = sparse_decode_attention(q, pool, table, group, scale)
    batch = AttentionBatch.build([s[s >= 0].tolist() for s in slots], AWKWARD_LENS,
                                 [1] * len(AWKWARD_LENS), page_size)
    dense = TorchPagedAttention().forward(q, pool, batch, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got.float(), dense.float(), atol=atol, rtol=0)
    ref = reference_sparse_decode_attention(q, pool, table, group, scale)
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=0)
    # a dense decode's table, once per KV head, is this table (StepKV's dense decodes)
    per_head = batch.page_table.per_head(kv_heads)
    for field in ("indptr", "indices", "last_page_len"):
        assert getattr(per_head, field).tolist() == getattr(table, field).tolist()


def _random_selection(kv_lens, page_size, kv_heads, budget, seed):
    num_pages = [-(-n // page_size) for n in kv_lens]
    scores = torch.randn(len(kv_lens), kv_heads, max(num_pages),
                         generator=torch.Generator().manual_seed(seed))
    return select_pages(scores, num_pages, budget, 1, 1)


def _random_case(page_size, group, dtype, budget, seed, head_dim=HEAD_DIM):
    """A pool, a random per-head selection as a head page table, and queries: (sel, table,
    pool, q)."""
    kv_heads = 3
    pool, slots = _pool(AWKWARD_LENS, page_size, kv_heads, dtype, seed=seed, head_dim=head_dim)
    sel = _random_selection(AWKWARD_LENS, page_size, kv_heads, budget, seed + 1)
    table = build_head_page_table(sel.indptr, sel.page_indices, slots, AWKWARD_LENS, page_size)
    q = torch.randn(len(AWKWARD_LENS), kv_heads * group, head_dim).to(dtype)
    return sel, table, pool, q


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [16, 8])
def test_random_per_head_subsets_match_reference(page_size, group, dtype, atol):
    sel, table, pool, q = _random_case(page_size, group, dtype, budget=5, seed=1)
    assert any(not torch.equal(sel.row(3, 0), sel.row(3, h)) for h in (1, 2))  # heads differ
    got = sparse_decode_attention(q, pool, table, group, 0.125)
    ref = reference_sparse_decode_attention(q, pool, table, group, 0.125)
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=0)


def test_the_cpu_store_uses_the_c_kernel():
    assert _decode is not None, "kernels/_decode.c is not built: run `make setup`"
    assert isinstance(make_sparse_decode("cpu"), NativeSparseDecode)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [16, 8])
def test_c_kernel_matches_reference_and_torch(kernel, page_size, group, dtype, atol):
    _, table, pool, q = _random_case(page_size, group, dtype, budget=5, seed=11)
    got = kernel.forward(q, pool, table, group, 0.125)
    assert got.shape == q.shape and got.dtype == q.dtype
    ref = reference_sparse_decode_attention(q, pool, table, group, 0.125)
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=0)
    torch.testing.assert_close(got.float(), TorchSparseDecode().forward(
        q, pool, table, group, 0.125).float(), atol=atol, rtol=0)


def test_c_kernel_partials_merge_by_log_sum_exp(kernel):
    # a row's pages split in two tables (one row empty in each): the halves' (out, lse)
    # merge to the whole row's attention, and an empty row weighs nothing
    page_size, group = 16, 3
    _, table, pool, q = _random_case(page_size, group, torch.float32, budget=6, seed=13)
    whole = kernel.forward(q, pool, table, group, 0.125)
    counts = table.indptr.long().diff()
    head = counts // 2
    head[0] = 0                                 # row 0 has every page in the tail
    rows = []
    for r in range(table.batch_size):
        pages = table.pages(r)
        rows.append((pages[:head[r]], pages[head[r]:]))

    def half(which: int) -> PageTable:
        lists = [rw[which] for rw in rows]
        indptr = torch.tensor([0] + [len(x) for x in lists]).cumsum(0).to(torch.int32)
        last = torch.where(torch.tensor([which == 1 or len(rw[1]) == 0 for rw in rows]),
                           table.last_page_len, page_size).to(torch.int32)
        return PageTable(indptr, torch.cat(lists).to(torch.int32), last, page_size)

    (o1, l1), (o2, l2) = (kernel.forward_partial(q, pool, half(i), group, 0.125) for i in (0, 1))
    assert torch.isinf(l1[0, :group]).all() and bool((o1[0, :group] == 0).all())  # row 0
    lse = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=0)


def _rows(table: PageTable, r0: int, r1: int) -> PageTable:
    """Rows r0..r1 of a table as a table of their own."""
    a, b = int(table.indptr[r0]), int(table.indptr[r1])
    return PageTable(table.indptr[r0:r1 + 1] - a, table.indices[a:b],
                     table.last_page_len[r0:r1], table.page_size)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_c_kernel_goes_on_from_a_first_half_with_the_same_bits_in_any_batch(kernel, dtype,
                                                                            atol):
    """Split attention as the store runs it: each row's pages the last step selected first
    (any subset, with the partial last page), then the rest carried on from that state. The
    result is the whole rows' attention, and a row's bits do not depend on the batch it runs
    in (sequential attends the whole batch at once, sfc a micro-batch at a time)."""
    page_size, group, kvh = 16, 3, 3
    _, table, pool, q = _random_case(page_size, group, dtype, budget=6, seed=17)
    gen = torch.Generator().manual_seed(5)
    first = torch.rand(table.indices.numel(), generator=gen) < 0.6
    first[table.indptr[1:].long() - 1] = True            # the partial page goes first

    def split_attention(qs, tab, mask):
        head, rest = tab.split(mask)
        carry = kernel.forward_partial(qs, pool, head, group, 0.125)
        return kernel.forward_partial(qs, pool, rest, group, 0.125, carry=carry)[0]

    got = split_attention(q, table, first)
    whole = kernel.forward(q, pool, table, group, 0.125).float()
    torch.testing.assert_close(got, whole, atol=atol, rtol=0)
    for b in range(q.shape[0]):
        sub = _rows(table, b * kvh, (b + 1) * kvh)
        a, e = int(table.indptr[b * kvh]), int(table.indptr[(b + 1) * kvh])
        assert torch.equal(split_attention(q[b:b + 1], sub, first[a:e]), got[b:b + 1])
    # nothing left for the second half: the first half's result, bit for bit
    every = torch.ones_like(first)
    head_only = kernel.forward_partial(q, pool, table, group, 0.125)[0]
    assert torch.equal(split_attention(q, table, every), head_only)
    with pytest.raises(ValueError, match="carry"):
        kernel.forward_partial(q, pool, table, group, 0.125,
                               carry=(head_only[:1], torch.zeros(1, q.shape[1])))


def test_page_table_split_keeps_order_and_moves_the_partial_page_length():
    t = PageTable(torch.tensor([0, 3, 5, 6], dtype=torch.int32),
                  torch.tensor([10, 11, 12, 20, 21, 30], dtype=torch.int32),
                  torch.tensor([5, 7, 9], dtype=torch.int32), 16)
    a, b = t.split(torch.tensor([True, False, True, False, False, True]))
    assert a.indptr.tolist() == [0, 2, 2, 3] and a.indices.tolist() == [10, 12, 30]
    assert b.indptr.tolist() == [0, 1, 3, 3] and b.indices.tolist() == [11, 20, 21]
    # a row's last entry keeps its length; the other half of that row ends with a full page
    assert a.last_page_len.tolist() == [5, 16, 9] and b.last_page_len.tolist() == [16, 7, 16]


@pytest.mark.parametrize("head_dim,page_size,group,q_scale", [
    (64, 32, 3, 1), (64, 16, 16, 1), (128, 16, 4, 1), (32, 8, 2, 1), (48, 16, 3, 1),
    (40, 16, 3, 1), (64, 64, 3, 1), (64, 24, 3, 1), (64, 16, 3, 30)])
def test_c_kernel_rows_for_other_shapes(head_dim, page_size, group, q_scale):
    """Head sizes of 16 lanes or not (40: the portable rows only), pages of several 16-token
    blocks, of less than one and of a part of one (24), up to the kernel's 64 tokens, groups up
    to its 16, and queries whose softmax weights fall below the -80 flush (q_scale 30): both
    row paths match the reference in float32, and in bf16 to its rounding."""
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        _, table, pool, q = _random_case(page_size, group, dtype, budget=4, seed=23,
                                         head_dim=head_dim)
        q = (q.float() * q_scale).to(dtype)
        atol *= 1 if q_scale == 1 else 5        # a sharper softmax: more of float32's rounding
        ref = reference_sparse_decode_attention(q, pool, table, group, 0.125)
        outs = []
        for simd in (2, 1, 0):
            k = NativeSparseDecode()
            k.simd = simd
            out, lse = k.forward_partial(q, pool, table, group, 0.125)
            torch.testing.assert_close(out, ref, atol=atol, rtol=0)
            outs.append((out, lse))
        for other in outs[1:]:
            torch.testing.assert_close(outs[0][1], other[1], atol=1e-5, rtol=1e-6)


def test_c_kernel_rejects_tables_outside_the_pool_and_defers_other_dtypes():
    pool, slots = _pool([27], 16, 3, torch.float32)
    indptr, pages = _all_pages([27], 16, 3)
    table = build_head_page_table(indptr, pages, slots, [27], 16)
    q = torch.randn(1, 9, HEAD_DIM)
    for bad in (PageTable(table.indptr, table.indices + pool.shape[0], table.last_page_len, 16),
                PageTable(table.indptr, torch.cat([torch.tensor([-1], dtype=torch.int32),
                                                   table.indices[1:]]), table.last_page_len, 16),
                PageTable(table.indptr, table.indices, table.last_page_len + 16, 16)):
        with pytest.raises(ValueError, match="outside the pool"):
            NativeSparseDecode().forward(q, pool, bad, 3, 0.125)
    half = pool.half()                          # no C path for float16: torch computes it
    got = NativeSparseDecode().forward(q.half(), half, table, 3, 0.125)
    ref = reference_sparse_decode_attention(q.half(), half, table, 3, 0.125)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=0)


def test_head_page_table_maps_slots_and_last_page_lengths():
    page_size = 16
    slots = torch.tensor([[7, 3, 9, -1], [4, 0, 2, 8]])
    kv_lens = [40, 61]                     # 3 pages (last holds 8), 4 pages (last holds 13)
    indptr = torch.tensor([0, 2, 4, 7, 9])   # rows (b0,h0) (b0,h1) (b1,h0) (b1,h1)
    pages = torch.tensor([0, 1, 0, 2, 0, 1, 3, 1, 2])
    table = build_head_page_table(indptr, pages, slots, kv_lens, page_size)
    assert table.batch_size == 4 and table.indptr.dtype == torch.int32
    assert table.indices.tolist() == [7, 3, 7, 9, 4, 0, 8, 0, 2]
    assert table.last_page_len.tolist() == [16, 8, 13, 16]
    assert [table.kv_len(r) for r in range(4)] == [32, 24, 45, 32]


def test_head_page_table_rejects_pages_past_the_end():
    with pytest.raises(ValueError, match="past its sequence's last page"):
        build_head_page_table(torch.tensor([0, 1]), torch.tensor([3]),
                              torch.tensor([[1, 2, 3, 4]]), [40], 16)


def test_workspace_is_reused_and_plan_replaced_per_table():
    attn = TorchSparseDecode()
    pool, slots = _pool(AWKWARD_LENS, 16, 3, torch.float32, seed=3)
    q = torch.randn(len(AWKWARD_LENS), 9, HEAD_DIM)
    outs = []
    for seed, budget in ((4, 6), (5, 3), (6, 40)):
        sel = _random_selection(AWKWARD_LENS, 16, 3, budget, seed)
        table = build_head_page_table(sel.indptr, sel.page_indices, slots, AWKWARD_LENS, 16)
        outs.append((attn(q, pool, table, 3, 0.125),
                     reference_sparse_decode_attention(q, pool, table, 3, 0.125)))
    for got, ref in outs:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_rows_must_match_the_query_batch():
    pool, slots = _pool([27], 16, 3, torch.float32)
    indptr, pages = _all_pages([27], 16, 3)
    table = build_head_page_table(indptr, pages, slots, [27], 16)
    with pytest.raises(ValueError, match="rows"):
        sparse_decode_attention(torch.randn(2, 9, HEAD_DIM), pool, table, 3, 0.125)


def test_c_kernel_propagates_a_nan_key_as_torch_does(kernel):
    """A NaN in a listed page's K (a bug upstream) gives NaN out, as softmax does, rather than
    a quietly dropped token: the AVX-512 rows' vector exp keeps NaN as NaN."""
    pool = torch.randn(4, 2, 1, 16, HEAD_DIM)
    pool[1, 0, 0, 3, 5] = float("nan")
    q = torch.randn(1, 1, HEAD_DIM)
    table = PageTable(torch.tensor([0, 2], dtype=torch.int32),
                      torch.tensor([0, 1], dtype=torch.int32),
                      torch.tensor([16], dtype=torch.int32), 16)
    out, _ = kernel.forward_partial(q, pool, table, 1, 0.125)
    assert bool(torch.isnan(out).all())
    clean = PageTable(table.indptr, torch.tensor([0, 2], dtype=torch.int32),
                      table.last_page_len, 16)
    assert not bool(torch.isnan(kernel.forward_partial(q, pool, clean, 1, 0.125)[0]).any())


def test_c_kernel_reads_no_token_past_a_rows_last(kernel):
    """The slot of a row's partial last page holds page_size tokens, the rest stale (here NaN):
    neither K nor V past `last` reaches the output."""
    page_size, group = 16, 3
    _, table, pool, q = _random_case(page_size, group, torch.float32, budget=5, seed=29)
    want = kernel.forward(q, pool, table, group, 0.125)
    for r in range(table.batch_size):
        last = int(table.last_page_len[r])
        slot = int(table.indices[int(table.indptr[r + 1]) - 1])
        pool[slot, :, r % 3, last:] = float("nan")
    got = kernel.forward(q, pool, table, group, 0.125)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, want)


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_c_kernel_rows_split_over_threads_give_the_same_bits(kernel, threads):
    """Rows spread over threads by their pages (each row whole on one thread): every split,
    including more threads than rows, gives the one-thread bits."""
    _, table, pool, q = _random_case(8, 3, torch.bfloat16, budget=80, seed=5)   # ~300 pages
    one = NativeSparseDecode()
    one.simd, one.threads = kernel.simd, 1
    want = one.forward_partial(q, pool, table, 3, 0.125)
    kernel.threads = threads
    got = kernel.forward_partial(q, pool, table, 3, 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_c_kernel_thread_pool_serves_many_calls_and_concurrent_callers(kernel):
    """The rows' threads are a pool kept between calls (kernels/_pool.h): hundreds of calls in
    a row, and two callers at once (the GIL is released: the second runs its rows on its own
    thread while the first holds the pool), all give the one-thread bits."""
    _, table, pool, q = _random_case(8, 3, torch.bfloat16, budget=80, seed=6)
    one = NativeSparseDecode()
    one.simd, one.threads = kernel.simd, 1
    want = one.forward_partial(q, pool, table, 3, 0.125)
    kernel.threads = 2

    def calls(n: int) -> bool:
        ok = True
        for _ in range(n):
            got = kernel.forward_partial(q, pool, table, 3, 0.125)
            ok &= torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        return ok

    assert calls(200)
    with ThreadPoolExecutor(2) as ex:
        assert all(f.result() for f in [ex.submit(calls, 200) for _ in range(2)])
