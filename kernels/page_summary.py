"""Page summaries for query-aware page selection (Quest): per page and KV head, the channel-wise
min and max of the page's keys and their mean.

Layout (storage belongs to the caller; the KV store keeps one tensor per request):
  summaries [..., num_pages, num_kv_heads, 3, head_dim], row SUMMARY_MIN / SUMMARY_MAX /
  SUMMARY_MEAN along the "3" axis.

Dtype: the KV dtype is the intended one (fp32 works the same). min and max of stored keys are
themselves stored key values, so in the KV dtype they are exact and Quest's bound stays an upper
bound of every q . k the attention will compute; only the mean (a heuristic) is rounded. That
halves the always-resident footprint against fp32 (3 / (2 * page_size) of the KV bytes: 9.4% at
page 16). When keys arrive in a wider dtype than the summaries (e.g. fp32 keys, bf16 summaries)
min is rounded down and max up, so the bound still holds. Pass the keys as they are stored in the
cache (already cast to the KV dtype): those are the values attention reads.

Leaf module: imports only torch.
"""
from __future__ import annotations

from typing import Sequence

import torch

SUMMARY_MIN, SUMMARY_MAX, SUMMARY_MEAN = 0, 1, 2


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 x as `dtype`, never above x (so a min stays a lower bound)."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -float("inf"))), y)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 x as `dtype`, never below x (so a max stays an upper bound)."""
    y = x.to(dtype)
    if dtype == x.dtype:
        return y
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def _exact(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every `src` value is representable in `dst` (so min/max need no directed rounding)."""
    return src == dst or dst == torch.float32 and src in (torch.bfloat16, torch.float16)


def _pack(mn: torch.Tensor, mx: torch.Tensor, mean: torch.Tensor, dtype: torch.dtype,
          exact: bool) -> torch.Tensor:
    """[n, KVH, D] float32 x 3 -> [n, KVH, 3, D] in `dtype` (min rounded down, max up)."""
    if exact:
        return torch.stack([mn, mx, mean], dim=2).to(dtype)
    return torch.stack([_round_down(mn, dtype), _round_up(mx, dtype), mean.to(dtype)], dim=2)


def summarize_pages(k_pages: torch.Tensor, valid: torch.Tensor | Sequence[int],
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """Summaries of whole pages.

    k_pages [n, KVH, page_size, D] keys, the K half of cache pages as stored (the KV cache's HND
    page layout: pool[slots, 0]); valid [n] tokens held by each page (the first `valid` slots;
    later slots are padding and ignored) -> [n, KVH, 3, D] in `dtype` (default: the keys').
    A page with valid == 0 gets min +inf, max -inf, mean 0 (an empty box).
    """
    n, _, page_size = k_pages.shape[:3]
    dtype = dtype or k_pages.dtype
    valid = torch.as_tensor(valid, dtype=torch.int64, device=k_pages.device)
    if valid.shape != (n,):
        raise ValueError(f"valid has shape {tuple(valid.shape)}, expected ({n},)")
    live = torch.arange(page_size, device=k_pages.device)[None, :] < valid[:, None]
    live = live[:, None, :, None]                                   # [n, 1, page_size, 1]
    k = k_pages.float()
    mn = k.masked_fill(~live, float("inf")).amin(dim=2)             # [n, KVH, D]
    mx = k.masked_fill(~live, -float("inf")).amax(dim=2)
    mean = k.masked_fill(~live, 0.0).sum(dim=2) / valid.clamp(min=1)[:, None, None]
    return _pack(mn, mx, mean, dtype, _exact(k_pages.dtype, dtype))


def update_summaries(summ: torch.Tensor, page_idx: torch.Tensor, offset_in_page: torch.Tensor,
                     k: torch.Tensor, *, distinct_pages: bool = False) -> None:
    """Fold newly appended keys into their pages' summaries, in place.

    summ           [P, KVH, 3, D]  rows of the pages (any row may be a reused, stale one)
    page_idx       [T] int         row of summ each new token lands in
    offset_in_page [T] int         the token's slot within its page
    k              [T, KVH, D]     the new keys (as stored in the KV cache)
    distinct_pages                 every token lands in a different page (a decode step: one
                                   token per sequence); skips grouping tokens by page

    Invariant (true for decode steps and prefill chunks alike): a page is filled in order, from
    offset 0, without gaps. So before the call a page touched here holds exactly as many tokens
    as the smallest offset this call writes to it, and afterwards (largest offset + 1). A page
    written at offset 0 starts afresh: whatever its row held before is discarded, so rows can be
    reused without clearing. min/max are running extremes (bitwise equal to summarize_pages of
    the final page); the mean is stored as a mean and re-weighted by those token counts (no
    count tensor needed), equal to summarize_pages' mean up to rounding in summ's dtype.
    Touched rows are read with one gather and written with one scatter, whatever T is.
    """
    if k.shape[0] == 0:
        return
    page_idx = page_idx.to(torch.int64)
    offset = offset_in_page.to(torch.int64)
    if distinct_pages:
        _update_distinct(summ, page_idx, offset, k)
        return
    pages, inv = torch.unique(page_idx, return_inverse=True)       # [U], [T]
    u = pages.shape[0]
    first = torch.full((u,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=k.device)
    first.scatter_reduce_(0, inv, offset, "amin")                   # tokens held before
    last = torch.full((u,), -1, dtype=torch.int64, device=k.device)
    last.scatter_reduce_(0, inv, offset, "amax")
    kf = k.float()
    old = summ[pages].float()                                       # [U, KVH, 3, D]
    fresh = (first == 0)[:, None, None]
    inf = torch.tensor(float("inf"), device=k.device)
    at = inv[:, None, None].expand_as(kf)
    mn = torch.where(fresh, inf, old[:, :, SUMMARY_MIN]).scatter_reduce_(0, at, kf, "amin")
    mx = torch.where(fresh, -inf, old[:, :, SUMMARY_MAX]).scatter_reduce_(0, at, kf, "amax")
    total = old[:, :, SUMMARY_MEAN] * first.to(torch.float32)[:, None, None]
    total = torch.where(fresh, 0.0, total).index_add_(0, inv, kf)
    mean = total / (last + 1).to(torch.float32)[:, None, None]
    summ[pages] = _pack(mn, mx, mean, summ.dtype, _exact(k.dtype, summ.dtype))


def _update_distinct(summ: torch.Tensor, page_idx: torch.Tensor, offset: torch.Tensor,
                     k: torch.Tensor) -> None:
    """update_summaries when no two tokens share a page: elementwise, no grouping."""
    dtype = summ.dtype
    old = summ[page_idx]                                            # [T, KVH, 3, D]
    if _exact(k.dtype, dtype):
        lo = hi = k.to(dtype)
    else:
        lo, hi = _round_down(k.float(), dtype), _round_up(k.float(), dtype)
    fresh = (offset == 0)[:, None, None]
    mn = torch.where(fresh, lo, torch.minimum(old[:, :, SUMMARY_MIN], lo))
    mx = torch.where(fresh, hi, torch.maximum(old[:, :, SUMMARY_MAX], hi))
    held = offset.to(torch.float32)[:, None, None]
    total = torch.where(fresh, 0.0, old[:, :, SUMMARY_MEAN].float() * held) + k.float()
    summ[page_idx] = torch.stack([mn, mx, (total / (held + 1)).to(dtype)], dim=2)
