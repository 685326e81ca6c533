"""The C decode kernel's long rows (kernels/_decode.c): a row of more than CHUNK_TOKENS tokens'
pages runs as chunks that threads share, merged in a fixed order. Its result is the row's
attention across every chunk boundary, with or without a carried first half, and its bits
depend on its pages only: not on the threads, nor on the batch it runs in."""
from __future__ import annotations

import pytest
import torch

from kernels.page_table import PageTable
from kernels.sparse_attention import NativeSparseDecode, native_decode_built

pytestmark = pytest.mark.skipif(not native_decode_built(), reason="C kernel not built")

PAGE, KVH, GROUP, D = 16, 3, 3, 64
CHUNK_PAGES = 512 // PAGE               # kernels/_decode.c: CHUNK_TOKENS / page_size
# pages of each (sequence, KV head) row: none, one, around one and two chunks, several
ROW_PAGES = [0, 1, CHUNK_PAGES - 1, CHUNK_PAGES, CHUNK_PAGES + 1, 2 * CHUNK_PAGES,
             2 * CHUNK_PAGES + 1, 4 * CHUNK_PAGES + 7, 9]


def _case(dtype, seed=0, q_scale=1.0):
    """A pool, a table whose rows list ROW_PAGES pages each (3 rows a sequence; the last row
    of a sequence short), on shuffled slots with partial last pages, and queries."""
    gen = torch.Generator().manual_seed(seed)
    slots = sum(ROW_PAGES) + 3
    pool = torch.randn(slots, 2, KVH, PAGE, D, generator=gen).to(dtype)
    perm = torch.randperm(slots, generator=gen)
    counts = torch.tensor(ROW_PAGES)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    indices = perm[:sum(ROW_PAGES)].to(torch.int32)
    last = torch.randint(1, PAGE + 1, (len(ROW_PAGES),), generator=gen, dtype=torch.int32)
    table = PageTable(indptr, indices, last, PAGE)
    q = (torch.randn(len(ROW_PAGES) // KVH, KVH * GROUP, D, generator=gen) * q_scale).to(dtype)
    return pool, table, q


def _reference(q, pool, table, scale):
    """(out, lse) of each row in float64, token by token."""
    b, h, d = q.shape
    out = torch.zeros(b, h, d, dtype=torch.float64)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float64)
    for r in range(table.batch_size):
        pages = table.indices[int(table.indptr[r]):int(table.indptr[r + 1])].long()
        if pages.numel() == 0:
            continue
        kv = pool[pages][:, :, r % KVH].double()                # [n, 2, ps, D]
        n_tok = (pages.numel() - 1) * PAGE + int(table.last_page_len[r])
        k = kv[:, 0].reshape(-1, d)[:n_tok]
        v = kv[:, 1].reshape(-1, d)[:n_tok]
        heads = slice((r % KVH) * GROUP, (r % KVH + 1) * GROUP)
        s = q[r // KVH, heads].double() @ k.T * scale
        out[r // KVH, heads] = torch.softmax(s, -1) @ v
        lse[r // KVH, heads] = torch.logsumexp(s, -1)
    return out, lse


@pytest.mark.parametrize("q_scale", [1.0, 30.0])
def test_long_rows_match_the_reference_across_chunk_boundaries(kernel, q_scale):
    """Rows of 0 to 4 chunks and a bit (q_scale 30: weights under the exp flush, so the
    merge meets chunks whose every weight is ~0 against another chunk's)."""
    pool, table, q = _case(torch.float32, seed=1, q_scale=q_scale)
    out, lse = kernel.forward_partial(q, pool, table, GROUP, 0.125)
    ref_out, ref_lse = _reference(q, pool, table, 0.125)
    atol = 1e-5 if q_scale == 1 else 5e-5
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    assert bool((out[0, :GROUP] == 0).all()) and bool(torch.isinf(lse[0, :GROUP]).all())


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 64])
def test_a_rows_bits_do_not_depend_on_threads_or_batch(kernel, threads):
    pool, table, q = _case(torch.bfloat16, seed=2)
    one = NativeSparseDecode()
    one.simd, one.threads = kernel.simd, 1
    want = one.forward_partial(q, pool, table, GROUP, 0.125)
    kernel.threads = threads
    got = kernel.forward_partial(q, pool, table, GROUP, 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for b in range(q.shape[0]):                 # each sequence alone
        a, e = int(table.indptr[b * KVH]), int(table.indptr[(b + 1) * KVH])
        sub = PageTable(table.indptr[b * KVH:(b + 1) * KVH + 1] - a, table.indices[a:e],
                        table.last_page_len[b * KVH:(b + 1) * KVH], PAGE)
        alone = kernel.forward_partial(q[b:b + 1], pool, sub, GROUP, 0.125)
        assert torch.equal(alone[0], got[0][b:b + 1]) and torch.equal(alone[1], got[1][b:b + 1])


def test_a_carried_first_half_goes_on_across_chunks(kernel):
    """Split attention over long rows: a random first half (itself several chunks for the
    long rows), the rest carried on from it, equals the whole rows' attention."""
    pool, table, q = _case(torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    first = torch.rand(table.indices.numel(), generator=gen) < 0.5
    first[table.indptr[1:].long()[table.indptr.diff() > 0] - 1] = True   # partial pages first
    head, rest = table.split(first)
    assert int(head.indptr.diff().max()) > 2 * CHUNK_PAGES > 0      # both halves chunked
    assert int(rest.indptr.diff().max()) > CHUNK_PAGES
    carry = kernel.forward_partial(q, pool, head, GROUP, 0.125)
    out, lse = kernel.forward_partial(q, pool, rest, GROUP, 0.125, carry=carry)
    ref_out, ref_lse = _reference(q, pool, table, 0.125)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("last_first", [True, False])
def test_both_halves_in_one_call_give_the_two_calls_bits(kernel, threads, last_first):
    """`first`: the store's sequential split attention in one call (the pages the last step
    selected first, then the rest) has the bits of the two calls the pipelined modes make,
    whichever half holds a row's partial last page."""
    pool, table, q = _case(torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(6)
    first = torch.rand(table.indices.numel(), generator=gen) < 0.6
    ends = table.indptr[1:].long()[table.indptr.diff() > 0] - 1
    first[ends] = last_first
    kernel.threads = threads
    head, rest = table.split(first)
    qf = q.float()
    want = kernel.forward_partial(qf, pool, rest, GROUP, 0.125,
                                  carry=kernel.forward_partial(qf, pool, head, GROUP, 0.125))
    got = kernel.forward_partial(qf, pool, table, GROUP, 0.125, first=first)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="entries"):
        kernel.forward_partial(qf, pool, table, GROUP, 0.125, first=first[1:])


def test_a_table_whose_rows_fall_is_refused(kernel):
    pool, table, q = _case(torch.float32, seed=7)
    bad = PageTable(table.indptr.flip(0).contiguous(), table.indices, table.last_page_len, PAGE)
    with pytest.raises(ValueError, match="out of order"):
        kernel.forward_partial(q, pool, bad, GROUP, 0.125)
