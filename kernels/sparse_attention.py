"""Sparse decode attention: each (sequence, KV head) attends to its own list of pages.

  q          [B, H, D]                      one query token per sequence; H = KVH * group,
                                            query head h reads KV head h // group
  kv_pool    [S, 2, KVH, page_size, D]      slot pool, K at [:, 0], V at [:, 1] (one layer;
                                            FlashInfer's "HND" paged layout)
  head_table PageTable with R = B * KVH rows: row b * KVH + h lists the slots that head h of
             sequence b attends to, in token order (build_head_page_table). Its last_page_len
             is the sequence's own when the row ends with the sequence's (partial) last page,
             and page_size otherwise: a selected page that is not the last one is full.
With every page of every sequence in every row this is dense decode (TorchPagedAttention).
Positions are irrelevant here: RoPE is already in K, and the query sees every listed token.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.decode_upcast import Upcast, upcast_wins
from kernels.page_table import PageTable, selected_head_table

try:
    from kernels import _decode
except ImportError:         # a checkout whose extensions are not built (`make setup` builds them)
    _decode = None


def _query_rows(q: torch.Tensor, kv_pool: torch.Tensor, head_table: PageTable,
                group: int) -> int:
    """The table's rows (B x KVH), checked against q's batch and heads."""
    b, h, _ = q.shape
    kvh = kv_pool.shape[2]
    rows = b * kvh
    if h != kvh * group or head_table.batch_size != rows:
        raise ValueError(f"q has {h} heads and the table {head_table.batch_size} rows; "
                         f"expected {kvh} x {group} heads and {b} x {kvh} rows")
    return rows


@dataclass(frozen=True)
class _SparsePlan:
    rows: torch.Tensor            # [2 * R * max_pages] int64: K then V rows of
    #                               kv_pool.view(S * 2 * KVH, page_size * D)
    mask: torch.Tensor | None     # [R, 1, 1, max_pages * page_size] bool, None without padding
    max_tokens: int


class TorchSparseDecode:
    """Per-(sequence, KV head) paged decode attention in plain torch.

    One `index_select` gathers every row's head slice of its pages (K and V) into a padded
    [2, R, L_max, D] workspace (reused across layers and steps: fresh multi-MB buffers page-fault),
    padding repeats the row's first page and is masked. In the HND page layout a head's slice
    of a page is one contiguous run (page_size * D values: 2 KB at page 16, D 64, bf16), so the
    gather copies one row per (row, page) for K and for V. Then one 4-D SDPA call, each row a
    batch entry whose group query heads share one KV head: q [R, group, 1, D] against k/v
    [R, 1, L_max, D] with enable_gqa; SDPA's CPU flash kernel keeps softmax in float32.

    NOTE (measured, 1 thread, SmolLM2 shapes, bf16, 24 rows x 1024 tokens, medians): that
    layout ~1.1 ms; the group as query length of one head (q [R, 1, group, D]) ~1.5 ms;
    explicit bmm with a float32 softmax ~1.45 ms; float32-upcast K/V for bmm several times
    slower. The gather is the other half. It is bound by memory traffic more than by row
    count: HND's 2 KB runs against NHD's 128-byte rows (one head of one token) cut it by ~20%
    (bench/kv_layout_ab.py, 24 rows x 64 pages of a 4000-slot pool, caches churned by the
    other cases: ~1.35 vs ~1.65 ms; forward ~2.9 vs ~3.2 ms), not several-fold.
    Each layer selects its own pages: call `plan(head_table)` once per layer (forward plans
    lazily when handed a new table). Padding goes to the longest row.
    """

    def __init__(self) -> None:
        self._planned: PageTable | None = None
        self._planned_shape: tuple | None = None
        self._plan: _SparsePlan | None = None
        self._workspace: torch.Tensor | None = None
        self._upcast = Upcast()

    def plan(self, head_table: PageTable, kv_pool_shape: tuple[int, ...],
             device: torch.device | None = None) -> None:
        """Gather indices and mask for `head_table` over a pool of `kv_pool_shape` on
        `device` (default: the table's)."""
        _, _, kvh, ps, _ = kv_pool_shape
        if ps != head_table.page_size:
            raise ValueError(f"pool page_size {ps} != table page_size {head_table.page_size}")
        dev = head_table.indptr.device if device is None else device
        indptr = head_table.indptr.to(dev, torch.int64)
        counts = indptr[1:] - indptr[:-1]                           # [R]
        rows = counts.shape[0]
        if rows % kvh:
            raise ValueError(f"{rows} table rows is not a multiple of {kvh} KV heads")
        lo, hi = torch.aminmax(counts)
        if int(lo) == 0:
            raise ValueError("every (sequence, KV head) row needs at least one page")
        max_pages = int(hi)
        j = torch.arange(max_pages, device=dev)
        at = indptr[:-1, None] + torch.where(j[None, :] < counts[:, None], j[None, :], 0)
        slots = head_table.indices.to(dev, torch.int64)[at]         # [R, max_pages]
        head = torch.arange(rows, device=dev) % kvh
        # row of K[slot, head] (page_size * D values) in kv_pool.view(S * 2 * KVH, ps * D) is
        # slot * 2 * KVH + head; V's is KVH rows later
        base = slots * (2 * kvh) + head[:, None]                    # [R, max_pages]
        gather_rows = torch.stack([base, base + kvh]).view(-1)      # [2 * R * max_pages]
        kv_lens = (counts - 1) * ps + head_table.last_page_len.to(dev, torch.int64)
        max_tokens = max_pages * ps
        mask = None
        if bool((kv_lens != max_tokens).any()):
            pos = torch.arange(max_tokens, device=dev)
            mask = (pos[None, :] < kv_lens[:, None])[:, None, None, :]
        self._plan = _SparsePlan(gather_rows, mask, max_tokens)
        self._planned, self._planned_shape = head_table, tuple(kv_pool_shape)

    def forward(self, q: torch.Tensor, kv_pool: torch.Tensor, head_table: PageTable,
                group: int, scale: float) -> torch.Tensor:
        """q [B, H, D], kv_pool [S, 2, KVH, page_size, D] -> [B, H, D] (q's dtype)."""
        if head_table is not self._planned or tuple(kv_pool.shape) != self._planned_shape:
            self.plan(head_table, tuple(kv_pool.shape), kv_pool.device)
        plan = self._plan
        b, h, d = q.shape
        ps = kv_pool.shape[3]
        rows = _query_rows(q, kv_pool, head_table, group)
        flat = kv_pool.view(-1, ps * d)                             # needs a contiguous pool
        n, run = plan.rows.shape[0], ps * d
        ws = self._workspace
        if ws is None or ws.numel() < n * run or ws.dtype != kv_pool.dtype \
                or ws.device != kv_pool.device:
            ws = torch.empty(n * run, dtype=kv_pool.dtype, device=kv_pool.device)
            self._workspace = ws
        kv = torch.index_select(flat, 0, plan.rows, out=ws[:n * run].view(n, run))
        if kv.is_cpu and upcast_wins(kv.dtype):     # the CPU's bf16 SDPA is the slow path
            kv = self._upcast(kv)
        k, v = kv.view(2, rows, 1, plan.max_tokens, d)              # views of the workspace
        out = F.scaled_dot_product_attention(                       # [R, group, 1, D]
            q.to(k.dtype).reshape(rows, group, 1, d), k, v, attn_mask=plan.mask, scale=scale,
            enable_gqa=True)
        return out.view(b, h, d).to(q.dtype)

    __call__ = forward


class NativeSparseDecode:
    """The same attention in C (kernels/_decode.c), on the CPU: each row reads its pages' K
    and V straight from the pool once (online softmax in float32, flash-decoding's
    recurrence), with no gathered workspace, no upcast copy, no padding, and without the GIL.
    Other devices, dtypes or shapes go to TorchSparseDecode.

    NOTE (measured, 1 thread, SmolLM2 shapes, bf16 pool, 24 rows x 64 pages of 16 tokens,
    medians): with its AVX-512 rows 0.78-0.79 ms per call in bench/sparse_ops.py, which cycles
    layers through cold memory, against 2.2 with its portable rows (`simd = False`; here their
    AVX-512-compiled clone, where a CPU without AVX-512 runs the AVX2 or generic one) and ~1.6
    for TorchSparseDecode (gather, upcast, SDPA); in the decode step (bench/pipeline.py's 8 x
    7K tokens, same-process A/B) sequential 407 against 448 ms, sfc 372 against 407.
    """

    # 2: the AVX-512 rows where the CPU has them, else AVX2; 1: AVX2 at most; 0: the portable
    # rows (tests and benches run each path the CPU has)
    simd = 2
    # threads sharing a call's rows (a row of more than 512 tokens in chunks of pages, merged
    # in a fixed order, so the bits do not change); 0: torch's intra-op thread count at the
    # call (--threads / --decode-threads)
    threads = 0

    def __init__(self) -> None:
        self._torch = TorchSparseDecode()

    @staticmethod
    def supports(q: torch.Tensor, kv_pool: torch.Tensor, group: int) -> bool:
        return (_decode is not None and q.is_cpu and kv_pool.is_cpu
                and kv_pool.dtype in (torch.bfloat16, torch.float32)
                and kv_pool.is_contiguous() and q.shape[2] <= 256 and group <= 16
                and kv_pool.shape[3] <= 64)

    def forward(self, q: torch.Tensor, kv_pool: torch.Tensor, head_table: PageTable,
                group: int, scale: float) -> torch.Tensor:
        """q [B, H, D], kv_pool [S, 2, KVH, page_size, D] -> [B, H, D] (q's dtype)."""
        if not self.supports(q, kv_pool, group):
            return self._torch.forward(q, kv_pool, head_table, group, scale)
        return self.forward_partial(q, kv_pool, head_table, group, scale)[0].to(q.dtype)

    __call__ = forward

    def forward_partial(self, q: torch.Tensor, kv_pool: torch.Tensor, head_table: PageTable,
                        group: int, scale: float,
                        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
                        first: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, D] float32, log-sum-exp of each query head's scores [B, H] float32);
        a row without pages gives out 0 and lse -inf (supported inputs only). `carry`, the
        (out, lse) of the same queries over other pages (a first half), is updated in place
        to the attention over both: split attention, with each row's bits independent of
        the batch it runs in. `first` (bool [entries]): both halves of a split attention in
        one call, the entries where it is set first: the bits of
        `forward_partial(rest, carry=forward_partial(head))` with head, rest =
        head_table.split(first)."""
        b, h, d = q.shape
        kvh, ps = kv_pool.shape[2], kv_pool.shape[3]
        rows = _query_rows(q, kv_pool, head_table, group)
        if ps != head_table.page_size:
            raise ValueError(f"pool page_size {ps} != table page_size {head_table.page_size}")
        qf = q.to(torch.float32).contiguous()
        indptr = head_table.indptr.to(torch.int64).contiguous()
        slots = head_table.indices.to(torch.int64).contiguous()
        last = head_table.last_page_len.to(torch.int32).contiguous()
        if carry is None:
            out = torch.empty(b, h, d, dtype=torch.float32)
            lse = torch.empty(b, h, dtype=torch.float32)
        else:
            out, lse = carry
            if out.shape != (b, h, d) or lse.shape != (b, h) or out.dtype != torch.float32 \
                    or lse.dtype != torch.float32 or not (out.is_contiguous()
                                                          and lse.is_contiguous()):
                raise ValueError("carry must be forward_partial's (out, lse) for these queries")
        if first is not None:
            first = first.to(torch.bool).contiguous()
            if first.shape != slots.shape:
                raise ValueError(f"first has {first.numel()} entries for a table of "
                                 f"{slots.numel()}")
        _decode.sparse_decode(qf.data_ptr(), kv_pool.data_ptr(),
                              int(kv_pool.dtype == torch.bfloat16), kvh, ps, d, group,
                              indptr.data_ptr(), slots.data_ptr(), last.data_ptr(), rows, scale,
                              out.data_ptr(), lse.data_ptr(), carry is not None,
                              # n_slots: the C call checks the table against the pool
                              kv_pool.shape[0], int(self.simd),
                              self.threads or torch.get_num_threads(),
                              0 if first is None else first.data_ptr())
        return out, lse

    def forward_selected(self, q: torch.Tensor, kv_pool: torch.Tensor, sel, group: int,
                         scale: float, layer_slots: torch.Tensor, starts: torch.Tensor,
                         last_len: torch.Tensor, marks: tuple[torch.Tensor, int],
                         key_base: int, page_ids: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] attending to the pages a selection `sel` (kernels/page_topk.py's
        SelectedPages, page numbers within each sequence) lists, split as forward_partial's
        `first` with the pages the last step selected too (and each row's last) first:
        the table and split kvstore/step_attention.py builds from the selection, made in C.
        layer_slots int64 [N]: the device slot of each page of the step's sequences in this
        layer; starts int64 [B]: each sequence's first page among them; last_len int32 [B];
        marks: (int64 [keys] the last step that selected each key, the last completed step);
        key_base: the layer's first key; page_ids int64 [B, P]: each sequence's page ids.
        -> [B, H, D] in q's dtype (torch's rows, unsplit, where the C kernel does not serve)."""
        if not self.supports(q, kv_pool, group):
            union = layer_slots[starts.repeat_interleave(sel.union_indptr.diff())
                                + sel.union_indices]
            table, _ = selected_head_table(sel, union, last_len, kv_pool.shape[3])
            return self._torch.forward(q, kv_pool, table, group, scale)
        b, h, d = q.shape
        kvh = kv_pool.shape[2]
        indptr, pages = sel.indptr.contiguous(), sel.page_indices.contiguous()
        ints = (indptr, pages, layer_slots, starts, marks[0], page_ids)
        if h != kvh * group or indptr.numel() != b * kvh + 1 or any(
                t.dtype != torch.int64 or not t.is_contiguous() for t in ints) \
                or last_len.dtype != torch.int32 or not last_len.is_contiguous() \
                or page_ids.dim() != 2 or page_ids.shape[0] < b or starts.numel() < b:
            raise ValueError("forward_selected: the selection, slots and marks must be "
                             "contiguous int64 (last_len int32) for q's sequences and heads")
        qf = q.to(torch.float32).contiguous()
        out = torch.empty(b, h, d, dtype=torch.float32)
        lse = torch.empty(b, h, dtype=torch.float32)
        _decode.sparse_decode_selected(
            qf.data_ptr(), kv_pool.data_ptr(), int(kv_pool.dtype == torch.bfloat16), kvh,
            kv_pool.shape[3], d, group, b, indptr.data_ptr(), pages.data_ptr(),
            layer_slots.data_ptr(), layer_slots.numel(), starts.data_ptr(), last_len.data_ptr(),
            marks[0].data_ptr(), marks[0].numel(), marks[1], key_base, page_ids.data_ptr(),
            page_ids.shape[1], scale, out.data_ptr(), lse.data_ptr(), kv_pool.shape[0],
            int(self.simd), self.threads or torch.get_num_threads())
        return out.to(q.dtype)


def native_decode_built() -> bool:
    """Whether the C kernel (kernels/_decode.c) is built (`make setup` builds it)."""
    return _decode is not None


def sparse_decode_attention(q: torch.Tensor, kv_pool: torch.Tensor, head_table: PageTable,
                            group: int, scale: float) -> torch.Tensor:
    """One-off TorchSparseDecode call (keep a TorchSparseDecode to reuse its workspace)."""
    return TorchSparseDecode().forward(q, kv_pool, head_table, group, scale)


def reference_sparse_decode_attention(q: torch.Tensor, kv_pool: torch.Tensor,
                                      head_table: PageTable, group: int,
                                      scale: float) -> torch.Tensor:
    """Explicit float32 attention, one (sequence, KV head) row at a time: [B, H, D] float32."""
    b_size, h, d = q.shape
    kvh = kv_pool.shape[2]
    out = torch.zeros(b_size, h, d, dtype=torch.float32, device=q.device)
    for b in range(b_size):
        for kh in range(kvh):
            r = b * kvh + kh
            pages = head_table.pages(r).long()
            kv_len = head_table.kv_len(r)
            k = kv_pool[pages, 0, kh].reshape(-1, d)[:kv_len].float()        # [L, D]
            v = kv_pool[pages, 1, kh].reshape(-1, d)[:kv_len].float()
            qh = q[b, kh * group:(kh + 1) * group].float()                   # [group, D]
            p = torch.softmax(qh @ k.T * scale, dim=-1)
            out[b, kh * group:(kh + 1) * group] = p @ v
    return out
