"""Page summaries (min / max / mean keys): whole-page op vs incremental updates at append time."""
from __future__ import annotations

import random

import pytest
import torch

from kernels.page_summary import (SUMMARY_MAX, SUMMARY_MEAN, SUMMARY_MIN, summarize_pages,
                                  update_summaries)

AWKWARD_LENS = [27, 61, 113, 577]


def _manual(k_pages, valid):
    """Per-page loop over token-major pages [n, page_size, KVH, D]: [n, KVH, 3, D] float32."""
    out = []
    for page, n in zip(k_pages.float(), valid):
        live = page[:n]                                             # [n, KVH, D]
        out.append(torch.stack([live.amin(0), live.amax(0), live.mean(0)], dim=1))
    return torch.stack(out)


@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("length", AWKWARD_LENS)
def test_summarize_pages_ignores_padding_tokens(length, kv_heads, page_size):
    gen = torch.Generator().manual_seed(length)
    n = -(-length // page_size)
    k = torch.randn(n, page_size, kv_heads, 32, generator=gen)
    valid = [page_size] * (n - 1) + [length - (n - 1) * page_size]
    k[-1, valid[-1]:] = 1e6                                         # padding must not leak in
    got = summarize_pages(k.transpose(1, 2).contiguous(), valid)    # as cached: [n, KVH, ps, D]
    assert got.shape == (n, kv_heads, 3, 32) and got.dtype == torch.float32
    torch.testing.assert_close(got, _manual(k, valid), atol=1e-6, rtol=0)


def test_empty_page_is_an_empty_box():
    got = summarize_pages(torch.randn(2, 1, 4, 8), [0, 4])
    assert torch.isinf(got[0, :, SUMMARY_MIN]).all() and (got[0, :, SUMMARY_MIN] > 0).all()
    assert (got[0, :, SUMMARY_MAX] == -float("inf")).all()
    assert (got[0, :, SUMMARY_MEAN] == 0).all()


def _append_stream(lens, page_size, kv_heads, head_dim, dtype, chunks, seed=0, distinct=False):
    """Append each sequence's keys in chunks (interleaving sequences in every call), into a
    shuffled pool whose rows start out stale. Returns (summaries, keys per seq, rows per seq)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // page_size) for n in lens]
    rows = list(range(sum(need) + 3))
    rng.shuffle(rows)
    page_rows, at = [], 0
    for n in need:
        page_rows.append(rows[at:at + n])
        at += n
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    summ = torch.randn(len(rows), kv_heads, 3, head_dim, generator=gen).to(dtype) * 50  # stale
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        idx, off, ks = [], [], []
        for s, n in enumerate(lens):
            take = min(chunks(s, done[s]), n - done[s])
            for p in range(done[s], done[s] + take):
                idx.append(page_rows[s][p // page_size])
                off.append(p % page_size)
            ks.append(keys[s][done[s]:done[s] + take])
            done[s] += take
        update_summaries(summ, torch.tensor(idx), torch.tensor(off), torch.cat(ks),
                         distinct_pages=distinct)
    return summ, keys, page_rows


def _whole(keys, page_size, dtype):
    n = keys.shape[0]
    pages = -(-n // page_size)
    padded = torch.zeros(pages * page_size, *keys.shape[1:], dtype=keys.dtype)
    padded[:n] = keys
    valid = [page_size] * (pages - 1) + [n - (pages - 1) * page_size]
    k_pages = padded.view(pages, page_size, *keys.shape[1:]).transpose(1, 2).contiguous()
    return summarize_pages(k_pages, valid, dtype)


def _check_stream(lens, page_size, kv_heads, dtype, chunks, mean_tol, distinct=False):
    summ, keys, page_rows = _append_stream(lens, page_size, kv_heads, 16, dtype, chunks,
                                           distinct=distinct)
    for k, rows in zip(keys, page_rows):
        want = _whole(k, page_size, dtype)
        got = summ[torch.tensor(rows)]
        assert torch.equal(got[:, :, SUMMARY_MIN], want[:, :, SUMMARY_MIN])
        assert torch.equal(got[:, :, SUMMARY_MAX], want[:, :, SUMMARY_MAX])
        torch.testing.assert_close(got[:, :, SUMMARY_MEAN].float(),
                                   want[:, :, SUMMARY_MEAN].float(), atol=mean_tol, rtol=0)


@pytest.mark.parametrize("distinct", [False, True])
@pytest.mark.parametrize("dtype,mean_tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_decode_appends_equal_summarize_pages(kv_heads, page_size, dtype, mean_tol, distinct):
    _check_stream(AWKWARD_LENS, page_size, kv_heads, dtype, lambda s, done: 1, mean_tol,
                  distinct)


@pytest.mark.parametrize("dtype,mean_tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("page_size", [16, 8])
def test_prefill_chunks_then_decodes_equal_summarize_pages(page_size, dtype, mean_tol):
    sizes = [100, 7, 45, 1, 1, 13, 300, 1]          # chunk boundaries inside and across pages

    def chunks(s, done):
        return sizes[(s + done) % len(sizes)]

    _check_stream(AWKWARD_LENS, page_size, 3, dtype, chunks, mean_tol)


def test_whole_prompt_in_one_call_of_2048_tokens():
    _check_stream([2048, 27], 16, 3, torch.float32, lambda s, done: 2048, 1e-5)


def test_fp32_keys_into_bf16_summaries_keep_the_bound_outward():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 16, 2, 64, generator=gen)
    got = summarize_pages(k.transpose(1, 2).contiguous(), [16, 16, 5], torch.bfloat16)
    summ = torch.zeros(3, 2, 3, 64, dtype=torch.bfloat16)
    pages = torch.tensor([0] * 16 + [1] * 16 + [2] * 5)
    offs = torch.tensor(list(range(16)) * 2 + list(range(5)))
    update_summaries(summ, pages, offs, torch.cat([k[0], k[1], k[2, :5]]))
    one_by_one = torch.zeros(3, 2, 3, 64, dtype=torch.bfloat16)
    for t in range(pages.shape[0]):
        update_summaries(one_by_one, pages[t:t + 1], offs[t:t + 1],
                         torch.cat([k[0], k[1], k[2, :5]])[t:t + 1], distinct_pages=True)
    for s in (got, summ, one_by_one):
        for p, n in enumerate([16, 16, 5]):
            assert (s[p, :, SUMMARY_MIN].float() <= k[p, :n].amin(0)).all()
            assert (s[p, :, SUMMARY_MAX].float() >= k[p, :n].amax(0)).all()
    assert torch.equal(got[:, :, :2], summ[:, :, :2])
    assert torch.equal(got[:, :, :2], one_by_one[:, :, :2])


@pytest.mark.parametrize("distinct", [False, True])
def test_offset_zero_discards_a_reused_row(distinct):
    summ = torch.full((1, 1, 3, 4), -7.0)
    summ[:, :, SUMMARY_MAX] = 99.0
    summ[:, :, SUMMARY_MEAN] = float("nan")
    k = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    update_summaries(summ, torch.tensor([0]), torch.tensor([0]), k, distinct_pages=distinct)
    for row in (SUMMARY_MIN, SUMMARY_MAX, SUMMARY_MEAN):
        assert summ[0, 0, row].tolist() == [1.0, 2.0, 3.0, 4.0]
