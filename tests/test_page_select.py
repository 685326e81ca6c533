"""Page scoring (Quest bound, mean key) and top-k selection with sink and local pages."""
from __future__ import annotations

import pytest
import torch

from kernels.page_select import (MeanKeySelector, QuestSelector, SelectedPages, Selector,
                                 make_selector, mean_scores, quest_scores, select_pages)
from kernels.page_summary import summarize_pages

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


def test_unknown_selector_is_a_clear_error():
    with pytest.raises(ValueError, match="--selector must be one of quest, mean"):
        make_selector("lru")


def test_bad_budget_is_rejected():
    with pytest.raises(ValueError, match="budget_pages"):
        select_pages(torch.zeros(1, 1, 4), [4], 0, 1, 1)
