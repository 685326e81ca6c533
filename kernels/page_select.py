"""Query-aware page selection for sparse decode: score pages from their summaries, keep the top.

Quest's two ops, batched: estimate (page scores from page summaries, see kernels.page_summary)
then top-k with sink pages and a local window always kept (kernels/page_topk.py). Scores are
per (sequence, KV head): the query heads of a GQA group share one page list, because they
share the KV head's pages.

Shapes:
  q          [B, H, D]          one decode query per sequence; H = KVH * group, query head h
                                reads KV head h // group
  summaries  B tensors [>= num_pages[b], KVH, 3, D] (a padded [B, P, KVH, 3, D] also works)
  num_pages  [B]                pages of each sequence (its last page may be partial)
  scores     [B, KVH, P_max]    float32, -inf beyond num_pages[b]

`Selector.select` scores and selects in one call: in C without the GIL on the CPU
(kernels/_select.c: 0.58-0.59 ms a layer for 8 x 438 pages with its AVX-512 scoring, 0.72-0.73
with its portable one, against ~0.71 for the torch path, bench/results/sparse_ops.txt; the torch
path also takes the GIL between its ~35 ops, which the pipeline's stage threads want; its
sequences shared by the C decode attention's threads, `threads`), else select_pages over
`score`.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kernels.page_summary import SUMMARY_MAX, SUMMARY_MEAN, SUMMARY_MIN
from kernels.page_topk import SelectedPages, any_pages, check_budget, select_with_priors

try:
    from kernels import _select
except ImportError:         # a checkout whose extensions are not built (`make setup` builds them)
    _select = None

_SELECTOR_NAMES = ("quest", "mean")


def _as_counts(num_pages: torch.Tensor | Sequence[int]) -> list[int]:
    return num_pages.tolist() if isinstance(num_pages, torch.Tensor) else list(num_pages)


def _grouped_scores(qf: torch.Tensor, summaries: Sequence[torch.Tensor], counts: list[int],
                    rows: slice) -> torch.Tensor:
    """max over each GQA group of qf . summary rows, per page.

    qf [B, KVH, group, F] float32, where F = D * (rows' length): qf[..., i * D:(i + 1) * D]
    multiplies summary row rows.start + i. Returns [B, KVH, P_max], -inf past each count.
    """
    b_size, kvh = qf.shape[:2]
    out = torch.full((b_size, kvh, max(counts, default=0)), -float("inf"),
                     dtype=torch.float32, device=qf.device)
    for b, n in enumerate(counts):
        if n == 0:
            continue
        s = summaries[b][:n, :, rows].reshape(n, kvh, -1)           # [n, KVH, F] (a view)
        if s.dtype != torch.float32:
            s = s.float()
        # NOTE: B as a transposed view is what BLAS wants here (no copy): measured faster than
        # the padded-batch bmm (which copies every summary) and than per-head mm.
        torch.amax(torch.bmm(qf[b], s.permute(1, 2, 0)), dim=1, out=out[b, :, :n])
    return out


def quest_scores(q: torch.Tensor, summaries: Sequence[torch.Tensor],
                 num_pages: torch.Tensor | Sequence[int], group: int) -> torch.Tensor:
    """Quest's upper bound of q . k over each page, per (sequence, KV head): [B, KVH, P_max].

    Per query head: sum_d max(q_d * max_d, q_d * min_d), computed as q+ . max + q- . min (one
    matmul; equal because q_d * max_d >= q_d * min_d exactly when q_d >= 0). The heads of a GQA
    group are combined by their max: the result then bounds the largest logit any head of the
    group can see in the page, so a page that is critical for a single head (a retrieval head
    finding the needle) survives. A sum would rank pages by an unnormalised blend of the heads'
    bounds, where heads with large query norms drown the others.
    """
    b_size, h, d = q.shape
    qf = q.float().view(b_size, h // group, group, d)
    qq = torch.cat([qf.clamp(max=0), qf.clamp(min=0)], dim=-1)     # pairs with [min, max]
    return _grouped_scores(qq, summaries, _as_counts(num_pages),
                           slice(SUMMARY_MIN, SUMMARY_MAX + 1))


def mean_scores(q: torch.Tensor, summaries: Sequence[torch.Tensor],
                num_pages: torch.Tensor | Sequence[int], group: int) -> torch.Tensor:
    """q . (mean key of the page), max over each GQA group (as quest_scores): [B, KVH, P_max].

    Half the summary bytes of Quest's bound and no sign split, but not a bound: a page with one
    outstanding key among ordinary ones can rank low.
    """
    b_size, h, d = q.shape
    qf = q.float().view(b_size, h // group, group, d)
    return _grouped_scores(qf, summaries, _as_counts(num_pages),
                           slice(SUMMARY_MEAN, SUMMARY_MEAN + 1))


class Selector(Protocol):
    """Scores the pages of each (sequence, KV head) from the page summaries.

    `score(q [B, H, D], summaries (B x [>= num_pages[b], KVH, 3, D]), num_pages [B], group)`
    -> [B, KVH, P_max] float32, higher = keep first, -inf past num_pages[b]. select_pages turns
    scores into page lists, so a selector only decides the ranking.
    """

    name: str

    def score(self, q: torch.Tensor, summaries: Sequence[torch.Tensor],
              num_pages: torch.Tensor | Sequence[int], group: int) -> torch.Tensor: ...

    def select(self, q: torch.Tensor, summaries: Sequence[torch.Tensor],
               num_pages: torch.Tensor | Sequence[int], group: int, budget_pages: int,
               sink_pages: int, local_pages: int,
               priors: Sequence[torch.Tensor | None] | None = None,
               prior_pages: int = 0, threads: int = 1) -> "SelectedPages": ...


class _Selector:
    """`select`: select_pages over the subclass's `score`, in one C call when it serves the
    inputs (`quest` picks the C scoring)."""

    name: str
    quest: bool
    native = True       # False: always the torch path (whose `score` a caller may wrap)

    def select(self, q, summaries, num_pages, group, budget_pages, sink_pages, local_pages,
               priors=None, prior_pages=0, threads=1):
        """select_pages(score(...)), with `priors` (per sequence [>= num_pages[b], KVH]
        float32, or None) as its prior when prior_pages > 0; the C call shares its sequences
        among `threads` threads."""
        counts = _as_counts(num_pages)
        priors = priors if any_pages(prior_pages) else None
        if self.native and native_select_serves(q, summaries, priors):
            return native_select(q, summaries, counts, group, self.quest, budget_pages,
                                 sink_pages, local_pages, priors, prior_pages,
                                 threads=threads)[0]
        return select_with_priors(self.score(q, summaries, counts, group), counts,
                                  budget_pages, sink_pages, local_pages, priors, prior_pages)


class QuestSelector(_Selector):
    """Quest's min/max bound (the default)."""

    name = "quest"
    quest = True

    def score(self, q, summaries, num_pages, group):
        return quest_scores(q, summaries, num_pages, group)


class MeanKeySelector(_Selector):
    """Dot product with each page's mean key (chunk mean keys)."""

    name = "mean"
    quest = False

    def score(self, q, summaries, num_pages, group):
        return mean_scores(q, summaries, num_pages, group)


def make_selector(name: str) -> Selector:
    """The selector called `name`, chosen once at start-up."""
    if name == "quest":
        return QuestSelector()
    if name == "mean":
        return MeanKeySelector()
    raise ValueError(f"--selector must be one of {', '.join(_SELECTOR_NAMES)} (got {name!r})")


# kernels/_select.c scores with AVX-512 where the CPU has it (and the summary row is a multiple
# of 16 floats); False: its portable scoring everywhere (the two round differently)
NATIVE_SIMD = True


def native_select_serves(q: torch.Tensor, summaries: Sequence[torch.Tensor],
                         priors: Sequence[torch.Tensor | None] | None) -> bool:
    """Whether kernels/_select.c takes these inputs: CPU, contiguous, bf16 or float32
    summaries of one dtype, float32 priors, GQA groups of at most 16 heads of at most 256."""
    if _select is None or q.device.type != "cpu" or not summaries:
        return False
    kvh = summaries[0].shape[1] if summaries[0].dim() == 4 else 0
    if not kvh or q.shape[1] % kvh or q.shape[1] // kvh > 16 or q.shape[2] > 256:
        return False
    dt = summaries[0].dtype
    if dt not in (torch.bfloat16, torch.float32) or not all(
            s.device.type == "cpu" and s.dtype == dt and s.is_contiguous() for s in summaries):
        return False
    return priors is None or all(p is None or (p.device.type == "cpu" and p.is_contiguous()
                                               and p.dtype == torch.float32) for p in priors)


def native_budget(budget_pages: int | torch.Tensor, prior_pages: int | torch.Tensor,
                  num_kv_heads: int) -> tuple[int, int, torch.Tensor | None]:
    """A layer's budget and prior pages, one for all KV heads or one each, as the C selection
    takes them: (the largest budget, the largest prior share, int64 [2, KVH] each head's
    budget then prior share, or None when they are one for all)."""
    if not (isinstance(budget_pages, torch.Tensor) or isinstance(prior_pages, torch.Tensor)):
        return int(budget_pages), int(prior_pages), None
    heads = torch.stack([torch.as_tensor(budget_pages, dtype=torch.int64).expand(num_kv_heads),
                         torch.as_tensor(prior_pages, dtype=torch.int64).expand(num_kv_heads)])
    heads = heads.contiguous()
    return int(heads[0].max()), int(heads[1].max()), heads


def native_select(q: torch.Tensor, summaries: Sequence[torch.Tensor], counts: list[int],
                  group: int, quest: bool, budget_pages: int | torch.Tensor, sink_pages: int,
                  local_pages: int, priors: Sequence[torch.Tensor | None] | None = None,
                  prior_pages: int | torch.Tensor = 0, scores: bool = False, threads: int = 1
                  ) -> tuple[SelectedPages, torch.Tensor | None]:
    """select_pages over quest_scores (quest) or mean_scores, in C (`native_select_serves`
    inputs); budgets and prior pages one for all or one per KV head. Returns (the selection,
    the scores [B, KVH, P_max] when `scores`, else None); ties at the cut go to the lower page
    number. `threads`: the sequences shared by that many threads (the C decode attention's
    pool; the same bits for any count)."""
    check_budget(budget_pages, sink_pages, local_pages)
    b_size, h, d = q.shape
    kvh = h // group
    budget_pages, prior_pages, heads = native_budget(budget_pages, prior_pages, kvh)
    # NOTE: the C code trusts these shapes (it reads n pages of each)
    for b, (s, n) in enumerate(zip(summaries, counts)):
        if s.dim() != 4 or s.shape[0] < n or s.shape[1:] != (kvh, 3, d):
            raise ValueError(f"summaries of shape {tuple(s.shape)} for {n} pages of "
                             f"{kvh} KV heads x {d}")
        p = priors[b] if priors is not None else None
        if p is not None and (p.dim() != 2 or p.shape[0] < n or p.shape[1] != kvh):
            raise ValueError(f"prior of shape {tuple(p.shape)} for {n} pages of {kvh} KV heads")
    p_max = max(counts, default=0)
    k = min(p_max, max(budget_pages, sink_pages + local_pages))
    # NOTE: the inputs in one tensor and the outputs in one buffer: a torch call costs ~1-3
    # us, and a step makes this call once a sparse layer
    ins = torch.tensor([t.data_ptr() for t in summaries] + list(counts) + (
        [] if priors is None else [0 if p is None else p.data_ptr() for p in priors]),
        dtype=torch.int64)
    sizes = select_outputs(b_size, kvh, k, p_max)
    out = torch.full((b_size, kvh, p_max), -float("inf")) if scores else None
    sel = call_select(q.float().contiguous(), ins.data_ptr(), priors is not None,
                      summaries[0].dtype == torch.bfloat16, quest, kvh, group,
                      (budget_pages, prior_pages, heads), sink_pages, local_pages,
                      torch.empty(sum(sizes), dtype=torch.int64), sizes,
                      0 if out is None else out.data_ptr(), threads)
    return sel, out


def select_outputs(b_size: int, kvh: int, k: int, p_max: int) -> list[int]:
    """The parts of a C selection call's int64 output buffer (`call_select`) for budgets of
    at most k pages: indptr, page indices, the union's indptr and indices, union positions."""
    rows, entries = b_size * kvh, b_size * kvh * k
    return [rows + 1, entries, b_size + 1, b_size * p_max, entries]


def call_select(qf: torch.Tensor, ins: int, priors: bool, bf16: bool, quest: bool, kvh: int,
                group: int, budget: tuple[int, int, torch.Tensor | None], sink_pages: int,
                local_pages: int, out: torch.Tensor, sizes: list[int], scores: int,
                threads: int) -> SelectedPages:
    """kernels/_select.c's select_pages (inputs checked by the caller) for queries qf
    [B, H, D] float32 contiguous: `ins` the address of B summary addresses, B page counts
    and (`priors`) B prior addresses, int64; `budget` as native_budget gives it; out an int64
    buffer of `sizes` (select_outputs); scores the address of a float32 [B, KVH, P_max] for
    the scores, or 0."""
    b_size, _, d = qf.shape
    budget_pages, prior_pages, heads = budget
    indptr, indices, uindptr, uindices, upos = out.split(sizes)
    nnz, unnz = _select.select_pages(
        qf.data_ptr(), ins, ins + 16 * b_size if priors else 0, int(bf16), int(quest), b_size,
        kvh, group, d, ins + 8 * b_size, budget_pages, sink_pages, local_pages, prior_pages,
        indptr.data_ptr(), indices.data_ptr(), uindptr.data_ptr(), uindices.data_ptr(), scores,
        NATIVE_SIMD, 0 if heads is None else heads.data_ptr(), upos.data_ptr(),
        max(1, threads))
    return selected_pages(out, sizes, kvh, nnz, unnz)


def selected_pages(out: torch.Tensor, sizes: list[int], kvh: int, nnz: int, unnz: int
                   ) -> SelectedPages:
    """The SelectedPages a C selection wrote into `out` (select_outputs' `sizes`), with `nnz`
    entries and `unnz` union entries."""
    indptr, indices, uindptr, uindices, upos = out.split(sizes)
    return SelectedPages(indptr, indices[:nnz], uindptr, uindices[:unnz], kvh, upos[:nnz])
