"""Paged causal attention on CUDA through FlashInfer (same contract as TorchPagedAttention).

The per-layer cache tensor [P, 2, KVH, page_size, D] is FlashInfer's single-tensor "HND" paged
layout (K at [:, 0], V at [:, 1]) and PageTable is its CSR page table, so nothing is converted:
`plan` hands qo_indptr / indptr / indices / last_page_len to the wrapper once per step, and
`forward` runs it for each layer. Pure decode steps (every q_len == 1) use the decode wrapper;
any step with a prefill chunk uses the prefill wrapper with a bottom-right-aligned causal mask
(query j of a sequence sees kv positions <= kv_len - q_len + j), as in TorchPagedAttention.

flashinfer is imported lazily, so this module imports on machines without it.
"""
from __future__ import annotations

import torch

from kernels.attention import AttentionBatch

# NOTE: FlashInfer's examples use a 128 MiB float workspace; split-kv decode over long
# contexts needs it.
_WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferPagedAttention:
    """FlashInfer BatchPrefill/BatchDecode wrappers over the paged cache (kv_layout "HND")."""

    def __init__(self, device: torch.device | str = "cuda"):
        import flashinfer  # lazy: only CUDA machines have it

        self.device = torch.device(device)
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "HND")
        self._planned: AttentionBatch | None = None
        self._planned_key: tuple | None = None
        self._wrapper = None

    def plan(self, batch: AttentionBatch, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype, scale: float) -> None:
        """Plan one step; every layer's `forward` with this batch reuses the plan."""
        pt = batch.page_table
        # NOTE: host tensors: plan reads indptr and last_page_len on the host, and a device
        # tensor there would make it wait for the GPU; it copies the tables up itself
        indptr = pt.indptr.to("cpu", torch.int32)
        indices = pt.indices.to("cpu", torch.int32)
        last_page_len = pt.last_page_len.to("cpu", torch.int32)
        qo_indptr = batch.qo_indptr.to("cpu", torch.int32)
        q_lens = qo_indptr[1:] - qo_indptr[:-1]
        if bool((q_lens == 1).all()):
            self._decode.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                              head_dim, pt.page_size, pos_encoding_mode="NONE",
                              q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=scale)
            self._wrapper = self._decode
        else:
            self._prefill.plan(qo_indptr, indptr, indices, last_page_len,
                               num_qo_heads, num_kv_heads, head_dim, pt.page_size,
                               causal=True, pos_encoding_mode="NONE", sm_scale=scale,
                               q_data_type=q_dtype, kv_data_type=kv_dtype)
            self._wrapper = self._prefill
        self._planned = batch
        self._planned_key = (num_qo_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale)

    def forward(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch,
                scale: float) -> torch.Tensor:
        """q [T, H, D], kv_layer [P, 2, KVH, page_size, D] -> out [T, H, D] (q's dtype)."""
        key = (q.shape[1], kv_layer.shape[2], q.shape[2], q.dtype, kv_layer.dtype, scale)
        if batch is not self._planned or key != self._planned_key:
            self.plan(batch, *key)
        return self._wrapper.run(q, kv_layer)

    __call__ = forward
