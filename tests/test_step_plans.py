"""A step's prepared selection and attention (kernels/select_plan.py's SelectPlan,
kernels/decode_plan.py's table and selected plans) equal, layer by layer and bit for bit, the
per-call native_select, forward and forward_selected they stand in for; inputs they do not
serve get None."""
from __future__ import annotations

import pytest
import torch

from kernels.page_select import _select, native_select
from kernels.page_table import PageTable, selected_head_table
from kernels.select_plan import SelectPlan, layer_budgets
from kernels.decode_plan import selected_plan, table_plan
from kernels.sparse_attention import NativeSparseDecode, _decode

pytestmark = pytest.mark.skipif(_select is None or _decode is None,
                                reason="the C extensions are not built")

L, KVH, D, PS = 4, 3, 64, 16
SINK, LOCAL = 1, 2


def _inputs(dtype, seed, priors=True):
    """Sequences of awkward page counts, every layer's summaries and (some) priors, and per
    layer budgets: one for all heads, one per head, a prior share per head."""
    gen = torch.Generator().manual_seed(seed)
    counts = [70, 5, 33, 1, 129][:1 + seed % 5]
    cap = [n + 7 for n in counts]
    summ = [torch.randn(L, c, KVH, 3, D, generator=gen).to(dtype) for c in cap]
    pri = None
    if priors:
        pri = [None if b == 1 else torch.randn(L, c, KVH, generator=gen)
               for b, c in enumerate(cap)]
        for p in pri[2:3]:
            p[p < 0] = -float("inf")                # pages without a prior
    budgets = [(8, 2), (torch.tensor([3, 40, 9]), 2), (12, torch.tensor([0, 4, 1])), (5, 0)]
    return counts, summ, pri, budgets


def _same(a, b):
    for name in ("indptr", "page_indices", "union_indptr", "union_indices", "union_pos"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("quest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_each_layer_selects_as_native_select(group, dtype, quest):
    for seed in range(5):
        counts, summ, pri, budgets = _inputs(dtype, seed, priors=seed % 2 == 0)
        for threads in (1, 2):
            plan = SelectPlan.build(summ, counts, group, quest,
                                    layer_budgets(budgets, KVH, SINK, LOCAL), SINK, LOCAL,
                                    pri, threads)
            assert plan is not None
            q = torch.randn(L, len(counts), KVH * group, D)
            # any order; each layer its own outputs (all four kept, then compared)
            got = {layer: plan.select(layer, q[layer].contiguous()) for layer in (2, 0, 3, 1)}
            for layer in range(L):
                want = native_select(q[layer], [s[layer] for s in summ], counts, group, quest,
                                     *budgets[layer][:1], SINK, LOCAL,
                                     None if pri is None else
                                     [None if p is None else p[layer] for p in pri],
                                     budgets[layer][1], threads=threads)[0]
                _same(got[layer], want)


def test_inputs_the_c_selection_does_not_serve_get_no_plan():
    counts, summ, pri, budgets = _inputs(torch.float32, 2)
    lb = layer_budgets(budgets, KVH, SINK, LOCAL)

    def build(s=summ, p=pri, group=3, b=lb):
        return SelectPlan.build(s, counts, group, True, b, SINK, LOCAL, p, 1)

    assert build() is not None
    assert build(s=[s.half() for s in summ]) is None                       # float16
    assert build(group=17) is None                                          # GQA > 16
    assert build(s=[s.transpose(0, 1).contiguous().transpose(0, 1) for s in summ]) is None
    assert build(b=lb[:3]) is None                                          # a layer short
    assert build(s=[s[:, :n - 1] for s, n in zip(summ, counts)]) is None    # pages short
    assert build(p=[None if p is None else p.double() for p in pri]) is None


def test_a_layer_outside_the_plan_or_odd_queries_are_refused():
    counts, summ, pri, budgets = _inputs(torch.float32, 1)
    plan = SelectPlan.build(summ, counts, 3, True, layer_budgets(budgets, KVH, SINK, LOCAL),
                            SINK, LOCAL, pri, 1)
    q = torch.randn(len(counts), KVH * 3, D)
    for layer in (-1, L):
        with pytest.raises(ValueError, match="one of its 4 layers"):
            plan.select(layer, q)
    with pytest.raises(ValueError, match="float32"):
        plan.select(0, q.bfloat16())


def _decode_case(dtype, seed, group):
    """A pool, every layer's slots of the sequences' pages, and one selection per layer."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1000, 77, 530, 16, 1][:1 + seed % 5]
    n_pages = [-(-n // PS) for n in lens]
    total = sum(n_pages)
    starts = torch.tensor([0] + n_pages[:-1], dtype=torch.int64).cumsum(0)
    slots = torch.stack([torch.randperm(L * total + 9, generator=gen)[:total]
                         for _ in range(L)])
    pool = torch.randn(L * total + 9, 2, KVH, PS, D, generator=gen).to(dtype)
    page_ids = torch.randint(0, 200, (len(lens), max(n_pages) + 3), generator=gen)
    last = torch.tensor([n - (p - 1) * PS for n, p in zip(lens, n_pages)], dtype=torch.int32)
    marks = (torch.randint(0, 3, (L * 200,), generator=gen), 2)
    q = torch.randn(L, len(lens), KVH * group, D, generator=gen)
    sels = [native_select(q[layer], [torch.randn(n, KVH, 3, D, generator=gen)
                                     for n in n_pages], n_pages, group, True, 8, 1, 2)[0]
            for layer in range(L)]
    return q, pool, sels, slots, starts, last, marks, page_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_each_layer_attends_as_forward_selected(group, dtype):
    kernel = NativeSparseDecode()
    for seed in range(5):
        q, pool, sels, slots, starts, last, marks, ids = _decode_case(dtype, seed, group)
        plan = selected_plan(kernel, pool, group, slots, starts, last, marks, 200, ids)
        assert plan is not None
        for layer in (3, 1, 0, 2):
            want = kernel.forward_selected(q[layer], pool, sels[layer], group, 0.125,
                                           slots[layer], starts, last, marks, layer * 200, ids)
            got = plan(layer, q[layer].contiguous(), sels[layer], 0.125)
            assert got.dtype == torch.float32
            assert torch.equal(got, want), layer


def test_pools_and_tables_the_c_attention_does_not_serve_get_no_plan():
    kernel = NativeSparseDecode()
    q, pool, sels, slots, starts, last, marks, ids = _decode_case(torch.float32, 2, 3)

    def plan(*args):
        return selected_plan(kernel, *args)

    assert plan(pool, 3, slots, starts, last, marks, 200, ids) is not None
    assert plan(pool.half(), 3, slots, starts, last, marks, 200, ids) is None
    assert plan(pool, 3, slots.int(), starts, last, marks, 200, ids) is None
    assert plan(pool, 3, slots, starts, last.long(), marks, 200, ids) is None
    assert plan(pool, 3, slots, starts[:-1], last, marks, 200, ids) is None
    good = plan(pool, 3, slots, starts, last, marks, 200, ids)
    with pytest.raises(ValueError, match="one of its 4 layers"):
        good(L, q[0].contiguous(), sels[0], 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
def test_each_layer_attends_over_the_table_as_forward(group, dtype):
    kernel = NativeSparseDecode()
    for seed in range(5):
        q, pool, sels, _, _, last, _, _ = _decode_case(dtype, seed, group)
        gen = torch.Generator().manual_seed(seed)
        n = sels[0].union_indices.numel()
        table, _ = selected_head_table(sels[0], torch.arange(n), last, PS)  # entries: positions
        slots = torch.stack([torch.randperm(pool.shape[0], generator=gen)[:n][table.indices]
                             for _ in range(L)])
        plan = table_plan(kernel, pool, group, table, slots)
        assert plan is not None
        for layer in (1, 3, 0, 2):
            want = kernel.forward(q[layer].to(dtype), pool, PageTable(
                table.indptr, slots[layer], table.last_page_len, PS), group, 0.125)
            got = plan(layer, q[layer].to(dtype), 0.125)
            assert got.dtype == dtype and torch.equal(got, want), layer
        assert table_plan(kernel, pool.half(), group, table, slots) is None
        assert table_plan(kernel, pool, group, table, slots.int()) is None
        assert table_plan(kernel, pool, group, table, slots[:, 1:]) is None
        with pytest.raises(ValueError, match="one of its 4 layers"):
            plan(L, q[0].to(dtype), 0.125)
