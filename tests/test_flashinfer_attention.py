"""FlashInferPagedAttention against the torch backend (CUDA + flashinfer only)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.attention import TorchPagedAttention, reference_paged_attention
from tests.test_attention import AWKWARD_KV_LENS, _random_step

needs_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or importlib.util.find_spec("flashinfer") is None,
                       reason="needs CUDA and flashinfer"),
]


def gpu(fn):
    for mark in needs_gpu:
        fn = mark(fn)
    return fn

HEAD_DIM = 64   # FlashInfer kernels are compiled for head_dim 64/128/256


def _compare(kv_lens, q_lens, page_size, kv_heads, group, dtype=torch.bfloat16):
    from kernels.flashinfer_attention import FlashInferPagedAttention

    q, cache, batch = _random_step(kv_lens, q_lens, page_size, kv_heads, HEAD_DIM, group, dtype)
    scale = HEAD_DIM ** -0.5
    want = TorchPagedAttention().forward(q.float(), cache.layer(0).float(), batch, scale)
    torch.testing.assert_close(want, reference_paged_attention(q, cache.layer(0), batch, scale),
                               atol=1e-4, rtol=0)
    attn = FlashInferPagedAttention("cuda")
    attn.plan(batch, q.shape[1], kv_heads, HEAD_DIM, dtype, dtype, scale)
    got = attn.forward(q.cuda(), cache.layer(0).cuda(), batch, scale)
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=0)


@gpu
@pytest.mark.parametrize("page_size", [16, 8])
def test_flashinfer_decode_matches_torch(page_size):
    _compare(AWKWARD_KV_LENS, [1] * len(AWKWARD_KV_LENS), page_size, kv_heads=2, group=4)


@gpu
@pytest.mark.parametrize("page_size", [16, 8])
def test_flashinfer_mixed_prefill_and_decode_matches_torch(page_size):
    _compare([1, 15, 16, 17, 27, 61, 113, 577], [1, 15, 1, 5, 27, 1, 40, 100], page_size,
             kv_heads=2, group=4)


@gpu
def test_flashinfer_gqa_smollm2_shape_matches_torch():
    _compare([27, 577], [27, 1], 16, kv_heads=3, group=3)


class _FakeWrapper:
    def __init__(self, workspace, layout):
        assert layout == "HND"
        self.calls = []

    def plan(self, *args, **kwargs):
        self.calls.append(("plan", args, kwargs))

    def run(self, q, kv):
        self.calls.append(("run", q.shape, kv.shape))
        return q


def test_page_table_and_step_kind_reach_the_right_flashinfer_wrapper(monkeypatch):
    """CPU-only wiring check with a stand-in flashinfer module."""
    import sys
    import types

    from kernels.attention import AttentionBatch
    from kernels.flashinfer_attention import FlashInferPagedAttention

    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
                                 BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    attn = FlashInferPagedAttention("cpu")
    kv = torch.zeros(8, 2, 2, 4, 16)                            # HND: KVH 2, page 4
    decode = AttentionBatch.build([[5, 1], [3]], [6, 2], [1, 1], 4)
    attn.forward(torch.zeros(2, 4, 16), kv, decode, 0.25)
    attn.forward(torch.zeros(2, 4, 16), kv, decode, 0.25)      # same batch: planned once
    (kind, args, kw), run1, run2 = attn._decode.calls
    assert kind == "plan" and [run1[0], run2[0]] == ["run", "run"] and not attn._prefill.calls
    assert args[0].tolist() == [0, 2, 3] and args[1].tolist() == [5, 1, 3]
    assert args[2].tolist() == [2, 2] and args[3:7] == (4, 2, 16, 4)
    assert kw["sm_scale"] == 0.25 and kw["q_data_type"] == torch.float32
    mixed = AttentionBatch.build([[5, 1], [3]], [6, 2], [3, 1], 4)
    attn.forward(torch.zeros(4, 4, 16), kv, mixed, 0.25)
    (kind, args, kw), _ = attn._prefill.calls
    assert args[0].tolist() == [0, 3, 4] and kw["causal"] is True
