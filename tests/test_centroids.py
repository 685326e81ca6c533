"""--selector centroid (kvstore/centroids.py): k-means over the pages' mean keys, the index as
decode extends it, the page ranking it gives, and the engine selecting through it."""
from __future__ import annotations

import pytest
import torch

from kernels.page_topk import select_pages
from kernels.page_summary import SUMMARY_MEAN
from kvstore.centroids import CentroidIndex, kmeans, nearest
from kvstore.selection import PageSelection
from tests import engine_helpers


def _planted(groups: int, per: int, d: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [groups * per, d] around `groups` orthogonal centres of norm 10 (interleaved in
    order), and each row's group."""
    g = torch.Generator().manual_seed(seed)
    centres = 10 * torch.eye(d)[:groups]
    which = torch.arange(groups * per) % groups
    return centres[which] + 0.1 * torch.randn(groups * per, d, generator=g), which


def test_kmeans_finds_planted_clusters_and_each_centroid_is_its_rows_mean():
    x, which = _planted(5, 12)
    cent, labels, counts = kmeans(x[None], 5)
    lab = labels[0]
    # one label per planted group, and rows of one group share it
    assert len({int(lab[which == k][0]) for k in range(5)}) == 5
    assert all(len(set(lab[which == k].tolist())) == 1 for k in range(5))
    for c in range(5):
        assert torch.allclose(cent[0, c], x[lab == c].mean(0), atol=1e-4)
        assert counts[0, c] == (lab == c).sum()
    assert torch.equal(nearest(x[None], cent), labels)
    with pytest.raises(ValueError, match="clusters"):
        kmeans(x[None], 61)


def _summaries(mean_keys: torch.Tensor) -> torch.Tensor:
    """Page summaries [n, KVH, 3, D] whose mean rows are mean_keys [n, KVH, D]."""
    s = torch.zeros(mean_keys.shape[0], mean_keys.shape[1], 3, mean_keys.shape[2])
    s[:, :, SUMMARY_MEAN] = mean_keys
    return s


def test_index_clusters_then_extends_then_clusters_again_when_doubled():
    x, _ = _planted(4, 10)                                     # 40 pages, 1 KV head
    summ = _summaries(torch.cat([x, x, x])[:, None])           # room for 120 pages
    index = CentroidIndex(capacity_pages=120)
    index.update(3, summ, 40, pages_per_centroid=4)
    assert index.clusters(3) == 10 and index.clusters(0) == 0
    before = index.nbytes(3)
    assert before == 10 * 16 * 4 + 40 * 4                     # float32 centroids, int32 labels
    # decode pushes 5 pages out of the local window: they join their nearest clusters
    index.update(3, summ, 45, pages_per_centroid=4)
    assert index.clusters(3) == 10 and index.nbytes(3) == before + 5 * 4
    st = index._layers[3]
    for c in range(10):       # every centroid is still the mean of the pages labelled with it
        rows = st.labels[:45, 0] == c
        if rows.any():
            assert torch.allclose(st.centroids[0, c], summ[:45][rows, 0, SUMMARY_MEAN].mean(0),
                                  atol=1e-4)
    assert torch.equal(st.labels[40:45, 0].long(),
                       nearest(summ[40:45, :, SUMMARY_MEAN].transpose(0, 1), st.centroids)[0])
    index.update(3, summ, 80, pages_per_centroid=4)            # doubled: k-means again
    assert index.clusters(3) == 20
    index.update(3, summ, 80, pages_per_centroid=8)            # another ratio: again
    assert index.clusters(3) == 10


def test_long_contexts_are_clustered_in_blocks_whatever_order_pages_arrive_in(monkeypatch):
    from kvstore import centroids
    monkeypatch.setattr(centroids, "BLOCK_PAGES", 32)
    sizes = []
    real = centroids.kmeans

    def spy(x, c, iters=centroids.KMEANS_ITERS):
        sizes.append(x.shape[1])
        return real(x, c, iters)
    monkeypatch.setattr(centroids, "kmeans", spy)
    summ = _summaries(torch.randn(100, 2, 8))
    at_once = CentroidIndex(100)
    at_once.update(0, summ, 100, 4)                            # 3 full blocks and 4 pages
    assert max(sizes) == 32 and at_once.clusters(0) == 3 * 8 + 1
    by_step = CentroidIndex(100)
    for upto in range(1, 101):                                 # as decode pushes pages out
        by_step.update(0, summ, upto, 4)
    assert max(sizes) == 32
    a, b = at_once._layers[0], by_step._layers[0]
    # a full block's clusters depend on its pages alone
    assert torch.equal(a.centroids[:, :24], b.centroids[:, :24])
    assert torch.equal(a.labels[:96], b.labels[:96])
    for blk in range(3):                                       # labels stay in their block
        lab = a.labels[32 * blk:32 * (blk + 1)]
        assert bool(((lab >= 8 * blk) & (lab < 8 * (blk + 1))).all())
    for st in (a, b):              # every centroid is the mean of the pages labelled with it
        for h in range(2):
            for c in range(st.centroids.shape[1]):
                rows = st.labels[:100, h] == c
                if rows.any():
                    assert torch.allclose(st.centroids[h, c],
                                          summ[:100][rows, h, SUMMARY_MEAN].mean(0), atol=1e-5)


def test_a_non_finite_mean_key_does_not_stop_the_index():
    summ = _summaries(torch.randn(20, 2, 8))
    summ[3, 1, SUMMARY_MEAN, 0] = float("inf")
    summ[4, 0, SUMMARY_MEAN, 2] = float("nan")
    index = CentroidIndex(24)
    index.update(0, summ, 16, 2)
    index.update(0, summ, 20, 2)                               # joins too
    keys = index.page_keys(0, torch.randn(2, 1, 8), 20)
    assert torch.isfinite(keys[:, :20]).all() and index.clusters(0) == 8


def test_index_bytes_are_under_half_of_quests_summaries():
    """Quest keeps min and max rows (2 x head_dim in the KV dtype) per page and KV head; the
    index one centroid in the KV dtype per 2 pages (the default) and an int32 label."""
    d, pages, kvh = 64, 448, 3
    summ = _summaries(torch.randn(pages, kvh, d)).to(torch.bfloat16)
    index = CentroidIndex(pages + 8)
    index.update(0, summ, pages, 2)
    quest = pages * kvh * 2 * d * torch.bfloat16.itemsize
    assert index.nbytes(0) <= quest / 2
    assert index.nbytes(0) == 224 * kvh * d * 2 + pages * kvh * 4
    # decode's pages join in bf16 too
    index.update(0, torch.cat([summ, summ[:8]]), pages + 8, 2)
    assert index._layers[0].centroids.dtype == torch.bfloat16


def test_whole_clusters_are_taken_best_first_and_the_cut_takes_the_newest():
    d = 16
    x, which = _planted(4, 8, d)                               # 32 pages, groups interleaved
    n = 32 + 2                                                 # and a local window of 2 pages
    summ = _summaries(torch.cat([x, x[:2]])[:, None])
    index = CentroidIndex(n)
    index.update(0, summ, n - 2, pages_per_centroid=8)         # 4 clusters of 8 pages
    centres = torch.stack([x[which == k].mean(0) for k in range(4)])
    q = (3 * centres[2] + centres[0])[None, None]              # [KVH, group, D]: 2 then 0
    keys = index.page_keys(0, q, n)
    assert keys.shape == (1, n) and torch.isinf(keys[0, -2:]).all()
    # sink 0, local 2; budget 2 + 8 + 3: cluster 2 whole, then cluster 0's 3 newest pages
    sel = select_pages(keys[None], [n], 13, 0, 2)
    got = set(sel.row(0, 0).tolist())
    want = set(torch.nonzero(which == 2).flatten().tolist()) | {32, 33} \
        | set(torch.nonzero(which == 0).flatten().tolist()[-3:])
    assert got == want



def _run(smollm2_dir, **kw):
    return engine_helpers.run_code_prompt(smollm2_dir, **kw)


@pytest.mark.slow
def test_centroid_with_a_budget_covering_the_context_equals_dense(smollm2_dir):
    _, dense = _run(smollm2_dir)
    _, got = _run(smollm2_dir, sparse_budget=4096, selector="centroid")
    assert got == dense


@pytest.mark.slow
def test_centroid_selects_within_the_budget_and_indexes_every_sparse_layer(smollm2_dir,
                                                                          monkeypatch):
    built, at_first_selection = [], []
    update = CentroidIndex.update

    def spy(self, layer, summaries, upto, ppc):
        update(self, layer, summaries, upto, ppc)
        built.append((layer, self.clusters(layer), upto))
    monkeypatch.setattr(CentroidIndex, "update", spy)
    select = PageSelection._select_centroid

    def first(self, layer, *args):
        if not at_first_selection:
            at_first_selection.append(len(built))
        return select(self, layer, *args)
    monkeypatch.setattr(PageSelection, "_select_centroid", first)
    engine, got = _run(smollm2_dir, sparse_budget=128, sparse_local_tokens=32,
                       sparse_sink_tokens=16, selector="centroid", sparse_obs_window=0)
    assert len(got) == 24
    snap = engine.store.stats.snapshot()
    assert snap.selected_count > 0 and snap.selected_sum <= 128 * snap.selected_count
    layers = {layer for layer, _, _ in built}
    assert layers == set(range(2, 30))                 # the sparse layers, not the dense two
    # 1 centroid per 2 pages of the indexed prompt, and decode's pages joined
    first = next(c for layer, c, upto in built if layer == 2)
    last_upto = max(upto for layer, _, upto in built if layer == 2)
    assert first == -(-min(upto for layer, _, upto in built if layer == 2) // 2)
    assert last_upto > min(upto for layer, _, upto in built if layer == 2)
    # the prompt's pages were indexed during prefill, before decode's first selection
    assert at_first_selection[0] >= 28 and built[0][1] > 0
