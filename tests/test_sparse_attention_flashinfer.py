"""FlashInferSparseDecode, the sparse decode attention's CUDA backend: against the torch
reference (CUDA + flashinfer only), and its one batch per KV head planned through a stand-in
flashinfer module (CPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.page_table import build_head_page_table
from kernels.sparse_attention import reference_sparse_decode_attention
from tests.test_flashinfer_attention import gpu
from tests.test_sparse_attention import AWKWARD_LENS, HEAD_DIM, _pool, _random_selection


@gpu
@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("budget", [5, 1000])
def test_flashinfer_sparse_decode_matches_torch(budget, group, page_size):
    from kernels.flashinfer_sparse_attention import FlashInferSparseDecode

    pool, slots = _pool(AWKWARD_LENS, page_size, 3, torch.bfloat16, seed=7)
    sel = _random_selection(AWKWARD_LENS, page_size, 3, budget, seed=8)
    table = build_head_page_table(sel.indptr, sel.page_indices, slots, AWKWARD_LENS, page_size)
    q = torch.randn(len(AWKWARD_LENS), 3 * group, HEAD_DIM).to(torch.bfloat16)
    want = reference_sparse_decode_attention(q, pool, table, group, 0.125)
    got = FlashInferSparseDecode("cuda").forward(q.cuda(), pool.cuda(), table, group, 0.125)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=0)


class _FakeWrapper:
    def __init__(self, workspace, layout):
        assert layout == "HND"
        self.calls = []

    def plan(self, *args, **kwargs):
        self.calls.append(("plan", args, kwargs))

    def run(self, q, kv):
        self.calls.append(("run", q.shape, kv.shape, kv.stride()))
        return q * 0 + len(self.calls)


def test_flashinfer_sparse_decode_plans_one_batch_per_kv_head(monkeypatch):
    """CPU-only wiring check with a stand-in flashinfer module."""
    import sys
    import types

    from kernels.flashinfer_sparse_attention import FlashInferSparseDecode

    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    attn = FlashInferSparseDecode("cpu")
    slots = torch.tensor([[5, 1, 6], [3, 2, -1]])
    indptr = torch.tensor([0, 2, 3, 4, 6])          # (b0,h0)=[0,1] (b0,h1)=[2] (b1,h0)=[0] ...
    table = build_head_page_table(indptr, torch.tensor([0, 1, 2, 0, 0, 1]), slots, [9, 6], 4)
    pool = torch.zeros(8, 2, 2, 4, 16)               # HND: KVH 2, page 4
    q = torch.zeros(2, 6, 16)
    out = attn.forward(q, pool, table, 3, 0.25)
    attn.forward(q, pool, table, 3, 0.25)            # same table: planned once
    h0, h1 = attn._wrappers
    (_, args0, kw0), (_, args1, _) = h0.calls[0], h1.calls[0]
    assert [c[0] for c in h0.calls] == ["plan", "run", "run"]
    assert args0[0].tolist() == [0, 2, 3] and args0[1].tolist() == [5, 1, 3]
    assert args0[2].tolist() == [4, 4] and args0[3:7] == (3, 1, 16, 4)
    assert args1[0].tolist() == [0, 1, 3] and args1[1].tolist() == [6, 3, 2]
    assert args1[2].tolist() == [1, 2] and kw0["sm_scale"] == 0.25
    _, q_shape, kv_shape, kv_stride = h1.calls[1]
    assert q_shape == (2, 3, 16) and kv_shape == (8, 2, 1, 4, 16)
    assert kv_stride == pool.stride()                # a view of the pool, no copy
    assert (out.view(2, 2, 3, 16)[:, 0] == 2).all() and (out.view(2, 2, 3, 16)[:, 1] == 2).all()
