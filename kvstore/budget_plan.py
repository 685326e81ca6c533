"""BudgetPlan: a sparse budget per (layer, KV head), KVDrive's 2D window scaling.

Heads differ: a retrieval head puts its attention on a few pages, a diffuse head spreads it over
hundreds. One budget for every head gives the first more pages than it needs and the second
fewer. `strata profile` (engine/profile.py) measures, per layer and KV head, how much of the
attention the selector's pages keep as the budget grows (`recall_curves`, on calibration text;
the last prompt positions stand in for decode queries), then `solve` spends the same total as
the uniform budget where each token buys the most recall: a multiple-choice knapsack (one budget
option per head) solved greedily over each head's upper concave hull of (tokens, recall), best
recall per token first. `--sparse-budget-plan FILE` loads the plan (JSON) into the store's
selection (kvstore/selection.py); the total stays that of the plan's uniform budget.

Leaf module: imports only torch and kernels.*, and those only in the functions that compute
(the plan file is read at start-up by engine/args.py, which stays free of torch).
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FILE_VERSION = 1
DEFAULT_OPTIONS = (128, 256, 512, 1024, 2048, 4096)    # tokens a head may get


def recall_curves(q: torch.Tensor, k: torch.Tensor, page_size: int, sink_pages: int,
                  local_pages: int, options_pages: list[int], window: int, scale: float,
                  selector: str = "quest") -> torch.Tensor:
    """Attention-mass recall per KV head and budget option: [KVH, len(options_pages)].

    q [T, H, D], k [T, KVH, D]: one layer of a sequence at positions 0..T-1. Each of the last
    `window` positions t is a decode query over keys 0..t; its pages are the full pages before
    t's (summarized as the store does) and the partial one. For budget b pages, a KV head keeps
    the sink pages, the local window and the selector's top b - sink - local of the others; its
    recall is the attention mass those pages hold, averaged over the query heads of its group
    (each head's softmax sums to 1) and over the window's queries.
    """
    import torch

    from kernels.page_select import mean_scores, quest_scores
    from kernels.page_summary import summarize_pages
    t_len, h, d = q.shape
    kvh = k.shape[1]
    group = h // kvh
    if window < 1 or window > t_len - page_size:
        raise ValueError(f"window {window} does not fit {t_len} tokens of pages of {page_size}")
    n_full = t_len // page_size
    kp = k[:n_full * page_size].float().view(n_full, page_size, kvh, d).transpose(1, 2)
    summ = summarize_pages(kp, [page_size] * n_full)                     # [n_full, KVH, 3, D]
    pos = torch.arange(t_len - window, t_len)                             # the queries' positions
    qw = q[t_len - window:].float()                                       # [W, H, D]
    logits = torch.einsum("whd,thd->hwt", qw, k.float().repeat_interleave(group, 1)) * scale
    logits.masked_fill_(torch.arange(t_len)[None, None, :] > pos[None, :, None], -float("inf"))
    p_all = -(-t_len // page_size)
    mass = torch.zeros(h, window, p_all * page_size)
    mass[..., :t_len] = torch.softmax(logits, -1)
    mass = mass.view(kvh, group, window, p_all, page_size).sum(-1).mean(1)   # [KVH, W, P]
    score_fn = quest_scores if selector == "quest" else mean_scores
    scores = score_fn(qw, [summ] * window, [n_full] * window, group)     # [W, KVH, n_full]
    scores = scores.transpose(0, 1)                                       # [KVH, W, n_full]
    pages = torch.arange(p_all)
    n_t = (pos // page_size + 1)[:, None]                                 # pages of each query
    free = (pages[None] >= sink_pages) & (pages[None] < n_t - local_pages)    # [W, P]
    forced = (pages[None] < n_t) & ~free
    forced_mass = (mass * forced[None]).sum(-1)                           # [KVH, W]
    key = torch.full((kvh, window, p_all), -float("inf"))
    key[..., :n_full] = scores
    key.masked_fill_(~free[None], -float("inf"))
    order = key.argsort(-1, descending=True)
    ranked = (mass * free[None]).gather(-1, order).cumsum(-1)             # [KVH, W, P]
    out = []
    for b in options_pages:
        kb = b - sink_pages - local_pages
        got = forced_mass + (ranked[..., kb - 1] if kb > 0 else 0.0)
        out.append(got.mean(-1))
    return torch.stack(out, -1).clamp_(max=1.0)


def _hull(costs: list[int], gains: list[float]) -> list[int]:
    """Indices of the upper concave hull of the points (costs ascending), from the first:
    the upgrades a greedy knapsack takes in order of falling gain per cost."""
    keep: list[int] = [0]
    for i in range(1, len(costs)):
        if gains[i] <= gains[keep[-1]]:
            continue                                   # costs more, recalls no more
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            # drop b when the segment a->i is at least as steep as a->b
            if (gains[i] - gains[a]) * (costs[b] - costs[a]) >= \
                    (gains[b] - gains[a]) * (costs[i] - costs[a]):
                keep.pop()
            else:
                break
        keep.append(i)
    return keep


def solve(recall: torch.Tensor, options: list[int], budget: int) -> torch.Tensor:
    """Budgets [L, KVH] (tokens, one of `options` each) whose mean is at most `budget` and
    whose summed recall the greedy hull knapsack maximizes; recall [L, KVH, len(options)]."""
    import torch
    if budget < options[0]:
        raise ValueError(f"budget {budget} is below the smallest option {options[0]}")
    rows = recall.reshape(-1, len(options)).tolist()
    left = budget * len(rows) - options[0] * len(rows)
    pick = [0] * len(rows)
    hulls = [_hull(list(options), r) for r in rows]
    step = [0] * len(rows)
    heap: list[tuple[float, int]] = []

    def push(i: int) -> None:
        hl = hulls[i]
        if step[i] + 1 < len(hl):
            a, b = hl[step[i]], hl[step[i] + 1]
            heapq.heappush(heap, (-(rows[i][b] - rows[i][a]) / (options[b] - options[a]), i))

    for i in range(len(rows)):
        push(i)
    while heap:
        _, i = heapq.heappop(heap)
        a, b = hulls[i][step[i]], hulls[i][step[i] + 1]
        if options[b] - options[a] > left:
            continue                                   # this head's next step does not fit
        left -= options[b] - options[a]
        step[i] += 1
        pick[i] = b
        push(i)
    _fill(rows, options, pick, left)
    return torch.tensor([options[p] for p in pick]).view(recall.shape[:2])


def _fill(rows: list[list[float]], options: list[int], pick: list[int], left: int) -> None:
    """Spend what the hull steps left (a head's next hull step may not fit where a smaller
    option would): the best gain per token among the options that fit, until none does."""
    while True:
        best = None
        for i, r in enumerate(rows):
            for o in range(pick[i] + 1, len(options)):
                cost = options[o] - options[pick[i]]
                if cost <= left and r[o] > r[pick[i]]:
                    gain = (r[o] - r[pick[i]]) / cost
                    if best is None or gain > best[0]:
                        best = (gain, i, o, cost)
        if best is None:
            return
        _, i, o, cost = best
        pick[i], left = o, left - cost


@dataclass(frozen=True)
class BudgetPlan:
    budgets: tuple[tuple[int, ...], ...]     # [L][KVH] tokens (dense layers: the uniform one)
    budget: int                              # the uniform budget whose total it spends
    page_size: int
    dense_layers: int
    options: tuple[int, ...]
    recall: list                             # [L][KVH][options] measured (dense layers: 1)
    tokens: int                              # calibration tokens it was measured on
    selector: str

    def predicted(self) -> tuple[float, float | None]:
        """(mean recall of the plan, of the uniform budget where it is an option, else None)
        over the sparse layers' heads."""
        rows = [(r, b) for lr, lb in zip(self.recall[self.dense_layers:],
                                         self.budgets[self.dense_layers:])
                for r, b in zip(lr, lb)]
        plan = sum(r[self.options.index(b)] for r, b in rows) / len(rows)
        if self.budget not in self.options:
            return plan, None
        return plan, sum(r[self.options.index(self.budget)] for r, _ in rows) / len(rows)

    def check(self, num_layers: int, num_kv_heads: int) -> None:
        shape = (len(self.budgets), len(self.budgets[0]) if self.budgets else 0)
        if shape != (num_layers, num_kv_heads):
            raise ValueError(f"the budget plan is for [layers, KV heads] {shape}, the model "
                             f"has {(num_layers, num_kv_heads)}: run `strata profile` for it")

    def save(self, path: str | Path) -> None:
        data = {"version": FILE_VERSION, "budget": self.budget, "page_size": self.page_size,
                "dense_layers": self.dense_layers, "options": list(self.options),
                "selector": self.selector, "tokens": self.tokens,
                "budgets": [list(b) for b in self.budgets],
                "recall": [[[round(float(x), 5) for x in h] for h in layer]
                           for layer in self.recall]}
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BudgetPlan:
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict) or data.get("version") != FILE_VERSION:
                raise ValueError(f"not a budget plan of version {FILE_VERSION} (`strata "
                                 "profile` writes one)")
            budgets = tuple(tuple(int(b) for b in layer) for layer in data["budgets"])
            if not budgets or len({len(b) for b in budgets}) != 1 or \
                    min(min(b) for b in budgets) < 1:
                raise ValueError("budgets must be [layers][KV heads] positive token counts")
            return cls(budgets, int(data["budget"]), int(data["page_size"]),
                       int(data["dense_layers"]), tuple(int(o) for o in data["options"]),
                       data["recall"], int(data["tokens"]), str(data["selector"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--sparse-budget-plan {path}: {e}") from None
