"""`strata profile`'s work: load the model, measure per layer and KV head how the selector's
recall grows with the budget on calibration text, and solve for a budget plan
(kvstore/budget_plan.py) that `--sparse-budget-plan` loads."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from engine.args import EngineArgs
from engine.gguf_convert import ensure_hf_folder, gguf_source
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from kvstore.budget_plan import DEFAULT_OPTIONS, BudgetPlan, recall_curves, solve
from kvstore.lowrank import CaptureKV, calibration_texts

logger = logging.getLogger(__name__)


@torch.inference_mode()
def measure(model, texts: list[list[int]], kv_cfg, options: list[int], window: int,
            selector: str) -> torch.Tensor:
    """Mean recall [L, KVH, len(options)] over the texts (each from position 0): the last
    `window` positions of each text are the decode queries (recall_curves)."""
    cfg = model.config
    pages = [kv_cfg.pages(o) for o in options]
    total = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, len(options))
    scale = cfg.attention_scale

    def on_layer(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        total[layer] += recall_curves(q, k, kv_cfg.page_size, kv_cfg.sink_pages,
                                      kv_cfg.local_pages, pages, window, scale, selector)

    seam = CaptureKV(on_layer, cfg.layer_windows, cfg.attn_logit_softcapping)
    for ids in tqdm(texts, desc="profiling", unit="text"):
        model(torch.tensor(ids, dtype=torch.int64), torch.arange(len(ids)), seam,
              torch.tensor([len(ids) - 1]))
    return total / len(texts)


def profile_model(args: EngineArgs, tokens: int, length: int, window: int,
                  options: list[int] | None = None, files: list[str] | None = None
                  ) -> BudgetPlan:
    """The budget plan for args.sparse_budget over the model's layers and KV heads, measured
    on `tokens` tokens of `files` (default: the bundled essays) in sequences of `length`."""
    kv_cfg = args.kv_store_config()
    if kv_cfg.sparse_budget <= 0:
        raise ValueError("strata profile needs --sparse-budget (the uniform budget whose "
                         "total the plan spends)")
    if kv_cfg.selector not in ("quest", "mean"):
        raise ValueError("strata profile measures with --selector quest or mean")
    folder = ensure_hf_folder(args.model, args.resolved_cache_dir)
    cfg = ModelConfig.from_hf(folder, args.config_overrides())
    length = min(length, cfg.served_positions)
    options = sorted(o for o in (options or DEFAULT_OPTIONS) if o < length - window)
    if not options or kv_cfg.sparse_budget < options[0]:
        raise ValueError(f"--sparse-budget {kv_cfg.sparse_budget}: no budget option from "
                         f"{options} at or below it fits sequences of {length} tokens")
    model = load_model(folder, cfg, dtype=torch.float32, device=torch.device("cpu"),
                       max_model_len=length, gguf=gguf_source(args.model))
    texts = calibration_texts(folder / "tokenizer.json", tokens, length, files=files)
    recall = measure(model, texts, kv_cfg, options, window, kv_cfg.selector).clone()
    dense = min(kv_cfg.dense_layers, cfg.num_hidden_layers)
    recall[:dense] = 1.0
    budgets = torch.full(recall.shape[:2], kv_cfg.sparse_budget, dtype=torch.int64)
    budgets[dense:] = solve(recall[dense:], options, kv_cfg.sparse_budget)
    return BudgetPlan(tuple(tuple(b) for b in budgets.tolist()), kv_cfg.sparse_budget,
                      kv_cfg.page_size, dense, tuple(options), recall.tolist(),
                      sum(map(len, texts)), kv_cfg.selector)


def write_plan(plan: BudgetPlan, out: str | Path) -> str:
    """Save the plan; returns a line that sums it up."""
    plan.save(out)
    mine, uniform = plan.predicted()
    counts: dict[int, int] = {}
    for layer in plan.budgets[plan.dense_layers:]:
        for b in layer:
            counts[b] = counts.get(b, 0) + 1
    spread = ", ".join(f"{b}: {n}" for b, n in sorted(counts.items()))
    vs = f" against {uniform:.3f} uniform" if uniform is not None else ""
    return (f"{out}: predicted attention recall {mine:.3f}{vs} at budget {plan.budget} "
            f"(heads per budget: {spread}; {plan.tokens} calibration tokens)")
