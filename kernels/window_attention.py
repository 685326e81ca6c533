"""Sliding-window attention over pages: each query attends to the keys of its own sequence at
positions in (p - window, p], p its own position (transformers' `sliding_window_overlay`:
`kv_idx > q_idx - sliding_window`, over the causal mask).

The layers of Mistral v0.1, Phi-3-mini-4k, Qwen2 with `use_sliding_window`, and Gemma 3's local
layers attend so. A sequence's pages before its first query's window are never read: the
caller hands only the pages from the window's first one on (`WindowSeq.slots`), and the
tokens of that first page before the window are masked. Torch, float32 scores, queries in
blocks (a prefill chunk's scores stay [heads, block, window + block]). Used for the layers and
steps where the window cuts a sequence's context (kvstore/step.py); within the window it
equals causal attention, which the other kernels compute.

`softcap` (Gemma 2's attn_logit_softcapping) caps every score as cap * tanh(score / cap)
before the softmax, which no other kernel does: a model with one attends every layer here,
the full ones with the window FULL (causal).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

_BLOCK = 256                    # query rows a block
FULL = 1 << 40                  # a window past any context: causal attention


@dataclass(frozen=True)
class WindowSeq:
    """One sequence's rows: its queries are at positions start_pos .. start_pos + q_len - 1;
    `slots` [n] are the pool slots of its pages from page `first_page` on, in order, through
    its last (which holds position start_pos + q_len - 1)."""
    slots: torch.Tensor
    first_page: int
    start_pos: int
    q_len: int


def first_window_page(start_pos: int, window: int, page_size: int) -> int:
    """The page of the first key the query at start_pos attends to."""
    return max(0, start_pos - window + 1) // page_size


def window_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys (positions pos_k) each query (pos_q) attends to, broadcast: the causal keys
    within its window."""
    return (pos_k <= pos_q) & (pos_k > pos_q - window)


def window_attention(q: torch.Tensor, pool: torch.Tensor, seqs: Sequence[WindowSeq],
                     window: int, scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D] (the sequences' rows, in order) over pool [S, 2, KVH, ps, D] -> [T, H, D].
    Decodes (one row) are computed together, the other sequences one by one."""
    out = torch.empty_like(q)
    at, decodes, rows = 0, [], []
    for s in seqs:
        if s.q_len == 1:
            decodes.append(s)
            rows.append(at)
        else:
            out[at:at + s.q_len] = _sequence(q[at:at + s.q_len], pool, s, window, scale,
                                             softcap)
        at += s.q_len
    if decodes:
        rows = torch.tensor(rows, device=q.device)
        out[rows] = _decodes(q[rows], pool, decodes, window, scale, softcap)
    return out


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _decodes(q: torch.Tensor, pool: torch.Tensor, seqs: list[WindowSeq], window: int,
             scale: float, softcap: float | None) -> torch.Tensor:
    """One row a sequence, q [B, H, D]: their pages gathered at once (padded to the most)."""
    b, heads, d = q.shape
    _, _, kvh, ps, _ = pool.shape
    slots = torch.nn.utils.rnn.pad_sequence([s.slots.long() for s in seqs], batch_first=True)
    n = slots.shape[1]
    kv = pool[slots]                                         # [B, n, 2, KVH, ps, D]
    k = kv[:, :, 0].transpose(1, 2).reshape(b, kvh, n * ps, d).float()
    v = kv[:, :, 1].transpose(1, 2).reshape(b, kvh, n * ps, d).float()
    base = torch.tensor([s.first_page * ps for s in seqs], device=q.device)
    pos = torch.tensor([s.start_pos for s in seqs], device=q.device)
    count = torch.tensor([s.slots.numel() * ps for s in seqs], device=q.device)
    col = torch.arange(n * ps, device=q.device)
    pos_k = base[:, None] + col[None]                        # [B, n * ps]
    allowed = window_mask(pos[:, None], pos_k, window) & (col[None] < count[:, None])
    qg = q.float().reshape(b, kvh, heads // kvh, d)          # [B, KVH, group, D]
    scores = _capped(torch.matmul(qg, k.transpose(2, 3)) * scale, softcap)  # [B, KVH, g, n ps]
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v)       # [B, KVH, group, D]
    return o.reshape(b, heads, d).to(q.dtype)


def _sequence(q: torch.Tensor, pool: torch.Tensor, s: WindowSeq, window: int,
              scale: float, softcap: float | None) -> torch.Tensor:
    t, heads, d = q.shape
    kv = pool[s.slots.long()]                              # [n, 2, KVH, ps, D]
    n, _, kvh, ps, _ = kv.shape
    base = s.first_page * ps                               # position of the first key
    length = s.start_pos + t - base                        # keys through the last query
    k = kv[:, 0].transpose(0, 1).reshape(kvh, n * ps, d)[:, :length].float()
    v = kv[:, 1].transpose(0, 1).reshape(kvh, n * ps, d)[:, :length].float()
    group = heads // kvh
    out = torch.empty(t, heads, d, dtype=torch.float32, device=q.device)
    for b0 in range(0, t, _BLOCK):
        b1 = min(t, b0 + _BLOCK)
        p0 = s.start_pos + b0                                # the block's first position
        lo = max(0, p0 - window + 1 - base)                  # its first key, in k's columns
        hi = s.start_pos + b1 - base                         # past its last key
        pos_q = torch.arange(p0, s.start_pos + b1, device=q.device)
        pos_k = torch.arange(base + lo, base + hi, device=q.device)
        allowed = window_mask(pos_q[:, None], pos_k[None], window)
        # [KVH, group * rows, D]: a KV head's query heads, row after row within each head
        qb = q[b0:b1].float().reshape(b1 - b0, kvh, group, d).permute(1, 2, 0, 3)
        qb = qb.reshape(kvh, group * (b1 - b0), d)
        scores = _capped(torch.bmm(qb, k[:, lo:hi].transpose(1, 2)) * scale, softcap)
        scores.masked_fill_(~allowed.repeat(group, 1), float("-inf"))
        o = torch.bmm(torch.softmax(scores, dim=-1), v[:, lo:hi])   # [KVH, group * rows, D]
        out[b0:b1] = o.reshape(kvh, group, b1 - b0, d).permute(2, 0, 1, 3).reshape(
            b1 - b0, heads, d)
    return out.to(q.dtype)
