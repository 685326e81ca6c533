"""PageSelection: which pages a sparse decode attends to, and which it attended to last step.

Holds the selector kernel (kernels/page_select.py: Quest's min/max bound or the mean key; with
`--selector lowrank` Quest's bound over keys and queries projected by the model's low-rank
basis, kvstore/lowrank.py, which this class owns), the budget settings, and per key the last completed step whose sparse decode selected the page
(sfc's reuse of the last step's pages, kvstore/ahead.py; the C kernel attends to those first).
The per-request inputs (page summaries, the observation-window prior) belong to the requests
(kvstore/requests.py) and are passed in.
"""
from __future__ import annotations

import torch

from kernels.page_select import make_selector
from kvstore.config import KVStoreConfig
from kvstore.lowrank import LowRankProjection
from kvstore.stats import KVStats


def _kernel(selector: str) -> str:
    """The scoring kernel of a selector: lowrank is Quest's bound in the projected space."""
    return "quest" if selector == "lowrank" else selector


class PageSelection:
    def __init__(self, cfg: KVStoreConfig, max_keys: int, stats: KVStats, head_dim: int,
                 projection: LowRankProjection | None = None):
        """projection: the keys' low-rank basis (--selector lowrank): summaries and queries
        live in its r dims."""
        self.cfg = cfg
        self.selector = make_selector(_kernel(cfg.selector))
        self.head_dim = head_dim
        self.projection = projection
        if cfg.selector == "lowrank" and projection is None:
            raise ValueError("--selector lowrank needs the model's low-rank projection")
        self.stats = stats
        self._selected_at = torch.full((max_keys,), -1, dtype=torch.int64)
        self._completed_step = 0

    @property
    def projected(self) -> bool:
        return self.cfg.selector == "lowrank"

    @property
    def summary_dim(self) -> int:
        """Values per summary row: the head dim, or the projection's rank."""
        return self.projection.rank if self.projected else self.head_dim

    def reconfigure(self, cfg: KVStoreConfig) -> None:
        if (cfg.selector == "lowrank") != self.projected:
            raise ValueError("--selector lowrank summarizes pages differently: it cannot be "
                             "switched on a running store")
        if cfg.selector != self.cfg.selector:
            self.selector = make_selector(_kernel(cfg.selector))
        self.cfg = cfg

    def summary_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """The keys a page summary is made of: k [..., KVH, ps, D] as they are, or projected
        to [..., KVH, ps, r]."""
        return self.projection.keys(layer, k) if self.projected else k

    def select(self, layer: int, qd: torch.Tensor, summaries: list[torch.Tensor],
               n_pages: list[int], last_len: list[int], num_kv_heads: int,
               priors: list | None = None, observe: bool = True):
        """Top pages for sequences with queries qd [B, H, D] over their page `summaries`
        (one layer's, [pages, KVH, 3, summary_dim] each) and `priors` (the prompt's
        observation window, [pages, KVH] each, or None)."""
        cfg = self.cfg
        if self.projected:
            qd = self.projection.queries(layer, qd, qd.shape[1] // num_kv_heads)
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
