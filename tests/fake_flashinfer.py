"""A stand-in for the flashinfer module on a CPU: its paged wrappers' plan/run contract
(kv_layout "HND", CSR page tables, last_page_len, a bottom-right causal mask for prefill), the
attention computed by our float32 reference. Tests install it as `flashinfer` to run the
FlashInfer backends (kernels/flashinfer_*.py) on a CPU: what they hand FlashInfer (tables,
per-head views of the pool, plans) is checked by the outputs; FlashInfer's own kernels are
checked by the `gpu` tests."""
from __future__ import annotations

import sys
import types

import torch

from kernels.attention import AttentionBatch, reference_paged_attention
from kernels.page_table import PageTable


class _Wrapper:
    plans = 0                                   # plan calls of every wrapper (tests)

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kw):
        assert kv_layout == "HND", "Strata's pool is FlashInfer's HND layout"
        self._plan = None

    def _check_table(self, indptr, indices, last_page_len, page_size):
        indptr, last = indptr.long().cpu(), last_page_len.long().cpu()
        assert indptr[0] == 0 and bool((indptr.diff() >= 0).all())
        assert indices.numel() >= int(indptr[-1])
        empty = indptr.diff() == 0
        assert bool(((last >= 1) & (last <= page_size) | empty).all()), "1 <= last <= page_size"
        return PageTable(indptr.to(torch.int32), indices.to(torch.int32).cpu(),
                         last.to(torch.int32), page_size)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        table, qo_indptr, heads, scale, causal = self._plan
        kv = paged_kv_cache
        assert kv.dim() == 5 and kv.shape[1] == 2, "one HND tensor [pages, 2, kvh, ps, d]"
        assert (q.shape[1], kv.shape[2], q.shape[2]) == heads, "planned head counts and dim"
        assert kv.shape[3] == table.page_size
        if qo_indptr is None:
            qo_indptr = torch.arange(table.batch_size + 1, dtype=torch.int32)
        assert int(qo_indptr[-1]) == q.shape[0]
        batch = AttentionBatch(qo_indptr, table, torch.empty(0, dtype=torch.int64))
        return reference_paged_attention(q, kv, batch, scale).to(q.dtype)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, pos_encoding_mode="NONE", q_data_type=None, kv_data_type=None,
             sm_scale=None, **kw):
        assert pos_encoding_mode == "NONE"
        _Wrapper.plans += 1
        table = self._check_table(indptr, indices, last_page_len, page_size)
        self._plan = (table, None, (num_qo_heads, num_kv_heads, head_dim), sm_scale, False)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim, page_size, causal=False,
             pos_encoding_mode="NONE", sm_scale=None, q_data_type=None, kv_data_type=None,
             **kw):
        assert causal and pos_encoding_mode == "NONE"
        _Wrapper.plans += 1
        table = self._check_table(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                  page_size)
        self._plan = (table, qo_indptr.to(torch.int32).cpu(),
                      (num_qo_heads, num_kv_heads, head_dim), sm_scale, True)


def install(monkeypatch) -> types.ModuleType:
    """Make `import flashinfer` give this stand-in for the test's duration."""
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(_Wrapper, "plans", 0)
    return module
