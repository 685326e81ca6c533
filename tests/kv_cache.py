"""A dense in-memory paged KV cache for a model alone: parity tests and bench/decode_step.py
(the server's KV lives in kvstore/; this is the test harness's, without tiers or selection).

One preallocated tensor per layer.

Layout per layer: [num_pages, 2, num_kv_heads, page_size, head_dim], K at index 0 and V at 1.
A page (all its tokens, all KV heads, K and V) is one contiguous block, which is FlashInfer's
"HND" paged layout and the unit the tiers move; within it, one KV head's K (or V) is one
contiguous run of page_size * head_dim values (2 KB at page 16, head_dim 64, bf16), so
attention that reads one head of a page (sparse decode) copies whole runs, not 128-byte rows.
Page ids are handed out by the page allocator; this class only owns the memory.
"""
from __future__ import annotations

import torch

from kernels.window_attention import FULL, WindowSeq, first_window_page, window_attention


class DenseStep:
    """One step over a KVCache: every sequence attends to all of its pages (dense, in memory).
    The model calls `attend` once per layer (the same seam as kvstore.step.StepKV)."""

    def __init__(self, cache: "KVCache", batch, backend, num_heads: int, q_dtype: torch.dtype,
                 windows: tuple[int | None, ...] = (), softcap: float | None = None):
        """windows: each layer's sliding window (kernels/window_attention.py; None: none);
        softcap: the scores' cap (Gemma 2), which window_attention alone applies."""
        self.cache, self.batch, self.backend, self.windows = cache, batch, backend, windows
        self.softcap = softcap
        backend.plan(batch, num_heads, cache.num_kv_heads, cache.head_dim, q_dtype, cache.dtype,
                     cache.head_dim ** -0.5)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]; writes k/v at batch.slot_mapping first."""
        self.cache.write(layer, self.batch.slot_mapping, k, v)
        window = self.windows[layer] if layer < len(self.windows) else None
        if self.softcap is not None:
            window = window or FULL
        if window is not None:
            return window_attention(q, self.cache.layer(layer), self._window_seqs(window),
                                    window, scale, self.softcap)
        return self.backend.forward(q, self.cache.layer(layer), self.batch, scale)

    def _window_seqs(self, window: int) -> list[WindowSeq]:
        table, qo, seqs = self.batch.page_table, self.batch.qo_indptr.tolist(), []
        for i in range(self.batch.batch_size):
            q_len = qo[i + 1] - qo[i]
            start = table.kv_len(i) - q_len
            first = first_window_page(start, window, table.page_size)
            seqs.append(WindowSeq(table.pages(i)[first:], first, start, q_len))
        return seqs


class KVCache:
    """Preallocated, pre-touched paged K/V storage for every layer.

    A slot is `page_id * page_size + offset`; `write` scatters new tokens' K/V to their slots.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if min(num_layers, num_pages, page_size, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                f"KVCache needs positive sizes, got layers={num_layers} pages={num_pages} "
                f"page_size={page_size} kv_heads={num_kv_heads} head_dim={head_dim}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, 2, num_kv_heads, page_size, head_dim)
        # NOTE: zeros (not empty) so every page is touched now: no page faults mid-decode, and
        # the memory budget is really taken at start-up.
        self._layers = [torch.zeros(shape, dtype=dtype, device=self.device)
                        for _ in range(num_layers)]
        self._last_slots: torch.Tensor | None = None
        self._last_split: tuple[torch.Tensor, torch.Tensor] | None = None

    def layer(self, layer: int) -> torch.Tensor:
        """The cache of one layer: [num_pages, 2, num_kv_heads, page_size, head_dim]."""
        return self._layers[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K/V of T tokens.

        slot_mapping: [T] int64, slot = page_id * page_size + offset
        k, v:         [T, num_kv_heads, head_dim] (cast to the cache dtype)
        """
        # NOTE: every layer of a step passes the same slot_mapping; split it into
        # (page, offset) once.
        if slot_mapping is not self._last_slots:
            pages = torch.div(slot_mapping, self.page_size, rounding_mode="floor")
            self._last_slots, self._last_split = slot_mapping, (
                pages, slot_mapping - pages * self.page_size)
        pages, offsets = self._last_split
        cache = self._layers[layer]
        # NOTE: indices split by a slice put the token dim first: [T, KVH, D], as k and v are
        cache[pages, 0, :, offsets] = k.to(self.dtype)
        cache[pages, 1, :, offsets] = v.to(self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page summed over all layers (K and V)."""
        return self.bytes_per_page(self.num_layers, self.page_size, self.num_kv_heads,
                                   self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * elem

    @classmethod
    def num_pages_for_budget(cls, budget_bytes: int, num_layers: int, page_size: int,
                             num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """How many pages (over all layers) fit in `budget_bytes`."""
        per_page = cls.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype)
        return int(budget_bytes) // per_page


def make_kv_cache(model, num_pages: int, page_size: int,
                  dtype: torch.dtype | None = None) -> KVCache:
    """A KVCache shaped for `model` (engine.llama), on its device."""
    cfg = model.config
    return KVCache(cfg.num_hidden_layers, num_pages, page_size, cfg.num_key_value_heads,
                   cfg.head_dim, dtype or model.dtype, model.embed_tokens.device)
