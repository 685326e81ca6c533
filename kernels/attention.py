"""Causal attention over a paged KV cache: the torch backend (CPU, or any device) and its reference.

Conventions for one step over B sequences and T = sum(q_len_i) query tokens:
  q         [T, H, D]                         query tokens, sequence after sequence
  kv_layer  [P, 2, KVH, page_size, D]         one layer of the cache, K at [:, 0], V at [:, 1]
                                              (FlashInfer's "HND" paged layout)
  sequence i owns q rows qo_indptr[i]:qo_indptr[i + 1] (q_len_i) and kv_len_i cached tokens
  (page_table.kv_len(i), which INCLUDES this step's new tokens, already written). Its queries are
  the last q_len_i of its kv_len_i positions: query j sees kv positions <= kv_len_i - q_len_i + j.
GQA: H = KVH * group; query head h reads kv head h // group.

Leaf module: imports only torch and kernels (the backend for a device: kernels/backends.py).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from kernels.decode_upcast import Upcast, upcast_wins
from kernels.page_table import PageTable, build_page_table


@dataclass(frozen=True)
class AttentionBatch:
    """What attention needs for one step (built once per step, shared by every layer)."""
    qo_indptr: torch.Tensor     # [B + 1] int32, cumulative query-token counts
    page_table: PageTable       # kv_len(i) includes the new tokens of this step
    slot_mapping: torch.Tensor  # [T] int64, cache slot (page_id * page_size + offset) per new token

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def build(cls, page_ids: Sequence[Sequence[int]], kv_lens: Sequence[int],
              q_lens: Sequence[int], page_size: int,
              device: torch.device | str = "cpu") -> "AttentionBatch":
        """Batch whose sequence i has kv_lens[i] tokens in page_ids[i], the last q_lens[i] new."""
        if len(q_lens) != len(kv_lens):
            raise ValueError(f"{len(q_lens)} q_lens for {len(kv_lens)} sequences")
        qo, slots = [0], []
        for pages, kv_len, q_len in zip(page_ids, kv_lens, q_lens):
            if not 0 < q_len <= kv_len:
                raise ValueError(f"need 0 < q_len <= kv_len, got q_len {q_len} kv_len {kv_len}")
            qo.append(qo[-1] + q_len)
            slots.extend(pages[p // page_size] * page_size + p % page_size
                         for p in range(kv_len - q_len, kv_len))
        table = build_page_table(page_ids, kv_lens, page_size, device)
        return cls(torch.tensor(qo, dtype=torch.int32, device=device), table,
                   torch.tensor(slots, dtype=torch.int64, device=device))


def _head_run_rows(pages: torch.Tensor, kvh: int) -> torch.Tensor:
    """Rows of kv_layer.view(P * 2 * KVH, page_size * D) (one row: one KV head's K or V of one
    page, contiguous in the HND layout) for pages [..., n] int64: [2, ..., KVH, n], K then V,
    so that the gathered rows view as [2, ..., KVH, n * page_size, D]."""
    kv = torch.arange(2, device=pages.device).view(2, *([1] * pages.dim()), 1)
    head = torch.arange(kvh, device=pages.device)[:, None]
    return (pages.unsqueeze(-2).unsqueeze(0) * 2 + kv) * kvh + head


@dataclass(frozen=True)
class _SeqPlan:
    q_start: int
    q_len: int
    kv_len: int
    pages: torch.Tensor           # [n_pages] int64 page ids
    causal: bool                  # q_len == kv_len > 1: SDPA's own causal mask is exact

    @property
    def after_prefix(self) -> bool:
        """Several queries after cached keys: the last q_len keys causal, the rest seen by
        all (a later prefill chunk)."""
        return 1 < self.q_len < self.kv_len

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[q_len, kv_len] bool (True = attend) for SDPA's masked path, None where no mask
        is needed; made when first asked (then kept for the step's other layers): the CPU's
        split flash path needs none (building them was ~1% of a 7K prefill, for nothing)."""
        if not self.after_prefix:
            return None
        dev = self.pages.device
        j = torch.arange(self.q_len, device=dev)[:, None]       # query j sees kv positions
        p = torch.arange(self.kv_len, device=dev)[None, :]      # <= kv_len - q_len + j
        return p <= self.kv_len - self.q_len + j


@dataclass(frozen=True)
class _DecodePlan:
    pages: torch.Tensor           # [B, max_pages] int64 (padded with each sequence's first page)
    mask: torch.Tensor | None     # [B, 1, 1, max_pages * page_size] bool, None without padding
    rows: dict                    # KVH -> _head_run_rows(pages, KVH), built by the first layer


class TorchPagedAttention:
    """Paged causal attention in plain torch.

    K and V are gathered with one `index_select` of whole per-head page runs (page_size * D
    values, contiguous in the HND page) ordered (K/V, sequence, KV head, page), which lands them
    directly as contiguous [.., KVH, L, D]: no transpose or copy before 4-D SDPA with
    `enable_gqa`, whose CPU flash kernel accumulates in float32 and never materialises
    [H, q, L] scores.
    Decode steps (every q_len == 1) run as one padded batch; other steps loop over sequences.
    Call `plan(batch)` once per step (forward plans lazily when given a new batch).

    NOTE (measured on this project's 2-core CPU box, 1 thread, SmolLM2 shapes 9/3 heads x 64):
    4-D SDPA beat explicit grouped matmul + softmax (bf16 scores or float32-upcast K/V) for
    decode (bf16, kv 4096: ~0.95 ms vs 1.1-1.9 ms; 8 x 1024: ~1.8 ms vs 2.0-6.6 ms) and for
    prefill (bf16 512 x 1024: 10 ms vs 64 ms; fp32: 23 ms vs 37 ms), and it is more accurate
    than bf16 scores. 3-D SDPA inputs take a much slower path: keep the leading batch dim.
    Decode pads every sequence to the longest one: one long and many short sequences in a
    decode batch pay for the long one each.
    NOTE (measured, bench/kv_layout_ab.py, bf16 decode 8 x 440 pages): with NHD pages the gather
    copied whole 6 KB pages (~9.5 ms) and SDPA read K/V through transposed views (~21 ms); with
    HND the gather of 2 KB head runs is slower (~13 ms) but SDPA over contiguous [B, KVH, L, D]
    takes ~11 ms: ~24 ms per call against ~30 ms.
    """

    def __init__(self) -> None:
        self._planned: AttentionBatch | None = None
        self._decode: _DecodePlan | None = None
        self._seqs: list[_SeqPlan] = []
        self._workspace: torch.Tensor | None = None   # gathered K/V, grown on demand
        self._upcast = Upcast()                       # float32 K/V where that is faster

    def plan(self, batch: AttentionBatch, *_, device: torch.device | None = None,
             **__) -> None:
        """Metadata for `batch`, reused by every layer of the step, on `device` (the KV's;
        default: the batch's)."""
        pt = batch.page_table
        ps = pt.page_size
        qo = batch.qo_indptr.tolist()
        indptr = pt.indptr.tolist()
        last = pt.last_page_len.tolist()
        dev = batch.qo_indptr.device if device is None else device
        indices = pt.indices.to(dev, torch.int64)
        n_pages = [indptr[i + 1] - indptr[i] for i in range(len(last))]
        kv_lens = [0 if n == 0 else (n - 1) * ps + lp for n, lp in zip(n_pages, last)]
        q_lens = [qo[i + 1] - qo[i] for i in range(len(last))]
        for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            if q_len > kv_len:
                raise ValueError(f"sequence {i}: {q_len} queries but only {kv_len} kv tokens")
        self._planned, self._decode, self._seqs = batch, None, []
        if q_lens and all(q == 1 for q in q_lens):
            max_pages = max(n_pages)
            rows = torch.empty(len(last), max_pages, dtype=torch.int64, device=dev)
            for i, n in enumerate(n_pages):
                rows[i, :n] = indices[indptr[i]:indptr[i + 1]]
                rows[i, n:] = indices[indptr[i]]
            mask = None
            if any(k != max_pages * ps for k in kv_lens):
                pos = torch.arange(max_pages * ps, device=dev)
                lens = torch.tensor(kv_lens, device=dev)
                mask = (pos[None, :] < lens[:, None])[:, None, None, :]
            self._decode = _DecodePlan(rows, mask, {})
            return
        for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            if q_len == 0:
                continue
            self._seqs.append(_SeqPlan(qo[i], q_len, kv_len, indices[indptr[i]:indptr[i + 1]],
                                       causal=1 < q_len == kv_len))

    def forward(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch,
                scale: float) -> torch.Tensor:
        """q [T, H, D], kv_layer [P, 2, KVH, page_size, D] -> out [T, H, D] (q's dtype)."""
        if batch is not self._planned:
            self.plan(batch, device=kv_layer.device)
        if self._decode is not None:
            return self._forward_decode(q, kv_layer, scale)
        out = torch.empty_like(q)
        for s in self._seqs:
            out[s.q_start:s.q_start + s.q_len] = self._forward_seq(
                q[s.q_start:s.q_start + s.q_len], kv_layer, s, scale)
        return out

    __call__ = forward

    def _gather(self, kv_layer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The per-head page runs `rows` (from _head_run_rows) as one [n_rows, page_size * D]
        tensor, in one index_select.

        NOTE: it lands in a workspace reused by every layer and step: fresh multi-MB outputs
        would be new mmap'd memory each call, and page faults made the gather 3-4x slower.
        """
        p, _, kvh, ps, d = kv_layer.shape
        flat = kv_layer.view(p * 2 * kvh, ps * d)
        n, row = rows.numel(), ps * d
        ws = self._workspace
        if ws is None or ws.numel() < n * row or ws.dtype != kv_layer.dtype \
                or ws.device != kv_layer.device:
            ws = torch.empty(n * row, dtype=kv_layer.dtype, device=kv_layer.device)
            self._workspace = ws
        return torch.index_select(flat, 0, rows.view(-1), out=ws[:n * row].view(n, row))

    def _forward_decode(self, q: torch.Tensor, kv_layer: torch.Tensor,
                        scale: float) -> torch.Tensor:
        plan = self._decode
        b, h, d = q.shape
        kvh = kv_layer.shape[2]
        rows = plan.rows.get(kvh)
        if rows is None:
            rows = plan.rows[kvh] = _head_run_rows(plan.pages, kvh)     # [2, B, KVH, n]
        kv = self._gather(kv_layer, rows)
        if kv.is_cpu and upcast_wins(kv.dtype):     # the CPU's bf16 SDPA is the slow path
            kv = self._upcast(kv)
        k, v = kv.view(2, b, kvh, -1, d)                        # [B, KVH, L_max, D] each
        out = F.scaled_dot_product_attention(                   # [B, H, 1, D]
            q.to(k.dtype).view(b, h, 1, d), k, v, attn_mask=plan.mask, scale=scale,
            enable_gqa=True)
        return out.view(b, h, d).to(q.dtype)

    def _forward_seq(self, q: torch.Tensor, kv_layer: torch.Tensor, s: _SeqPlan,
                     scale: float) -> torch.Tensor:
        kvh, d = kv_layer.shape[2], kv_layer.shape[4]
        kv = self._gather(kv_layer, _head_run_rows(s.pages, kvh))
        if kv.is_cpu and q.dtype == torch.float32 and upcast_wins(kv.dtype):
            # float32 activations over a bf16 cache, on a CPU whose bf16 SDPA is the slow
            # path (decode's probe): attend in float32 (a prefill chunk's K/V is small)
            kv = self._upcast(kv)
        kv = kv.view(2, 1, kvh, -1, d)
        k, v = kv[:, :, :, :s.kv_len]                           # [1, KVH, L, D] (views)
        qh = q.to(k.dtype).transpose(0, 1)[None]                # [1, H, q_len, D]
        if s.after_prefix and _FLASH_CPU is not None and qh.is_cpu:
            out = _chunk_attention_split(qh, k, v, s.kv_len - s.q_len, scale)
        else:
            out = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=s.mask, is_causal=s.causal, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)               # [q_len, H, D]


# CPU flash attention that also returns the log-sum-exp of each query's scores (private aten
# op, present in torch >= 2.3; the mask path is the fallback when it is missing).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _chunk_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                           scale: float) -> torch.Tensor:
    """Attention of a later prefill chunk: q [1, H, n, D] are the last n of k/v's positions.

    The first `prefix` keys are visible to every query and the last n causally, so instead of
    one SDPA call with an explicit [n, prefix + n] mask (which leaves CPU SDPA's fast path),
    run two unmasked flash calls, plain over the prefix and causal over the chunk, and merge
    them by their log-sum-exps. Measured here (bf16, 2 threads, 9 heads, 2048 queries over
    6144 keys): 81 ms against 130 ms for the masked call.
    """
    b, h, n, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    # every query sees every prefix key: a GQA group's queries stacked as one head's rows (the
    # op has no GQA; this reads each K/V head once instead of copying it per query head)
    qg = q.reshape(b, kvh, group * n, d)
    o1, l1 = _FLASH_CPU(qg, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)[:2]
    o1, l1 = o1.reshape(b, h, n, d), l1.reshape(b, h, n)
    kc, vc = k[:, :, prefix:], v[:, :, prefix:]     # the chunk's own n keys, causally
    if group > 1:
        kc, vc = kc.repeat_interleave(group, 1), vc.repeat_interleave(group, 1)
    o2, l2 = _FLASH_CPU(q, kc, vc, 0.0, True, scale=scale)[:2]
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).unsqueeze(-1)
    w2 = torch.exp(l2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(q.dtype)


def reference_paged_attention(q: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch,
                              scale: float) -> torch.Tensor:
    """Dense float32 causal attention, one sequence at a time, with an explicit mask.

    Same contract as TorchPagedAttention.forward; returns [T, H, D] float32.
    """
    pt = batch.page_table
    h, d = q.shape[1], q.shape[2]
    kvh = kv_layer.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qo = batch.qo_indptr.tolist()
    for i in range(pt.batch_size):
        q0, q1 = qo[i], qo[i + 1]
        q_len, kv_len = q1 - q0, pt.kv_len(i)
        if q_len == 0:
            continue
        pages = pt.pages(i).long()
        # pages [n, KVH, page_size, D] -> tokens in order [L, KVH, D]
        k = kv_layer[pages, 0].transpose(1, 2).reshape(-1, kvh, d)[:kv_len].float()
        v = kv_layer[pages, 1].transpose(1, 2).reshape(-1, kvh, d)[:kv_len].float()
        k = k.repeat_interleave(h // kvh, dim=1).transpose(0, 1)      # [H, L, D]
        v = v.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        qi = q[q0:q1].float().transpose(0, 1)                          # [H, q_len, D]
        scores = qi @ k.transpose(1, 2) * scale                        # [H, q_len, L]
        allowed = torch.zeros(q_len, kv_len, dtype=torch.bool, device=q.device)
        for j in range(q_len):
            allowed[j, :kv_len - q_len + j + 1] = True
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)
    return out
