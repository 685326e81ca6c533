"""kernels/_select.c with fewer sequences than threads: the threads score page ranges of each
sequence first, then select. The scores and pages are those of one thread, bit for bit."""
from __future__ import annotations

import pytest
import torch

from kernels import page_select
from kernels.page_select import native_select

pytestmark = pytest.mark.skipif(page_select._select is None,
                                reason="kernels/_select.c is not built")


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("quest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_ranges_on_threads_give_one_threads_bits(monkeypatch, simd, quest, dtype):
    monkeypatch.setattr(page_select, "NATIVE_SIMD", simd)
    gen = torch.Generator().manual_seed(7)
    for trial, (kvh, group, d) in enumerate([(3, 3, 64), (2, 4, 32), (1, 2, 24)] * 3):
        counts = torch.randint(90, 700, (1 + trial % 3,), generator=gen).tolist()
        summ = [torch.randn(n + 3, kvh, 3, d, generator=gen).to(dtype) for n in counts]
        summ[0][5] = float("nan")               # ranked last, wherever its range falls
        if trial % 2:                           # many equal scores: ties at the cut
            summ = [(s * 2).round().clamp(-1, 1) / 2 for s in summ]
        q = torch.randn(len(counts), kvh * group, d, generator=gen)
        priors = [torch.randn(n, kvh, generator=gen) for n in counts]
        one, one_scores = native_select(q, summ, counts, group, quest, 40, 1, 4, priors, 6,
                                        scores=True, threads=1)
        for threads in (2, 3, 4, 7):
            got, scores = native_select(q, summ, counts, group, quest, 40, 1, 4, priors, 6,
                                        scores=True, threads=threads)
            assert torch.equal(scores.view(torch.int32), one_scores.view(torch.int32)), \
                (trial, threads)
            for f in ("indptr", "page_indices", "union_indptr", "union_indices", "union_pos"):
                assert torch.equal(getattr(got, f), getattr(one, f)), (trial, threads, f)


def test_no_sequences_select_nothing_on_any_threads():
    # the C entry itself (native_select needs a sequence for the summaries' dtype)
    q = torch.zeros(1, 9, 64)
    out = torch.full((8,), -1, dtype=torch.int64)
    for threads in (1, 2, 4):
        nnz, unnz = page_select._select.select_pages(
            q.data_ptr(), out.data_ptr(), 0, 1, 1, 0, 3, 3, 64, out.data_ptr(), 8, 1, 2, 0,
            out.data_ptr(), out.data_ptr(), out[4:].data_ptr(), out.data_ptr(), 0, True, 0, 0,
            threads)
        assert (nnz, unnz) == (0, 0) and out[0] == 0 and out[4] == 0    # the two indptrs
