"""The observation-window prior of sparse decode: how much attention each page gets from the
prompt's last tokens (SnapKV's window), computed once at the end of prefill; kernels/
page_topk.py's select_pages keeps each head's top pages by it within the budget.

Leaf module: imports only torch.
"""
from __future__ import annotations

import torch


def window_page_mass(q_obs: torch.Tensor, k_pages: torch.Tensor, kv_len: int, scale: float,
                     group: int, reduce: str = "sum") -> torch.Tensor:
    """Attention mass each page gets from an observation window of queries (SnapKV's window:
    the last prompt tokens, which hold the question), per KV head: [n, KVH] float32.

    q_obs [w, H, D] are the queries of positions kv_len - w .. kv_len - 1 (each attends
    causally); k_pages [n, KVH, ps, D] the keys of the sequence's pages, n * ps >= kv_len. Each
    query head's softmax rows sum to one, so every head of a GQA group weighs the same (a
    retrieval head's one sharp page counts as much as a diffuse head's spread); the mass of a
    page is summed over its tokens, then over the window's queries and the group's heads
    (reduce="sum", SnapKV's vote) or the largest of them is kept (reduce="max": one question
    token that looks hard at a page, e.g. "passcode" at the needle's "passcode", is enough).
    """
    w, h, d = q_obs.shape
    n, kvh, ps, _ = k_pages.shape
    k = k_pages.float().permute(1, 0, 2, 3).reshape(kvh, n * ps, d)[:, :kv_len]
    qg = q_obs.float().view(w, kvh, group, d).permute(1, 2, 0, 3).reshape(kvh, group * w, d)
    logits = torch.bmm(qg, k.transpose(1, 2)).mul_(scale)           # [KVH, group * w, kv_len]
    # query j of the window sits at position kv_len - w + j: it sees keys <= that position
    dev = logits.device
    future = torch.arange(kv_len, device=dev) > \
        (kv_len - w + torch.arange(w, device=dev))[:, None]                      # [w, kv_len]
    logits.view(kvh, group, w, kv_len).masked_fill_(future, -float("inf"))
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")
    rows = torch.zeros(kvh, group * w, n * ps, dtype=torch.float32, device=dev)
    rows[:, :, :kv_len] = torch.softmax(logits, dim=-1)
    per_page = rows.view(kvh, group * w, n, ps).sum(dim=-1)         # [KVH, group * w, n]
    mass = per_page.sum(dim=1) if reduce == "sum" else per_page.amax(dim=1)
    return mass.t().contiguous()
