"""Sliding-window attention over pages (kernels/window_attention.py) against a dense masked
reference: GQA, pages in shuffled slots, windows that start inside a page, prefill chunks
longer than a query block, decodes and chunks in one call."""
from __future__ import annotations

import pytest
import torch

from kernels.window_attention import FULL, WindowSeq, first_window_page, window_attention

PS, KVH, GROUP, D = 4, 2, 3, 8


def _reference(q, k, v, start, window, scale, softcap=None):
    """q [t, H, D] at positions start.., k/v [kv_len, KVH, D]: the masked dense attention
    (its scores capped at softcap * tanh(score / softcap), as Gemma 2's)."""
    pos_q = torch.arange(start, start + q.shape[0])
    pos_k = torch.arange(k.shape[0])
    allowed = (pos_k[None] <= pos_q[:, None]) & (pos_k[None] > pos_q[:, None] - window)
    kk, vv = (x.repeat_interleave(GROUP, dim=1).transpose(0, 1) for x in (k, v))
    scores = torch.einsum("thd,hkd->htk", q, kk) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("htk,hkd->thd", scores.softmax(-1), vv)


@pytest.mark.parametrize("window, softcap", [(1, None), (5, None), (8, None), (300, None),
                                             (5, 0.5), (FULL, 0.5)])
def test_window_attention_equals_the_masked_reference(window, softcap):
    g = torch.Generator().manual_seed(window % 1000)
    # (kv_len, q_len): decodes (computed together: one at a page's start, one long), a chunk
    # ending mid-page, a prompt longer than a query block
    shapes = [(23, 1), (30, 9), (610, 610), (5, 1), (401, 1)]
    slots_free = torch.randperm(500, generator=g)
    pool = torch.randn(500, 2, KVH, PS, D, generator=g)
    seqs, qs, refs, at = [], [], [], 0
    for kv_len, q_len in shapes:
        n = -(-kv_len // PS)
        slots = slots_free[at:at + n]
        at += n
        k = pool[slots, 0].transpose(0, 1).reshape(KVH, n * PS, D)[:, :kv_len].transpose(0, 1)
        v = pool[slots, 1].transpose(0, 1).reshape(KVH, n * PS, D)[:, :kv_len].transpose(0, 1)
        start = kv_len - q_len
        q = torch.randn(q_len, KVH * GROUP, D, generator=g)
        first = first_window_page(start, window, PS)
        seqs.append(WindowSeq(slots[first:], first, start, q_len))
        qs.append(q)
        refs.append(_reference(q, k, v, start, window, 0.3, softcap))
    got = window_attention(torch.cat(qs), pool, seqs, window, 0.3, softcap)
    torch.testing.assert_close(got, torch.cat(refs), atol=1e-5, rtol=1e-5)


def test_the_first_page_is_the_window_s():
    assert first_window_page(0, 7, 4) == 0
    assert first_window_page(10, 7, 4) == 1        # keys from position 4 on
    assert first_window_page(11, 7, 4) == 1        # from 5
    assert first_window_page(12, 7, 4) == 1        # from 6
    assert first_window_page(14, 7, 4) == 2        # from 8


def test_the_calibration_seam_attends_within_the_window():
    """kvstore/lowrank.py's causal attention (profile, calibrate) with a window."""
    from kvstore.lowrank import causal_attention
    g = torch.Generator().manual_seed(1)
    q = torch.randn(30, KVH * GROUP, D, generator=g)
    k, v = torch.randn(30, KVH, D, generator=g), torch.randn(30, KVH, D, generator=g)
    torch.testing.assert_close(causal_attention(q, k, v, 0.3, window=6),
                               _reference(q, k, v, 0, 6, 0.3), atol=1e-5, rtol=1e-5)


def test_the_calibration_seam_caps_scores_as_the_model():
    """CaptureKV with Gemma 2's soft-cap (strata profile, calibrate): windowed and full."""
    from kvstore.lowrank import CaptureKV
    g = torch.Generator().manual_seed(2)
    q = torch.randn(30, KVH * GROUP, D, generator=g) * 3
    k, v = torch.randn(30, KVH, D, generator=g), torch.randn(30, KVH, D, generator=g)
    seam = CaptureKV(lambda *_: None, (6, None), softcap=0.5)
    for layer, window in ((0, 6), (1, FULL)):
        torch.testing.assert_close(seam.attend(layer, q, k, v, 0.3),
                                   _reference(q, k, v, 0, window, 0.3, 0.5),
                                   atol=1e-5, rtol=1e-5)
