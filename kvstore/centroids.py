"""CentroidIndex: KVDrive's hierarchical page index, for `--selector centroid`.

Per request, layer and KV head, the pages' mean keys (the mean rows of the page summaries,
kernels/page_summary.py) are clustered by k-means into one centroid per `centroid_pages` pages
(KVDrive: ~15 tokens a centroid over chunks of 4 tokens, 3.7 chunks a centroid; here a chunk
is a page, the unit every tier moves). Each page keeps its cluster's label. The centroids are
kept in the summaries' dtype (the KV dtype: bf16 by default), as Quest's summaries are. A decode
query scores the centroids (q . c, the largest over the query heads of a GQA group, as the page
selectors combine heads), and the pages are ranked by their cluster's rank: whole clusters
best first, and within a cluster the newest pages first, so the cluster at the budget's cut
gives its newest pages. kernels.page_topk.select_pages then keeps the sink pages, the local
window and the prompt prior's pages and fills the budget in that order.

Index bytes per page and KV head: head_dim / centroid_pages values and one int32 label: 68
bytes at head_dim 64, bf16 and 2 pages a centroid, against the 256 bytes of Quest's min/max
rows (`nbytes`, bench/selector_recall.py).

Pages are clustered in blocks of BLOCK_PAGES consecutive pages, one k-means problem each, so
building the index costs O(pages) rather than O(pages^2) (KVDrive clusters a whole context on a
GPU; on a CPU one k-means over 4,096 pages took 3.8 s a layer). A full block is clustered once
and kept; the open block (the newest pages) is clustered when it starts, again each time its
pages double, and once more when it fills; between those its new pages join their nearest
centroid of the block, which moves to the mean of its pages. A full block's clusters depend
only on its pages. Pages are indexed as they leave the local window: during prefill, chunk
after chunk (kvstore/step.py), and by decode's selection. --centroid-pages changing rebuilds
the index.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kernels.page_summary import SUMMARY_MEAN

KMEANS_ITERS = 10
# pages per k-means problem: k-means costs O(pages x clusters), so one over every page of a
# long prompt would cost O(pages^2) (3.8 s a layer at 4,096 pages); in blocks it is linear
BLOCK_PAGES = 256


def _mean_keys(summaries: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The mean keys of pages start .. end-1 as [KVH, n, D] float32; a non-finite mean (an
    overflowed key) zeroed, so k-means++'s draw goes on."""
    return torch.nan_to_num(summaries[start:end, :, SUMMARY_MEAN].float(), nan=0.0, posinf=0.0,
                            neginf=0.0).transpose(0, 1).contiguous()


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
    centroids: torch.Tensor          # [KVH, c, D] in the summaries' dtype, block after block
    counts: torch.Tensor             # [KVH, c] float32: pages per cluster
    labels: torch.Tensor             # [capacity_pages, KVH] int32 (rows < indexed are set)
    indexed: int                     # pages 0 .. indexed-1 carry a label
    pages_per_centroid: int
    tail_start: int = 0              # the open block's first page (those before: full blocks)
    tail_first: int = 0              # its first centroid
    tail_clustered: int = 0          # its pages at its last k-means (0: none yet)


class CentroidIndex:
    """One request's index: per layer, its KV heads' centroids and the pages' labels."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = capacity_pages
        self._layers: dict[int, _LayerIndex] = {}
        self._lock = threading.Lock()     # a layer's prefetch and its selection may overlap

    def update(self, layer: int, summaries: torch.Tensor, upto: int,
               pages_per_centroid: int) -> None:
        """Index the layer's pages 0 .. upto-1, whose summaries [>= upto, KVH, 3, D] hold
        their mean keys: the pages new since the last call are clustered, or join the open
        block's clusters (module docstring)."""
        with self._lock:
            st = self._layers.get(layer)
            if st is None or st.pages_per_centroid != pages_per_centroid:
                if upto <= 0:
                    return
                kvh, d = summaries.shape[1], summaries.shape[-1]
                st = self._layers[layer] = _LayerIndex(
                    torch.empty(kvh, 0, d, dtype=summaries.dtype), torch.zeros(kvh, 0),
                    torch.empty(self.capacity_pages, kvh, dtype=torch.int32), 0,
                    pages_per_centroid)
            while st.indexed < upto:
                end = min(upto, st.tail_start + BLOCK_PAGES)
                span = end - st.tail_start
                if st.tail_clustered == 0 or span == BLOCK_PAGES or span >= 2 * st.tail_clustered:
                    self._cluster_tail(st, summaries, end)
                else:
                    self._join(st, summaries, end)
                if span == BLOCK_PAGES:             # full: frozen, the next block opens
                    st.tail_start, st.tail_first, st.tail_clustered = \
                        end, st.centroids.shape[1], 0

    @staticmethod
    def _cluster_tail(st: _LayerIndex, summaries: torch.Tensor, end: int) -> None:
        """k-means over the open block's pages st.tail_start .. end-1 (its clusters replaced)."""
        x = _mean_keys(summaries, st.tail_start, end)                    # [H, n, D]
        span = end - st.tail_start
        cent, labels, counts = kmeans(x, -(-span // st.pages_per_centroid))
        f = st.tail_first
        st.centroids = torch.cat([st.centroids[:, :f], cent.to(st.centroids.dtype)], 1)
        st.counts = torch.cat([st.counts[:, :f], counts], 1)
        st.labels[st.tail_start:end] = (labels + f).t().to(torch.int32)
        st.indexed, st.tail_clustered = end, span

    @staticmethod
    def _join(st: _LayerIndex, summaries: torch.Tensor, end: int) -> None:
        """Pages st.indexed .. end-1 join their nearest clusters of the open block, whose
        centroids move to the mean of their pages."""
        x = _mean_keys(summaries, st.indexed, end)                       # [H, m, D]
        h, m, d = x.shape
        f = st.tail_first
        cent, counts = st.centroids[:, f:].float(), st.counts[:, f:]
        labels = nearest(x, cent)
        sums = cent * counts[..., None]
        sums.scatter_add_(1, labels[..., None].expand(h, m, d), x)
        counts.scatter_add_(1, labels, torch.ones(h, m))
        cent = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], cent)
        st.centroids[:, f:] = cent.to(st.centroids.dtype)
        st.labels[st.indexed:end] = (labels + f).t().to(torch.int32)
        st.indexed = end

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
