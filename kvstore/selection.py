"""PageSelection: which pages a sparse decode attends to, and which it attended to last step.

Holds the selector kernel (kernels/page_select.py: Quest's min/max bound or the mean key), the
budget settings, and per key the last completed step whose sparse decode selected the page
(sfc's reuse of the last step's pages, kvstore/ahead.py; the C kernel attends to those first).
The per-request inputs (page summaries, the observation-window prior) belong to the requests
(kvstore/requests.py) and are passed in.
"""
from __future__ import annotations

import torch

from kernels.page_select import make_selector
from kvstore.config import KVStoreConfig
from kvstore.stats import KVStats


class PageSelection:
    def __init__(self, cfg: KVStoreConfig, max_keys: int, stats: KVStats):
        self.cfg = cfg
        self.selector = make_selector(cfg.selector)
        self.stats = stats
        self._selected_at = torch.full((max_keys,), -1, dtype=torch.int64)
        self._completed_step = 0

    def reconfigure(self, cfg: KVStoreConfig) -> None:
        if cfg.selector != self.cfg.selector:
            self.selector = make_selector(cfg.selector)
        self.cfg = cfg

    def select(self, qd: torch.Tensor, summaries: list[torch.Tensor], n_pages: list[int],
               last_len: list[int], num_kv_heads: int, priors: list | None = None,
               observe: bool = True):
        """Top pages for sequences with queries qd [B, H, D] over their page `summaries`
        (one layer's, [pages, KVH, 3, D] each) and `priors` (the prompt's observation window,
        [pages, KVH] each, or None)."""
        cfg = self.cfg
        if cfg.prior_pages <= 0:
            priors = None
        sel = self.selector.select(qd, summaries, n_pages, qd.shape[1] // num_kv_heads,
                                   cfg.budget_pages, cfg.sink_pages, cfg.local_pages, priors,
                                   cfg.prior_pages)
        if observe:
            per_row = (sel.indptr[1:] - sel.indptr[:-1]) * cfg.page_size      # [B * KVH]
            partial = cfg.page_size - torch.tensor(last_len, dtype=torch.int64)
            self.stats.observe_selected(
                (per_row - partial.repeat_interleave(num_kv_heads)).tolist())
        return sel

    def reused(self, keys: torch.Tensor) -> torch.Tensor:
        """bool per key: the last completed step selected its page too."""
        return self._selected_at[keys] == self._completed_step

    def end_step(self, step: int, selected: list[torch.Tensor]) -> None:
        """The step is complete: its sparse decodes selected the keys `selected`."""
        if selected:
            self._selected_at[torch.cat(selected)] = step
        self._completed_step = step
