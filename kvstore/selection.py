"""PageSelection: which pages a sparse decode attends to, and which it attended to last step.

Holds the selector kernel (kernels/page_select.py: Quest's min/max bound or the mean key; with
`--selector lowrank` Quest's bound over keys and queries projected by the model's low-rank
basis, kvstore/lowrank.py, which this class owns; with `--selector centroid` the ranking of
each request's centroid index, kvstore/centroids.py, which the request owns and this class
updates), the budget settings, and per key the last completed step whose sparse decode
selected the page
(sfc's reuse of the last step's pages, kvstore/ahead.py; the C kernel attends to those first).
The per-request inputs (page summaries, the observation-window prior) belong to the requests
(kvstore/requests.py) and are passed in.
"""
from __future__ import annotations

import torch

from kernels.page_select import make_selector
from kernels.page_topk import select_with_priors
from kernels.select_plan import LayerBudget, SelectPlan, layer_budgets
from kvstore.centroids import CentroidIndex
from kvstore.config import KVStoreConfig
from kvstore.lowrank import LowRankProjection
from kvstore.stats import KVStats


def _kernel(selector: str) -> str:
    """The scoring kernel of a selector: lowrank is Quest's bound in the projected space;
    centroid ranks pages by its index (the kernel serves nothing then)."""
    return {"lowrank": "quest", "centroid": "mean"}.get(selector, selector)


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
        # the C selection's threads (TieredKVStore.attention_threads; 0: torch's count at the call)
        self.threads = 0
        self._layer_budgets: list[LayerBudget] | None = None       # `plan`'s, per cfg

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
        self._layer_budgets = None

    def summary_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """The keys a page summary is made of: k [..., KVH, ps, D] as they are, or projected
        to [..., KVH, ps, r]."""
        return self.projection.keys(layer, k) if self.projected else k

    def select(self, layer: int, qd: torch.Tensor, summaries: list[torch.Tensor],
               n_pages: list[int], last_len: list[int], num_kv_heads: int,
               priors: list | None = None, observe: bool = True,
               indexes: list[CentroidIndex] | None = None, pooled: bool = True):
        """Top pages for sequences with queries qd [B, H, D] over their page `summaries`
        (one layer's, [pages, KVH, 3, summary_dim] each) and `priors` (the prompt's
        observation window, [pages, KVH] each, or None); `indexes`: the sequences' centroid
        indexes (--selector centroid); `pooled`: the C selection may take the attention's
        threads (False: the caller runs beside the attention, on one)."""
        cfg = self.cfg
        if self.projected:
            qd = self.projection.queries(layer, qd, qd.shape[1] // num_kv_heads)
        if cfg.prior_pages <= 0:
            priors = None
        group = qd.shape[1] // num_kv_heads
        budget, prior_pages = self._budgets(layer)
        if cfg.selector == "centroid":
            sel = self._select_centroid(layer, qd.view(qd.shape[0], num_kv_heads, group, -1),
                                        summaries, n_pages, indexes, priors, budget,
                                        prior_pages)
        else:
            sel = self.selector.select(qd, summaries, n_pages, group, budget, cfg.sink_pages,
                                       cfg.local_pages, priors, prior_pages,
                                       threads=(self.threads or torch.get_num_threads())
                                       if pooled else 1)
        if observe:
            self.observe([sel], last_len, num_kv_heads)
        return sel

    def plan(self, summaries: list[torch.Tensor], n_pages: list[int],
             priors: list | None, num_kv_heads: int, group: int,
             pooled: bool = True) -> SelectPlan | None:
        """`select` of the same sequences in every layer of a step, prepared once
        (kernels/select_plan.py): summaries and priors as `select` takes them but of every
        layer ([L, ...] each); no projection, centroid index or observation. None where the
        C selection does not serve them (then `select`, layer by layer)."""
        cfg = self.cfg
        if cfg.selector == "centroid" or self.projected or not self.selector.native \
                or not summaries:
            return None
        if self._layer_budgets is None:
            layers = summaries[0].shape[0]
            self._layer_budgets = layer_budgets([self._budgets(lay) for lay in range(layers)],
                                                num_kv_heads, cfg.sink_pages, cfg.local_pages)
        if cfg.prior_pages <= 0 or not any(prior for _, prior, _ in self._layer_budgets):
            priors = None
        return SelectPlan.build(summaries, n_pages, group, self.selector.quest,
                                self._layer_budgets, cfg.sink_pages, cfg.local_pages, priors,
                                threads=(self.threads or torch.get_num_threads())
                                if pooled else 1)

    def observe(self, sels: list, last_len: list[int], num_kv_heads: int) -> None:
        """Record what selections of the same sequences (a step's layers) attend to: the
        tokens of each row's pages, less the last page's free end (last_len: a sequence's
        last page's tokens)."""
        ps, tokens = self.cfg.page_size, []
        for sel in sels:
            ends = sel.indptr.tolist()
            tokens += [(ends[r + 1] - ends[r] - 1) * ps + last_len[r // num_kv_heads]
                       for r in range(len(ends) - 1)]
        self.stats.observe_selected(tokens)

    def marks(self) -> tuple[torch.Tensor, int]:
        """(int64 [keys] the last completed step whose sparse decode selected each key, that
        step): what `reused` reads, for a kernel that splits on it in C."""
        return self._selected_at, self._completed_step

    def _budgets(self, layer: int) -> tuple[int | torch.Tensor, int | torch.Tensor]:
        """(budget pages, prior pages) of the layer: ints, or per KV head with a plan."""
        cfg = self.cfg
        heads = cfg.head_budget_pages(layer)
        if heads is None:
            return cfg.budget_pages, cfg.prior_pages
        return (torch.tensor(heads, dtype=torch.int64),
                torch.tensor([cfg.head_prior_pages(b) for b in heads], dtype=torch.int64))

    def _select_centroid(self, layer: int, qg: torch.Tensor, summaries: list[torch.Tensor],
                         n_pages: list[int], indexes: list[CentroidIndex] | None,
                         priors: list | None, budget, prior_pages):
        """select_pages over the centroid indexes' page ranking, qg [B, KVH, group, D]; each
        index first takes in the pages that left the local window."""
        cfg = self.cfg
        if indexes is None or len(indexes) != len(n_pages):
            raise ValueError("--selector centroid needs each sequence's centroid index")
        keys = torch.full((len(n_pages), qg.shape[1], max(n_pages, default=0)),
                          -float("inf"))
        for b, (index, n) in enumerate(zip(indexes, n_pages)):
            index.update(layer, summaries[b], n - cfg.local_pages, cfg.centroid_pages)
            keys[b, :, :n] = index.page_keys(layer, qg[b], n)
        return select_with_priors(keys, n_pages, budget, cfg.sink_pages, cfg.local_pages,
                                  priors, prior_pages)

    def index_prompts(self, layer: int, prompts: list) -> None:
        """Prompt chunks just written (RequestKV, pages so far): with --selector centroid,
        their pages outside the local window join the index now, chunk after chunk, rather
        than all in the first decode step."""
        cfg = self.cfg
        if cfg.selector != "centroid" or layer < cfg.dense_layers:
            return
        for rkv, n in prompts:
            if rkv.centroids is not None:
                rkv.centroids.update(layer, rkv.summaries[layer], n - cfg.local_pages,
                                     cfg.centroid_pages)

    def reused(self, keys: torch.Tensor) -> torch.Tensor:
        """bool per key: the last completed step selected its page too."""
        return self._selected_at[keys] == self._completed_step

    def end_step(self, step: int, selected: list[torch.Tensor]) -> None:
        """The step is complete: its sparse decodes selected the keys `selected`."""
        if selected:
            self._selected_at[torch.cat(selected)] = step
        self._completed_step = step
