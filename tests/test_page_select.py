"""Page scoring (Quest bound, mean key) and top-k selection with sink and local pages."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import page_select
from kernels.page_select import (MeanKeySelector, QuestSelector, Selector, make_selector,
                                 mean_scores, native_select, quest_scores)
from kernels.page_prior import window_page_mass
from kernels.page_table import selected_head_table
from kernels.page_summary import summarize_pages
from kernels.page_topk import SelectedPages, select_pages

AWKWARD_LENS = [27, 61, 113, 577]


def _sequences(lens, page_size, kv_heads, head_dim, dtype=torch.float32, seed=0):
    """Per sequence: keys [n, KVH, D] and summaries [pages + 2 spare rows, KVH, 3, D]."""
    gen = torch.Generator().manual_seed(seed)
    keys, summaries = [], []
    for n in lens:
        pages = -(-n // page_size)
        k = torch.randn(pages * page_size, kv_heads, head_dim, generator=gen).to(dtype)
        valid = [page_size] * (pages - 1) + [n - (pages - 1) * page_size]
        s = summarize_pages(k.view(pages, page_size, kv_heads, head_dim).transpose(1, 2),
                            valid)                                 # pages [n, KVH, ps, D]
        spare = torch.full((2, kv_heads, 3, head_dim), float("nan"), dtype=dtype)  # past the end
        keys.append(k[:n])
        summaries.append(torch.cat([s, spare]))
    return keys, summaries


def _reference_quest(q, summaries, num_pages, group):
    b_size, h, d = q.shape
    kvh = h // group
    out = torch.full((b_size, kvh, max(num_pages)), -float("inf"))
    for b, n in enumerate(num_pages):
        for qh in range(h):
            s = summaries[b][:n, qh // group].float()                   # [n, 3, D]
            qd = q[b, qh].float()
            bound = torch.maximum(qd * s[:, 0], qd * s[:, 1]).sum(-1)   # [n]
            out[b, qh // group, :n] = torch.maximum(out[b, qh // group, :n], bound)
    return out


@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("group", [1, 3])
def test_quest_scores_match_the_elementwise_definition(group, page_size):
    keys, summ = _sequences(AWKWARD_LENS, page_size, 2, 32)
    num_pages = [-(-n // page_size) for n in AWKWARD_LENS]
    q = torch.randn(len(AWKWARD_LENS), 2 * group, 32, generator=torch.Generator().manual_seed(1))
    got = quest_scores(q, summ, torch.tensor(num_pages), group)
    assert got.shape == (len(AWKWARD_LENS), 2, max(num_pages)) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference_quest(q, summ, num_pages, group),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_quest_bound_is_an_upper_bound_of_every_logit_in_the_page(group):
    page_size = 16
    keys, summ = _sequences(AWKWARD_LENS, page_size, 3, 64, dtype=torch.bfloat16)
    q = torch.randn(len(AWKWARD_LENS), 3 * group, 64, generator=torch.Generator().manual_seed(2))
    scores = quest_scores(q, summ, [-(-n // page_size) for n in AWKWARD_LENS], group)
    for b, k in enumerate(keys):
        for qh in range(3 * group):
            logits = k[:, qh // group].float() @ q[b, qh]                # [n]
            pages = torch.arange(k.shape[0]) // page_size
            best = torch.full((int(pages[-1]) + 1,), -float("inf")).scatter_reduce(
                0, pages, logits, "amax")
            assert (scores[b, qh // group, :best.shape[0]] >= best - 1e-4).all()


def test_padded_batch_form_and_pages_past_the_end():
    page_size = 8
    _, summ = _sequences([27, 61], page_size, 3, 16)
    padded = torch.zeros(2, 9, 3, 3, 16)
    padded[0, :4], padded[1, :8] = summ[0][:4], summ[1][:8]
    q = torch.randn(2, 9, 16)
    got = quest_scores(q, padded, [4, 8], 3)
    torch.testing.assert_close(got, quest_scores(q, summ, [4, 8], 3))
    assert (got[0, :, 4:] == -float("inf")).all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("group", [1, 3])
def test_mean_scores_are_the_dot_product_with_the_mean_key(group):
    keys, summ = _sequences(AWKWARD_LENS, 16, 2, 32)
    num_pages = [-(-n // 16) for n in AWKWARD_LENS]
    q = torch.randn(len(AWKWARD_LENS), 2 * group, 32)
    got = mean_scores(q, summ, num_pages, group)
    for b, n in enumerate(num_pages):
        for kh in range(2):
            mean = keys[b][:, kh].split(16)
            want = torch.stack([torch.stack([q[b, kh * group + g] @ m.mean(0) for m in mean])
                                for g in range(group)]).amax(0)
            torch.testing.assert_close(got[b, kh, :n], want, atol=1e-4, rtol=1e-5)
        assert (got[b, :, n:] == -float("inf")).all()


def _reference_select(scores, num_pages, budget, sink, local):
    rows = []
    for b, n in enumerate(num_pages):
        keep = min(n, max(budget, sink + local))
        for h in range(scores.shape[1]):
            forced = {p for p in range(n) if p < sink or p >= n - local}
            rest = sorted((p for p in range(n) if p not in forced),
                          key=lambda p: -float(scores[b, h, p]))
            rows.append(sorted(forced | set(rest[:keep - len(forced)])))
    return rows


@pytest.mark.parametrize("budget,sink,local", [(8, 1, 2), (4, 1, 4), (3, 2, 2), (1, 0, 1),
                                               (64, 1, 4)])
def test_select_pages_keeps_sinks_local_window_and_top_scores(budget, sink, local):
    num_pages = [2, 4, 8, 15, 37, 73]
    scores = torch.randn(len(num_pages), 3, 73, generator=torch.Generator().manual_seed(3))
    sel = select_pages(scores, torch.tensor(num_pages), budget, sink, local)
    want = _reference_select(scores, num_pages, budget, sink, local)
    assert isinstance(sel, SelectedPages) and sel.num_kv_heads == 3
    assert sel.indptr.tolist() == [0] + torch.tensor([len(r) for r in want]).cumsum(0).tolist()
    for b in range(len(num_pages)):
        union = set()
        for h in range(3):
            assert sel.row(b, h).tolist() == want[b * 3 + h]
            union |= set(want[b * 3 + h])
        assert sel.union(b).tolist() == sorted(union)


def test_sequence_within_budget_keeps_every_page():
    scores = torch.randn(2, 3, 70)
    sel = select_pages(scores, [64, 70], 64, 1, 4)
    for h in range(3):
        assert sel.row(0, h).tolist() == list(range(64))
        assert len(sel.row(1, h)) == 64
    assert sel.union(0).tolist() == list(range(64))


def test_nan_and_infinite_scores_never_select_pages_past_the_end():
    scores = torch.full((2, 2, 10), -float("inf"))
    scores[0, 0, 3] = float("nan")
    scores[1, 1, :5] = float("inf")
    sel = select_pages(scores, [6, 10], 4, 1, 1)
    for b, n in enumerate([6, 10]):
        for h in range(2):
            row = sel.row(b, h)
            assert len(row) == 4 and int(row.max()) < n and row.tolist() == sorted(set(row.tolist()))
            assert 0 in row.tolist() and n - 1 in row.tolist()


def test_selectors_behind_the_seam():
    _, summ = _sequences([61, 27], 16, 3, 16)
    q = torch.randn(2, 9, 16)
    for name, fn, cls in (("quest", quest_scores, QuestSelector),
                          ("mean", mean_scores, MeanKeySelector)):
        sel: Selector = make_selector(name)
        assert isinstance(sel, cls) and sel.name == name
        torch.testing.assert_close(sel.score(q, summ, [4, 2], 3), fn(q, summ, [4, 2], 3))


needs_native = pytest.mark.skipif(page_select._select is None,
                                  reason="kernels/_select.c is not built")
_FIELDS = ("indptr", "page_indices", "union_indptr", "union_indices")


def _prior_tensor(priors, counts, like):
    prior = torch.full_like(like, -float("inf"))
    for b, p in enumerate(priors):
        if p is not None:
            prior[b, :, :counts[b]] = p[:counts[b]].t()
    return prior


@pytest.fixture(params=[True, False], ids=["simd", "portable"])
def native_simd(request, monkeypatch):
    """kernels/_select.c with its AVX-512 scoring (where this CPU has it) and its portable one."""
    monkeypatch.setattr(page_select, "NATIVE_SIMD", request.param)
    return request.param


@needs_native
@pytest.mark.parametrize("quest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_select_is_select_pages_over_the_selectors_scores(quest, dtype, native_simd):
    """kernels/_select.c computes the torch selector's scores and, over them, picks exactly
    select_pages' pages: sink, local and prior pages, budgets past the context, GQA groups of
    1-5 heads, head dims that are no multiple of 8 or 16 (24: the AVX-512 scoring for quest's
    48-float rows, the portable one for mean's 24), NaN summaries (a page ranked last), many
    equal scores (ties at the cut), 1-8 sequences shared by 1-4 threads."""
    gen = torch.Generator().manual_seed(2 * int(quest) + (dtype == torch.bfloat16))
    shapes = [(3, 3, 64), (2, 4, 32), (1, 1, 16), (2, 5, 24)]
    for trial in range(40):
        kvh, group, d = shapes[trial % len(shapes)]
        lens = torch.randint(1, 40 * 16, (int(torch.randint(1, 9, (), generator=gen)),),
                             generator=gen).tolist()
        _, summ = _sequences(lens, 16, kvh, d, dtype, seed=trial)
        counts = [-(-n // 16) for n in lens]
        if trial % 5 == 0 and counts[0] > 3:
            summ[0][2] = float("nan")
        ties = trial % 4 == 1 and trial % 5 != 0
        if ties:                    # a few distinct values: many pages score alike
            summ = [(s * 2).round().clamp(-1, 1) / 2 for s in summ]
        q = torch.randn(len(lens), kvh * group, d, generator=gen).to(dtype)
        budget, sink, local, prior_pages = (int(torch.randint(1, 30, (), generator=gen)),
                                            trial % 3, trial % 5, trial % 7)
        priors = [None if b % 3 == 2 else
                  torch.where(torch.rand(c + 2, kvh, generator=gen) < 0.3,
                              torch.randn(c + 2, kvh, generator=gen), -float("inf"))
                  for b, c in enumerate(counts)]
        sel, scores = native_select(q, summ, counts, group, quest, budget, sink, local, priors,
                                    prior_pages, scores=True, threads=1 + trial % 4)
        ref_scores = (quest_scores if quest else mean_scores)(q, summ, counts, group)
        torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=1e-4, equal_nan=True)
        if ties:        # the lower page wins a tie at the cut (torch's top-k: any of them)
            sel = native_select(q, summ, counts, group, quest, budget, sink, local,
                                threads=1 + trial % 4)[0]
            want = _reference_select(scores, counts, budget, sink, local)
            assert [sel.page_indices[a:b].tolist() for a, b in
                    zip(sel.indptr.tolist(), sel.indptr[1:].tolist())] == want, trial
            continue
        ref = select_pages(scores, counts, budget, sink, local,
                           _prior_tensor(priors, counts, scores), prior_pages)
        for f in _FIELDS:
            assert torch.equal(getattr(sel, f), getattr(ref, f)), (trial, f)
        # each listed page's position among the union's, within its own sequence's
        assert torch.equal(sel.union_indices[sel.union_pos], sel.page_indices)
        rows = (sel.indptr[1:] - sel.indptr[:-1]).view(len(lens), kvh).sum(1)
        b_of = torch.repeat_interleave(torch.arange(len(lens)), rows)
        assert bool((sel.union_pos >= sel.union_indptr[b_of]).all())
        assert bool((sel.union_pos < sel.union_indptr[b_of + 1]).all())
        # a selection without them (the torch paths): the same table, positions searched
        slots = torch.randperm(1000)[:sel.union_indices.numel()]
        last = torch.randint(1, 17, (len(lens),), dtype=torch.int32)
        listed = selected_head_table(sel, slots, last, 16)
        searched = selected_head_table(dataclasses.replace(sel, union_pos=None), slots, last, 16)
        assert torch.equal(listed[1], searched[1])
        assert torch.equal(listed[0].indices, searched[0].indices)


@needs_native
def test_selector_select_takes_the_c_path_and_matches_the_torch_path(native_simd):
    _, summ = _sequences(AWKWARD_LENS, 16, 3, 64, torch.bfloat16)
    counts = [-(-n // 16) for n in AWKWARD_LENS]
    q = torch.randn(len(counts), 9, 64).to(torch.bfloat16)
    priors = [torch.randn(c + 2, 3) for c in counts]
    for name in ("quest", "mean"):
        c_path, torch_path = make_selector(name), make_selector(name)
        torch_path.native = False
        got = c_path.select(q, summ, counts, 3, 8, 1, 2, priors, 3)
        want = torch_path.select(q, summ, counts, 3, 8, 1, 2, priors, 3)
        for f in _FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (name, f)
    with pytest.raises(ValueError, match="budget_pages"):
        native_select(q, summ, counts, 3, True, 0, 1, 1)
    # the C code reads n pages of each: shorter inputs are refused before it runs
    with pytest.raises(ValueError, match="summaries of shape"):
        native_select(q, [summ[0][:1]] + summ[1:], counts, 3, True, 8, 1, 1)
    with pytest.raises(ValueError, match="prior of shape"):
        native_select(q, summ, counts, 3, True, 8, 1, 1, [p[:1] for p in priors], 3)


def test_unknown_selector_is_a_clear_error():
    with pytest.raises(ValueError, match="--selector must be one of quest, mean"):
        make_selector("lru")


def test_bad_budget_is_rejected():
    with pytest.raises(ValueError, match="budget_pages"):
        select_pages(torch.zeros(1, 1, 4), [4], 0, 1, 1)


@pytest.mark.parametrize("kv_len,w,group", [(100, 8, 3), (64, 1, 1), (37, 37, 2), (16, 5, 3)])
def test_window_page_mass_is_each_heads_causal_softmax_summed_per_page(kv_len, w, group):
    gen = torch.Generator().manual_seed(kv_len)
    kvh, d, ps = 3, 16, 16
    n = -(-kv_len // ps)
    k = torch.randn(n, kvh, ps, d, generator=gen)
    k.view(n, kvh, ps * d)[-1:, :, (kv_len - (n - 1) * ps) * d:] = float("nan")  # past the end
    q = torch.randn(w, kvh * group, d, generator=gen)
    got = window_page_mass(q.bfloat16(), k.bfloat16(), kv_len, 0.25, group)
    got_max = window_page_mass(q.bfloat16(), k.bfloat16(), kv_len, 0.25, group, reduce="max")
    want = torch.zeros(n, kvh)
    want_max = torch.zeros(n, kvh)
    for j in range(w):                       # query j at position kv_len - w + j
        seen = kv_len - w + j + 1
        for qh in range(kvh * group):
            h = qh // group
            keys = k[:, h].reshape(n * ps, d)[:seen].bfloat16().float()
            p = torch.softmax(keys @ q[j, qh].bfloat16().float() * 0.25, dim=0)
            row = torch.zeros(n)
            for t in range(seen):
                row[t // ps] += p[t]
            want[:, h] += row
            want_max[:, h] = torch.maximum(want_max[:, h], row)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_max, want_max, rtol=1e-4, atol=1e-6)
    # every head's rows sum to one: each KV head receives group * w in all
    torch.testing.assert_close(got.sum(0), torch.full((kvh,), float(group * w)))


def test_prior_pages_are_kept_whatever_their_score_within_the_budget():
    num_pages = [40, 30, 10]
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(3, 2, 40, generator=gen)
    prior = torch.full((3, 2, 40), -float("inf"))
    # the pages the selector ranks lowest get the highest prior
    for b, n in enumerate(num_pages):
        for h in range(2):
            worst = sorted(range(1, n - 2), key=lambda p: float(scores[b, h, p]))[:3]
            prior[b, h, worst] = torch.tensor([3.0, 2.0, 1.0])
    prior[1] = -float("inf")                   # no prior for this sequence: the selector alone
    sel = select_pages(scores, num_pages, 12, 1, 2, prior, prior_pages=2)
    plain = select_pages(scores, num_pages, 12, 1, 2)
    for b, n in enumerate(num_pages):
        for h in range(2):
            row = sel.row(b, h).tolist()
            assert len(row) == min(n, 12)
            assert 0 in row and n - 1 in row and n - 2 in row
            if b == 1 or n <= 12:
                assert row == plain.row(b, h).tolist()
                continue
            top2 = [int(p) for p in torch.topk(prior[b, h, :n], 2).indices]
            assert set(top2) <= set(row)
            third = int(torch.topk(prior[b, h, :n], 3).indices[2])
            assert third not in row               # only prior_pages are forced
            # the rest are the selector's best among the others
            rest = [p for p in row if p not in top2 and p not in (0, n - 1, n - 2)]
            others = sorted((p for p in range(1, n - 2) if p not in top2),
                            key=lambda p: -float(scores[b, h, p]))
            assert sorted(rest) == sorted(others[:len(rest)]) and len(rest) == 12 - 5


def test_prior_pages_never_exceed_the_budget_left_by_sink_and_local():
    scores = torch.zeros(1, 1, 50)
    prior = torch.arange(50, dtype=torch.float32).view(1, 1, 50)
    sel = select_pages(scores, [50], 6, 2, 2, prior, prior_pages=10)
    assert sel.row(0, 0).tolist() == [0, 1, 46, 47, 48, 49]
    sel = select_pages(scores, [50], 8, 2, 2, prior, prior_pages=10)
    assert sel.row(0, 0).tolist() == [0, 1, 44, 45, 46, 47, 48, 49]


@needs_native
def test_a_nan_in_one_query_heads_score_wins_the_groups_max(native_simd):
    """A page whose Quest score is NaN for one query head of a GQA group only (a NaN in its min
    row, which only the head with a negative query there reads) scores NaN for the group, as
    the torch path's amax does, and ranks last; the mean score, NaN in one head's query."""
    _, summ = _sequences([160], 16, 1, 64, seed=3)           # 10 pages, one KV head
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(4))
    q[0, 0, 5], q[0, 1, 5] = -1.0, 1.0
    summ[0][2, 0, 0, 5] = float("nan")
    sel, scores = native_select(q, summ, [10], 2, True, 9, 0, 0, scores=True)
    assert bool(torch.isnan(quest_scores(q, summ, [10], 2)[0, 0, 2]))
    assert bool(torch.isnan(scores[0, 0, 2]))
    assert bool(torch.isfinite(scores[0, 0, torch.arange(10) != 2]).all())
    assert 2 not in sel.page_indices.tolist()
    _, clean = _sequences([160], 16, 1, 64, seed=3)
    q[0, 0, 7] = float("nan")
    _, scores = native_select(q, clean, [10], 2, False, 9, 0, 0, scores=True)
    assert bool(torch.isnan(scores[0, 0]).all())
