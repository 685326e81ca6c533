"""CentroidIndex: KVDrive's hierarchical page index, for `--selector centroid`.

Per request, layer and KV head, the pages' mean keys (the mean rows of the page summaries,
kernels/page_summary.py) are clustered by k-means into one centroid per `centroid_pages` pages
(KVDrive: ~15 tokens a centroid over chunks of 4 tokens, 3.7 chunks a centroid; here a chunk
is a page, the unit every tier moves). Each page keeps its cluster's label. The centroids are
kept in the summaries' dtype (the KV dtype: bf16 by default), as Quest's summaries are. A decode query
scores the centroids (q . c, the largest over the query heads of a GQA group, as the page
selectors combine heads), and the pages are ranked by their cluster's rank: whole clusters
best first, and within a cluster the newest pages first, so the cluster at the budget's cut
gives its newest pages. kernels.page_select.select_pages then keeps the sink pages, the local
window and the prompt prior's pages and fills the budget in that order.

Index bytes per page and KV head: head_dim / centroid_pages values and one int32 label: 68
bytes at head_dim 64, bf16 and 2 pages a centroid, against the 256 bytes of Quest's min/max
rows (`nbytes`, bench/selector_recall.py).

Built by the first sparse selection of each layer after prefill (over every page but the
local window); extended as decode pushes pages out of the local window (each new page joins
its nearest centroid, which moves to the mean of its pages); clustered again once the indexed
pages have doubled since the last k-means, or when --centroid-pages changes.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kernels.page_summary import SUMMARY_MEAN

KMEANS_ITERS = 10


def nearest(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Label of the nearest centroid (Euclidean) of each row: x [H, n, D], centroids
    [H, c, D] -> [H, n] int64."""
    # ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2; the first term is the same for every c
    d = torch.baddbmm((centroids * centroids).sum(-1)[:, None, :], x,
                      centroids.transpose(1, 2), alpha=-2.0)
    return d.argmin(-1)


def kmeans(x: torch.Tensor, c: int, iters: int = KMEANS_ITERS
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lloyd's k-means, one problem per head: x [H, n, D] float32 -> (centroids [H, c, D],
    labels [H, n] int64, counts [H, c] float32), each centroid the mean of its labelled rows
    (a centroid left without rows keeps its place, count 0).

    Seeded by k-means++ from a fixed seed, so the same pages give the same index."""
    h, n, d = x.shape
    if not 1 <= c <= n:
        raise ValueError(f"k-means needs 1 <= clusters <= rows, got {c} clusters of {n} rows")
    cent = _kmeanspp(x, c)
    labels = None
    for _ in range(iters):
        new = nearest(x, cent)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        sums = torch.zeros(h, c, d).scatter_add_(1, labels[..., None].expand(h, n, d), x)
        counts = torch.zeros(h, c).scatter_add_(1, labels, torch.ones(h, n))
        cent = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], cent)
    counts = torch.zeros(h, c).scatter_add_(1, labels, torch.ones(h, n))
    return cent, labels, counts


def _kmeanspp(x: torch.Tensor, c: int) -> torch.Tensor:
    """k-means++ seeds [H, c, D] of x [H, n, D]: each next seed a row drawn with probability
    proportional to its squared distance from the nearest seed so far."""
    h, n, _ = x.shape
    gen = torch.Generator().manual_seed(0)
    heads = torch.arange(h)
    picks = torch.empty(h, c, dtype=torch.int64)
    picks[:, 0] = torch.randint(n, (h,), generator=gen)
    dist = (x - x[heads, picks[:, 0]][:, None]).square_().sum(-1)      # [H, n]
    for i in range(1, c):
        # NOTE: the tiny floor keeps a head whose rows all coincide drawable (uniformly)
        picks[:, i] = torch.multinomial(dist + 1e-30, 1, generator=gen)[:, 0]
        torch.minimum(dist, (x - x[heads, picks[:, i]][:, None]).square_().sum(-1), out=dist)
    return x[heads[:, None], picks]


@dataclass
class _LayerIndex:
    centroids: torch.Tensor          # [KVH, c, D] in the summaries' dtype
    counts: torch.Tensor             # [KVH, c] float32: pages per cluster
    labels: torch.Tensor             # [capacity_pages, KVH] int32 (rows < indexed are set)
    indexed: int                     # pages 0 .. indexed-1 carry a label
    clustered: int                   # pages the last k-means ran over
    pages_per_centroid: int


class CentroidIndex:
    """One request's index: per layer, its KV heads' centroids and the pages' labels."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self._layers: dict[int, _LayerIndex] = {}
        self._lock = threading.Lock()     # a layer's prefetch and its selection may overlap

    def update(self, layer: int, summaries: torch.Tensor, upto: int,
               pages_per_centroid: int) -> None:
        """Index the layer's pages 0 .. upto-1, whose summaries [>= upto, KVH, 3, D] hold
        their mean keys: cluster them, or label the pages new since."""
        with self._lock:
            st = self._layers.get(layer)
            if st is not None and st.pages_per_centroid == pages_per_centroid \
                    and upto < 2 * st.clustered:
                if upto > st.indexed:
                    self._join(st, summaries, upto)
                return
            if upto <= 0:
                return
            # NOTE: a non-finite mean (an overflowed key) would stop k-means++'s draw: zeroed
            x = torch.nan_to_num(summaries[:upto, :, SUMMARY_MEAN].float(), nan=0.0,
                                 posinf=0.0, neginf=0.0).transpose(0, 1).contiguous()
            cent, labels, counts = kmeans(x, -(-upto // pages_per_centroid))
            table = torch.empty(self.capacity_pages, x.shape[0], dtype=torch.int32)
            table[:upto] = labels.t()
            self._layers[layer] = _LayerIndex(cent.to(summaries.dtype), counts, table, upto,
                                              upto, pages_per_centroid)

    @staticmethod
    def _join(st: _LayerIndex, summaries: torch.Tensor, upto: int) -> None:
        """Pages st.indexed .. upto-1 join their nearest clusters, whose centroids move to the
        mean of their pages."""
        x = torch.nan_to_num(summaries[st.indexed:upto, :, SUMMARY_MEAN].float(), nan=0.0,
                             posinf=0.0, neginf=0.0).transpose(0, 1)            # [H, m, D]
        h, m, d = x.shape
        cent = st.centroids.float()
        labels = nearest(x, cent)
        sums = cent * st.counts[..., None]
        sums.scatter_add_(1, labels[..., None].expand(h, m, d), x)
        st.counts.scatter_add_(1, labels, torch.ones(h, m))
        cent = torch.where(st.counts[..., None] > 0, sums / st.counts.clamp_min(1)[..., None],
                           cent)
        st.centroids = cent.to(st.centroids.dtype)
        st.labels[st.indexed:upto] = labels.t().to(torch.int32)
        st.indexed = upto

    def page_keys(self, layer: int, q: torch.Tensor, num_pages: int) -> torch.Tensor:
        """Ranking keys of the layer's pages for one sequence's queries q [KVH, group, D]:
        [KVH, num_pages] float32, higher = kept first: pages of better clusters above those of
        worse ones, newer above older within a cluster; pages without a label (the local
        window) -inf (select_pages keeps them regardless)."""
        st = self._layers.get(layer)
        kvh = q.shape[0]
        keys = torch.full((kvh, num_pages), -float("inf"))
        if st is None:
            return keys
        scores = torch.bmm(q.float(), st.centroids.float().transpose(1, 2)).amax(1)  # [KVH, c]
        c = scores.shape[1]
        rank = torch.empty(kvh, c, dtype=torch.int64)
        rank.scatter_(1, scores.argsort(dim=1, descending=True),
                      torch.arange(c).expand(kvh, c))
        n = min(st.indexed, num_pages)
        page_rank = rank.gather(1, st.labels[:n].t().long())              # [KVH, n]
        keys[:, :n] = (torch.arange(n) - page_rank * num_pages).float()
        return keys

    def nbytes(self, layer: int) -> int:
        """The layer's index bytes (centroids and the labels of its indexed pages); 0 before
        it is built."""
        st = self._layers.get(layer)
        if st is None:
            return 0
        return st.centroids.numel() * st.centroids.element_size() + \
            st.indexed * st.labels.shape[1] * st.labels.element_size()

    def clusters(self, layer: int) -> int:
        st = self._layers.get(layer)
        return 0 if st is None else st.centroids.shape[1]
