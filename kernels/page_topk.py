"""Top-k of page scores for sparse decode: `select_pages` and its output, `SelectedPages`.

The selection half of kernels/page_select.py (whose selectors score the pages and call this,
or kernels/_select.c, which computes the same pages in C): per (sequence, KV head) row, the
sink and local pages, then the prompt's top prior pages, then the best-scoring others, listed
ascending, with the union of a sequence's rows (the pages to fetch).

Leaf module: imports only torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SelectedPages:
    """Ragged page lists, one row per (sequence, KV head): row r = b * num_kv_heads + h.

    Page numbers index the sequence's own page list (0 = its first page), not cache slots.
    """
    # [B * KVH + 1] int64: row r is page_indices[indptr[r]:indptr[r+1]]
    indptr: torch.Tensor
    page_indices: torch.Tensor    # [nnz] int64, ascending within each row
    union_indptr: torch.Tensor    # [B + 1] int64
    union_indices: torch.Tensor   # [nnz_union] int64: pages any head of b selected, ascending;
    #                               the pages to fetch (a page holds every KV head)
    num_kv_heads: int
    # [nnz] int64 or None: each page_indices entry's position in union_indices (the C path
    # lists them; others leave it to the reader)
    union_pos: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.union_indptr.shape[0] - 1

    def row(self, b: int, h: int) -> torch.Tensor:
        r = b * self.num_kv_heads + h
        return self.page_indices[int(self.indptr[r]):int(self.indptr[r + 1])]

    def union(self, b: int) -> torch.Tensor:
        return self.union_indices[int(self.union_indptr[b]):int(self.union_indptr[b + 1])]


def check_budget(budget_pages: int | torch.Tensor, sink_pages: int, local_pages: int) -> None:
    """ValueError unless every budget is at least a page and sink / local pages >= 0."""
    if isinstance(budget_pages, torch.Tensor):
        budget_pages = int(budget_pages.min()) if budget_pages.numel() else 0
    if budget_pages < 1 or sink_pages < 0 or local_pages < 0:
        raise ValueError(f"need budget_pages >= 1 and sink/local pages >= 0, got budget "
                         f"{budget_pages}, sink {sink_pages}, local {local_pages}")


def select_pages(scores: torch.Tensor, num_pages: torch.Tensor | Sequence[int],
                 budget_pages: int | torch.Tensor, sink_pages: int, local_pages: int,
                 prior: torch.Tensor | None = None,
                 prior_pages: int | torch.Tensor = 0) -> SelectedPages:
    """Top pages per (sequence, KV head), with the sink pages and the local window always kept.

    scores [B, KVH, P_max] (entries past num_pages[b] are ignored). Row (b, h) keeps
    min(num_pages[b], max(budget_pages, sink_pages + local_pages)) pages: the first sink_pages,
    the last local_pages (which include the partial last page), then the best-scoring others.
    So a sequence with num_pages[b] <= budget_pages keeps every page (dense). NaN and -inf
    scores of real pages rank below every finite score (kept only if the budget has room).
    budget_pages >= 1; a caller wanting dense decode skips selection instead.

    prior [B, KVH, P_max] (optional, e.g. window_page_mass of the prompt): the prior_pages
    pages of each row with the highest finite prior (sink and local pages aside) are kept too,
    within the same budget; -inf marks pages, or whole rows, without a prior.

    budget_pages and prior_pages may be int64 tensors [KVH] instead: a budget per KV head
    (--sparse-budget-plan), the same for every sequence.
    """
    check_budget(budget_pages, sink_pages, local_pages)
    if isinstance(budget_pages, torch.Tensor) or isinstance(prior_pages, torch.Tensor):
        return _select_per_head(scores, num_pages, budget_pages, sink_pages, local_pages,
                                prior, prior_pages)
    b_size, kvh, p_max = scores.shape
    dev = scores.device
    n = torch.as_tensor(num_pages, dtype=torch.int64, device=dev)
    if n.shape != (b_size,):
        raise ValueError(f"num_pages has shape {tuple(n.shape)}, expected ({b_size},)")
    k = min(p_max, max(budget_pages, sink_pages + local_pages))
    pos = torch.arange(p_max, device=dev)
    forced = (pos < sink_pages) | (pos >= n[:, None] - local_pages)   # [B, P]
    past = (pos >= n[:, None])[:, None, :]                             # [B, 1, P]
    finfo = torch.finfo(torch.float32)
    key = torch.nan_to_num(scores.float(), nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    key = key.masked_fill_(forced[:, None, :], float("inf"))
    key = key.masked_fill_(past, -float("inf"))
    if prior is not None and prior_pages > 0:
        pk = min(prior_pages, k - min(k, sink_pages + local_pages), p_max)
        if pk > 0:
            pri = prior.float().masked_fill(forced[:, None, :] | past, -float("inf"))
            pval, ptop = torch.topk(pri, pk, dim=-1, sorted=False)
            # a finite prior puts the page among the forced ones (score +inf)
            key.scatter_(-1, ptop, torch.where(pval > -float("inf"), float("inf"),
                                                key.gather(-1, ptop)))
    # NOTE: unsorted top-k was 2-3x faster than sorted here. A row's live picks are its
    # forced-or-finite ones: exactly min(num_pages[b], k) of them, every forced page included.
    val, top = torch.topk(key, k, dim=-1, sorted=False)            # [B, KVH, k]
    top = torch.where(val != -float("inf"), top, p_max)             # dead entries -> column P
    return _picked(top, p_max)


def _picked(top: torch.Tensor, p_max: int) -> SelectedPages:
    """SelectedPages of the picks top [B, KVH, k] (page numbers; p_max marks a dead pick):
    each row ascending, and each sequence's union over its heads."""
    b_size, kvh, k = top.shape
    chosen = torch.zeros(b_size * kvh, p_max + 1, dtype=torch.bool, device=top.device)
    # NOTE: a row mask + nonzero yields ascending page numbers without sorting each row
    chosen = chosen.scatter_(1, top.reshape(b_size * kvh, k), True)[:, :p_max].contiguous()
    indptr = torch.zeros(b_size * kvh + 1, dtype=torch.int64, device=top.device)
    torch.cumsum(chosen.sum(dim=1), 0, out=indptr[1:])
    hit = chosen.view(b_size, kvh, p_max).amax(dim=1)               # [B, P]: any head
    union_indptr = torch.zeros(b_size + 1, dtype=torch.int64, device=top.device)
    torch.cumsum(hit.sum(dim=1), 0, out=union_indptr[1:])
    return SelectedPages(indptr, chosen.nonzero()[:, 1], union_indptr, hit.nonzero()[:, 1], kvh)


def _select_per_head(scores: torch.Tensor, num_pages, budget_pages, sink_pages: int,
                     local_pages: int, prior: torch.Tensor | None, prior_pages
                     ) -> SelectedPages:
    """select_pages with a budget (and prior pages) per KV head: the row's best pages in
    order, cut at its own count."""
    b_size, kvh, p_max = scores.shape
    n = torch.as_tensor(num_pages, dtype=torch.int64)
    if n.shape != (b_size,):
        raise ValueError(f"num_pages has shape {tuple(n.shape)}, expected ({b_size},)")
    budgets = torch.as_tensor(budget_pages, dtype=torch.int64).expand(kvh)
    k_row = budgets.clamp(min=sink_pages + local_pages).clamp(max=p_max)       # [KVH]
    pos = torch.arange(p_max)
    forced = (pos < sink_pages) | (pos >= n[:, None] - local_pages)             # [B, P]
    past = (pos >= n[:, None])[:, None, :]
    finfo = torch.finfo(torch.float32)
    key = torch.nan_to_num(scores.float(), nan=finfo.min, posinf=finfo.max, neginf=finfo.min)
    key = key.masked_fill_(forced[:, None, :], float("inf")).masked_fill_(past, -float("inf"))
    if prior is not None:
        pk = torch.minimum(torch.as_tensor(prior_pages, dtype=torch.int64).expand(kvh),
                           k_row - (k_row.clamp(max=sink_pages + local_pages)))       # [KVH]
        if int(pk.max()) > 0:
            pri = prior.float().masked_fill(forced[:, None, :] | past, -float("inf"))
            pval, ptop = torch.topk(pri, int(pk.max()), dim=-1, sorted=True)
            live = (pval > -float("inf")) & (torch.arange(ptop.shape[-1]) < pk[:, None])
            key.scatter_(-1, ptop, torch.where(live, float("inf"), key.gather(-1, ptop)))
    k = int(k_row.max())
    val, top = torch.topk(key, k, dim=-1, sorted=True)                          # [B, KVH, k]
    # the row's first k_row[h] picks (forced pages first: they are +inf), live ones only
    keep = (val != -float("inf")) & (torch.arange(k) < k_row[:, None])
    top = torch.where(keep, top, p_max)
    return _picked(top, p_max)


def any_pages(pages: int | torch.Tensor) -> bool:
    """Whether a page count (or any of a tensor of them) is positive."""
    if isinstance(pages, int):          # the common case, without a tensor (once a layer)
        return pages > 0
    return bool((torch.as_tensor(pages) > 0).any())


def select_with_priors(scores: torch.Tensor, counts: list[int],
                       budget_pages: int | torch.Tensor, sink_pages: int, local_pages: int,
                       priors: Sequence[torch.Tensor | None] | None = None,
                       prior_pages: int | torch.Tensor = 0) -> SelectedPages:
    """select_pages over scores [B, KVH, P_max] with per-sequence priors ([>= counts[b], KVH]
    float32 each, or None) as its prior when prior_pages > 0 (budgets and prior pages per KV
    head as select_pages takes them)."""
    prior = None
    if priors is not None and any_pages(prior_pages):
        prior = torch.full_like(scores, -float("inf"))
        for b, p in enumerate(priors):
            if p is not None:
                prior[b, :, :counts[b]] = p[:counts[b]].t()
    return select_pages(scores, counts, budget_pages, sink_pages, local_pages, prior,
                        prior_pages)


def cat_selected(parts: Sequence[SelectedPages]) -> SelectedPages:
    """The selections of consecutive micro-batches as one (rows and sequences in order)."""
    if len(parts) == 1:
        return parts[0]

    def cat_ptr(ptrs: list[torch.Tensor]) -> torch.Tensor:
        out, off = [ptrs[0]], ptrs[0][-1]
        for p in ptrs[1:]:
            out.append(p[1:] + off)
            off = off + p[-1]
        return torch.cat(out)

    return SelectedPages(cat_ptr([p.indptr for p in parts]),
                         torch.cat([p.page_indices for p in parts]),
                         cat_ptr([p.union_indptr for p in parts]),
                         torch.cat([p.union_indices for p in parts]), parts[0].num_kv_heads)
