"""bench/needle.py's config names: what the suffixes of `sparse-N-...` set (the selector, the
head pages, the prior share, a budget plan, the KV tier codec's worst case)."""
from __future__ import annotations

import torch

from bench.common import config_budget
from engine.llm_engine import LLMEngine


def config_head_pages(name: str) -> str:
    """sparse-N-union: every KV head attends to the union of the heads' pages."""
    return "union" if "union" in name.split("-")[2:] else "per-head"


def config_selector(name: str, default: str) -> str:
    """sparse-N-mean: the mean-key selector; sparse-N-quest: Quest's bound; sparse-N-centroid:
    the centroid index (kvstore/centroids.py)."""
    parts = name.split("-")[2:]
    for sel in ("mean", "quest", "centroid"):
        if sel in parts:
            return sel
    return default


def config_prior_share(name: str, default: float) -> float:
    """sparse-N-p0.25: a quarter of the free budget goes to the pages the prompt's observation
    window attended most (--sparse-prior-share); sparse-N-p0: the selector alone."""
    for part in name.split("-")[2:]:
        if part.startswith("p") and part[1:].replace(".", "", 1).isdigit():
            return float(part[1:])
    return default


BUDGET_PLAN: str | None = None      # --budget-plan: the file `-plan` configs load


def config_plan(name: str) -> tuple:
    """sparse-N-plan: the budget per (layer, KV head) of --budget-plan (`strata profile` at
    budget N), instead of N for every head."""
    if "plan" not in name.split("-")[2:]:
        return ()
    from kvstore.budget_plan import BudgetPlan
    if BUDGET_PLAN is None:
        raise SystemExit(f"config {name}: give --budget-plan FILE")
    plan = BudgetPlan.load(BUDGET_PLAN)
    if plan.budget != config_budget(name):
        raise SystemExit(f"config {name}: {BUDGET_PLAN} is for budget {plan.budget}")
    return plan.budgets


def config_codec(name: str) -> str:
    """sparse-N-int8 / -int4 (/ -int4g32: groups of 32 channels; / -int4g32s0.5: half the
    layers, --kv-tier-codec-share): every page as the KV tier codec stores it (below)."""
    parts = name.split("-")[2:]
    return next((p for p in parts if p.startswith(("int8", "int4"))), "none")


def apply_codec(engine: LLMEngine, codec_name: str, chunk: int = 4096) -> None:
    """Replace every page of the device pool by its round trip through the KV tier codec: the
    worst case of serving with --kv-tier-codec, as if every page attended had come back from
    the compressed disk tier (when serving, pages that stayed in memory since the prefill are
    exact). With a share (`s0.5`), only the pages of the layers that share codes. The page
    summaries stay exact, as when serving (computed at prefill)."""
    from kvstore.codec_share import coded_layers
    from kvstore.tiers.codec import PageCodec
    if codec_name == "none":
        return
    store = engine.store
    codec_name, _, share = codec_name.partition("s")
    name, _, group = codec_name.partition("g")
    codec = PageCodec.from_name(name, store.page_shape, int(group or 64))   # -int4: groups of 64
    pool = store.tiers.device_tier.pool
    if share:
        keys = store.tiers.device_tier.keys()
        layers = torch.tensor(coded_layers(float(share), store.num_layers))
        keys = keys[torch.isin(keys // store.max_pages, layers)]
        slots = store.tiers.device_slots(keys).long()
    else:
        slots = torch.arange(pool.shape[0])
    for i in range(0, slots.numel(), chunk):
        s = slots[i:i + chunk]
        pool[s] = codec.round_trip(pool[s])
