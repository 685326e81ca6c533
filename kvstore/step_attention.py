"""The general path's attention of a layer part (kernels over device slots), for StepKV.

`StepKV.compute` hands each part the pipeline finishes here: dense sequences (prefills,
contexts within the budget, dense layers) through the C decode kernel or the dense backend,
with the observation window of prefills that end this step (SnapKV's prior); the layers whose
sliding window cuts a sequence's context, over the window's pages; sparse decodes
over the pages they selected, per (sequence, KV head) rows, split into the pages the last
step selected too and the others (`early`: the first half while the others are fetched).
Functions of the step: they read its public state (sequences, tables, tiers) and write their
rows of the layer's output.
"""
from __future__ import annotations

import torch

from kernels.attention import AttentionBatch
from kernels.page_prior import window_page_mass
from kernels.page_table import PageTable, selected_head_table
from kernels.sparse_attention import NativeSparseDecode
from kernels.window_attention import WindowSeq, window_attention
from kvstore.stages import LayerPart

_I64 = dict(dtype=torch.int64)


def attend_dense(step, layer: int, q: torch.Tensor, out: torch.Tensor, idx: list[int],
                 slots: torch.Tensor, sparse: bool, scale: float) -> None:
    """Every page of the sequences idx (prefills, contexts within the budget, dense
    layers); in a sparse layer, prefills ending this step also rank their pages."""
    parts = step.parts
    rows = step.query_rows(idx)
    pool, qr = step.tiers.pool, q[rows]
    group = q.shape[1] // step.tiers.page_shape.num_kv_heads
    kernel = _c_kernel(step, qr, group)
    if kernel is not None and all(step.seqs[i].q_len == 1 for i in idx):
        # decodes: the C kernel reads each page in place (1.8x faster than gathering
        # them for SDPA: 12.8 against 23.4 ms a layer for 8 x 7K tokens, one thread,
        # bench/sparse_ops.py)
        out[rows] = kernel.forward(qr, pool, step.dense_head_table(idx, slots), group,
                                   scale)
    else:
        out[rows] = parts.dense_attention.forward(qr, pool, dense_batch(step, idx, slots),
                                                  scale)
    if sparse and step.observe_idx:
        _observe_window(step, layer, q, idx, slots, scale)


def attend_window(step, layer: int, q: torch.Tensor, out: torch.Tensor, idx: list[int],
                  slots: torch.Tensor, scale: float) -> None:
    """The sequences idx in a layer whose sliding window cuts the step's context: each over
    its pages from its window on (`slots`: their device slots, sequence after sequence)."""
    window = step.cut[layer]
    first, seqs, at = step.first_pages(window), [], 0
    for i in idx:
        s, n = step.seqs[i], step.n_pages[i] - first[i]
        seqs.append(WindowSeq(slots[at:at + n], first[i], s.start_pos, s.q_len))
        at += n
    rows = step.query_rows(idx)
    out[rows] = window_attention(q[rows], step.tiers.pool, seqs, window, scale,
                                 step.parts.softcap)
    if step.observe_idx and layer >= step.cfg.dense_layers:    # (sparse once not cut)
        _observe_window(step, layer, q, idx, slots, scale, first)


def attend_sparse(step, q: torch.Tensor, out: torch.Tensor, part: LayerPart, scale: float,
                  early: bool = False) -> None:
    """The selected pages of the sparse decodes part.idx (a micro-batch, or all of them).
    With the C kernel, each row attends first to its pages the last step selected too (and
    the partial last page), then goes on over the others: `early` computes only the first
    half (into part.head), while the others are fetched."""
    parts = step.parts
    pool = step.tiers.pool
    idx, sel = part.idx, part.sel
    rows = step.query_rows(idx)
    qr = q[rows]
    group = q.shape[1] // step.tiers.page_shape.num_kv_heads
    kernel = _c_kernel(step, qr, group)
    if early and (kernel is None or part.reused is None or step.cfg.head_pages == "union"):
        return          # no first half to compute apart: all of it once the fill is in
    if step.cfg.head_pages == "union":
        # every head attends to the pages any head selected (fetched anyway): the
        # dense kernel gathers 2 KB head runs of them, and a page one head missed
        # still counts
        table = _union_table(step, idx, sel, part.slots)
        batch = AttentionBatch(torch.arange(len(idx) + 1, dtype=torch.int32),
                               table, torch.empty(0, **_I64))
        out[rows] = parts.dense_attention.forward(qr, pool, batch, scale)
        return
    if part.reused is None or kernel is None:
        table, _ = _sparse_table(step, idx, sel, part.slots)
        out[rows] = parts.sparse_attention.forward(qr, pool, table, group, scale)
        return
    qr = qr.float()                 # converted once for both halves
    if part.head is None:
        table, pos = _sparse_table(step, idx, sel, part.slots)
        first = part.reused[pos]
        first[table.indptr[1:].long() - 1] = True        # the partial page: resident
        if not early:       # both halves at once: one call, the same bits as two
            out[rows] = kernel.forward_partial(qr, pool, table, group, scale,
                                               first=first)[0].to(q.dtype)
            return
        head, rest = table.split(first)
        part.head = (kernel.forward_partial(qr, pool, head, group, scale), rest)
    if early:
        return
    first_half, rest = part.head
    part.head = None
    out[rows] = kernel.forward_partial(qr, pool, rest, group, scale,
                                       carry=first_half)[0].to(q.dtype)


def _c_kernel(step, qr: torch.Tensor, group: int) -> NativeSparseDecode | None:
    """The store's C decode kernel when it serves the queries `qr` over the device pool
    (else None: a torch path computes them)."""
    kernel = step.parts.sparse_attention
    if isinstance(kernel, NativeSparseDecode) and kernel.supports(qr, step.tiers.pool, group):
        return kernel
    return None


def _observe_window(step, layer: int, q: torch.Tensor, dense_idx: list[int],
                    slots: torch.Tensor, scale: float, firsts: list[int] | None = None) -> None:
    """Prefills ending this step: the attention mass of their last obs_window queries over
    each page (all on device now) becomes the pages' prior for sparse decode. firsts: each
    sequence's first page in `slots` (a layer whose window cuts: the pages before it keep no
    prior)."""
    cfg = step.cfg
    pool = step.tiers.pool
    group = q.shape[1] // step.tiers.page_shape.num_kv_heads
    at = 0
    for i in dense_idx:
        first = 0 if firsts is None else firsts[i]
        n = step.n_pages[i] - first
        if i in step.observe_idx:
            s = step.seqs[i]
            w = min(cfg.obs_window, s.q_len)
            mass = window_page_mass(q[step.qo[i + 1] - w:step.qo[i + 1]],
                                    pool[slots[at:at + n].long(), 0],
                                    s.kv_len - first * cfg.page_size, scale, group,
                                    cfg.obs_reduce)
            step.parts.requests[s.request_id].prior[layer, first:first + n] = mass
        at += n


def dense_batch(step, idx: list[int], slots: torch.Tensor) -> AttentionBatch:
    """Page table over device slots for the dense sequences (slots in page order)."""
    counts = torch.tensor([step.n_pages[i] for i in idx], dtype=torch.int32)
    indptr = torch.zeros(len(idx) + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=indptr[1:])
    last = torch.tensor([step.last_len[i] for i in idx], dtype=torch.int32)
    qo = torch.zeros(len(idx) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor([step.seqs[i].q_len for i in idx], dtype=torch.int32), 0,
                 out=qo[1:])
    table = PageTable(indptr, slots.to(torch.int32), last, step.cfg.page_size)
    return AttentionBatch(qo, table, torch.empty(0, **_I64))


def _sparse_table(step, idx: list[int], sel, union_slots: torch.Tensor
                  ) -> tuple[PageTable, torch.Tensor]:
    """Per (sequence, KV head) rows over device slots (kernels/page_table.py's
    `selected_head_table`): (the table, each entry's position among the union keys)."""
    return selected_head_table(sel, union_slots, step.last_lens[idx], step.cfg.page_size)


def _union_table(step, idx: list[int], sel, union_slots: torch.Tensor) -> PageTable:
    """One row per sequence over the union of its heads' pages (the partial page last)."""
    return PageTable(sel.union_indptr.to(torch.int32), union_slots.to(torch.int32),
                     step.last_lens[idx], step.cfg.page_size)
