"""`strata calibrate`'s work: load the model, fit the keys' low-rank basis of --selector
lowrank on text (kvstore/lowrank.py), save it where serve looks for it."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from engine.args import EngineArgs
from engine.gguf_convert import ensure_hf_folder, gguf_source
from engine.model_config import ModelConfig, rope_identity
from engine.model_loader import load_model
from kvstore.lowrank import LowRankProjection, calibrate, calibration_texts, projection_path


def calibrate_model(args: EngineArgs, tokens: int, files: list[str] | None = None
                    ) -> tuple[Path, LowRankProjection]:
    """Fit args.lowrank_rank on `tokens` tokens of `files` (default: the bundled essays);
    returns (the file written, the projection)."""
    folder = ensure_hf_folder(args.model, args.resolved_cache_dir)
    cfg = ModelConfig.from_hf(folder, args.config_overrides())
    served = args.max_model_len or cfg.served_positions     # as serve rotates the keys
    model = load_model(folder, cfg, dtype=torch.float32, device=torch.device("cpu"),
                       max_model_len=served, gguf=gguf_source(args.model))
    texts = calibration_texts(folder / "tokenizer.json", tokens, files=files)
    bar = tqdm(total=sum(map(len, texts)), unit="tok", desc="calibrating")
    proj = calibrate(model, texts, args.lowrank_rank,
                     lambda done, total: bar.update(done - bar.n))
    bar.close()
    path = projection_path(folder, args.resolved_cache_dir, args.lowrank_rank,
                           rope_identity(cfg, args.config_overrides(), served))
    path.parent.mkdir(parents=True, exist_ok=True)
    proj.save(path)
    return path, proj
