"""Sparse decode attention on CUDA through FlashInfer (same contract as TorchSparseDecode).

FlashInfer's decode wrapper gives every request one page list shared by all its KV heads, and
each (sequence, KV head) row here has its own. So the rows are run as KVH decode batches, one
per KV head h, each with num_kv_heads = 1:
  queries  q.view(B, KVH, group, D)[:, h]          [B, group, D]
  cache    kv_pool[:, :, h:h + 1]                  [S, 2, 1, page_size, D], a strided view
  table    rows h, KVH + h, 2 * KVH + h, ...       slots into the same pool
Layout requirement: the pool is the single-tensor HND layout [S, 2, KVH, page_size, D]
(KVCache's), run with kv_layout "HND". The per-head view is not contiguous (page stride
2 * KVH * page_size * D; within a page the head's page_size * D values are contiguous);
FlashInfer's paged kernels read the cache through its strides
(BatchDecodeWithPagedKVCacheRun hands paged_k_cache.strides() to paged_kv_t), so nothing is
copied. One wrapper (plan) per KV head, all sharing one float workspace: their runs are ordered
on the same stream. Plan once per layer (each layer selects its own pages).

flashinfer is imported lazily, so this module imports on machines without it.
"""
from __future__ import annotations

import torch

from kernels.page_table import PageTable

_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferSparseDecode:
    """KVH BatchDecodeWithPagedKVCacheWrapper plans, one per KV head (kv_layout "HND")."""

    def __init__(self, device: torch.device | str = "cuda"):
        import flashinfer  # lazy: only CUDA machines have it

        self._flashinfer = flashinfer
        self.device = torch.device(device)
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: list = []
        self._planned: PageTable | None = None
        self._planned_key: tuple | None = None

    def plan(self, head_table: PageTable, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        """Split the (sequence, KV head) rows by head and plan one decode batch per head."""
        group = num_qo_heads // num_kv_heads
        indptr = head_table.indptr.to(torch.int64).cpu()
        indices = head_table.indices.to(torch.int32).cpu()
        last = head_table.last_page_len.to(torch.int32).cpu()
        rows = indptr.shape[0] - 1
        if rows % num_kv_heads:
            raise ValueError(f"{rows} table rows is not a multiple of {num_kv_heads} KV heads")
        counts = indptr[1:] - indptr[:-1]
        head_of_entry = torch.repeat_interleave(torch.arange(rows) % num_kv_heads, counts)
        while len(self._wrappers) < num_kv_heads:
            self._wrappers.append(self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "HND"))
        # NOTE: host tensors (see FlashInferPagedAttention.plan): no wait for the GPU
        for h in range(num_kv_heads):
            counts_h = counts.view(-1, num_kv_heads)[:, h]
            indptr_h = torch.zeros(counts_h.shape[0] + 1, dtype=torch.int32)
            torch.cumsum(counts_h, 0, out=indptr_h[1:])
            self._wrappers[h].plan(
                indptr_h, indices[head_of_entry == h],
                last.view(-1, num_kv_heads)[:, h].contiguous(), group, 1, head_dim,
                head_table.page_size, pos_encoding_mode="NONE", q_data_type=q_dtype,
                kv_data_type=kv_dtype, sm_scale=scale)
        self._planned = head_table
        self._planned_key = (num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale)

    def forward(self, q: torch.Tensor, kv_pool: torch.Tensor, head_table: PageTable,
                group: int, scale: float) -> torch.Tensor:
        """q [B, H, D], kv_pool [S, 2, KVH, page_size, D] -> [B, H, D] (q's dtype)."""
        b, h, d = q.shape
        kvh = kv_pool.shape[2]
        key = (h, kvh, d, q.dtype, kv_pool.dtype, scale)
        if head_table is not self._planned or key != self._planned_key:
            self.plan(head_table, *key)
        qv = q.view(b, kvh, group, d)
        out = torch.empty_like(qv)
        for kh in range(kvh):
            out[:, kh] = self._wrappers[kh].run(qv[:, kh].contiguous(),
                                                kv_pool[:, :, kh:kh + 1])
        return out.view(b, h, d)

    __call__ = forward
