"""NativeSparseDecode.forward_selected (kernels/_decode_selected.h): the table and split of a
page selection made in C equal, bit for bit, the ones kvstore/step_attention.py builds in torch
(selected_head_table, the reused pages and each row's last first, forward_partial)."""
from __future__ import annotations

import pytest
import torch

from kernels.page_select import native_select
from kernels.page_topk import select_pages
from kernels.page_table import selected_head_table
from kernels.sparse_attention import NativeSparseDecode, TorchSparseDecode, _decode

pytestmark = pytest.mark.skipif(_decode is None, reason="the C extensions are not built")

KVH, D, PS = 3, 64, 16


def _case(group: int, dtype: torch.dtype, seed: int, native: bool = True):
    """Sequences of awkward lengths, their pages on shuffled slots of a pool, a selection over
    random summaries, and random marks of what the last step selected."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1000, 77, 530, 16, 1][:1 + seed % 5]
    n_pages = [-(-n // PS) for n in lens]
    starts = torch.tensor([0] + n_pages[:-1], dtype=torch.int64).cumsum(0)
    layer_slots = torch.randperm(sum(n_pages) + 40, generator=gen)[:sum(n_pages)]
    pool = torch.randn(sum(n_pages) + 40, 2, KVH, PS, D, generator=gen).to(dtype)
    page_ids = torch.randint(0, 500, (len(lens), max(n_pages) + 3), generator=gen)
    q = torch.randn(len(lens), KVH * group, D, generator=gen).to(dtype)
    if native:
        summ = [torch.randn(n, KVH, 3, D, generator=gen) for n in n_pages]
        sel = native_select(q.float(), summ, n_pages, group, True, 8, 1, 2)[0]
    else:       # the torch path's selection: its page list a column of nonzero()'s output
        scores = torch.randn(len(lens), KVH, max(n_pages), generator=gen)
        sel = select_pages(scores, n_pages, 8, 1, 2)
    last = torch.tensor([n - (p - 1) * PS for n, p in zip(lens, n_pages)], dtype=torch.int32)
    selected_at = torch.randint(0, 3, (3 * 500,), generator=gen)
    return q, pool, sel, layer_slots, starts, last, (selected_at, 2), page_ids


def _reference(kernel, q, pool, sel, group, layer_slots, starts, last, marks, key_base,
               page_ids):
    """step_attention.py's way: union slots and keys, the head table, `first`, one call."""
    seq = torch.arange(q.shape[0]).repeat_interleave(sel.union_indptr.diff())
    union = layer_slots[starts[seq] + sel.union_indices]
    reused = marks[0][key_base + page_ids[seq, sel.union_indices]] == marks[1]
    table, pos = selected_head_table(sel, union, last, PS)
    first = reused[pos]
    first[table.indptr[1:].long() - 1] = True
    return kernel.forward_partial(q.float(), pool, table, group, 0.125, first=first)[0] \
        .to(q.dtype)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_selected_rows_equal_the_torch_built_table_bit_for_bit(group, dtype, native):
    kernel = NativeSparseDecode()
    for seed in range(5):
        q, pool, sel, slots, starts, last, marks, ids = _case(group, dtype, seed, native)
        for threads in (1, 2):
            kernel.threads = threads
            got = kernel.forward_selected(q, pool, sel, group, 0.125, slots, starts, last,
                                          marks, 500, ids)
            want = _reference(kernel, q, pool, sel, group, slots, starts, last, marks, 500,
                              ids)
            assert torch.equal(got, want), (seed, threads)


def test_groups_the_c_kernel_does_not_serve_take_torchs_rows():
    group = 17          # past the C kernel's 16
    q, pool, sel, slots, starts, last, marks, ids = _case(group, torch.float32, 3, native=False)
    got = NativeSparseDecode().forward_selected(q, pool, sel, group, 0.125, slots, starts, last,
                                                marks, 500, ids)
    seq = torch.arange(q.shape[0]).repeat_interleave(sel.union_indptr.diff())
    table, _ = selected_head_table(sel, slots[starts[seq] + sel.union_indices], last, PS)
    assert torch.equal(got, TorchSparseDecode().forward(q, pool, table, group, 0.125))


def test_entries_outside_the_sequences_or_marks_are_refused():
    q, pool, sel, slots, starts, last, marks, ids = _case(3, torch.float32, 2)
    kernel = NativeSparseDecode()
    with pytest.raises(ValueError, match="outside its sequence"):
        kernel.forward_selected(q, pool, sel, 3, 0.125, slots[:5], starts, last, marks, 500,
                                ids)
    with pytest.raises(ValueError, match="outside the selection's marks"):
        kernel.forward_selected(q, pool, sel, 3, 0.125, slots, starts, last,
                                (marks[0][:10], 2), 500, ids)
    with pytest.raises(ValueError, match="outside the pool"):
        kernel.forward_selected(q, pool[:3], sel, 3, 0.125, slots, starts, last, marks, 500,
                                ids)
    with pytest.raises(ValueError, match="contiguous int64"):
        kernel.forward_selected(q, pool, sel, 3, 0.125, slots.int(), starts, last, marks, 500,
                                ids)
