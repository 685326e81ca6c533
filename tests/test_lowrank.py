"""--selector lowrank (kvstore/lowrank.py): the calibrated basis, its file, and the engine
selecting pages over projected summaries."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from kvstore.lowrank import (LowRankProjection, calibrate, calibration_texts, collect, fit,
                             projection_path)
from tests import engine_helpers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from engine.model_config import ModelConfig
    from engine.model_loader import load_model
    cfg = ModelConfig.from_hf(smollm2_dir)
    return load_model(smollm2_dir, cfg, dtype=torch.float32, max_model_len=2048)


@pytest.fixture(scope="module")
def rank8(smollm2_dir, model) -> LowRankProjection:
    """Rank 8 fitted on 2 x 1024 tokens of the bundled essays, where serve looks for it."""
    texts = calibration_texts(smollm2_dir / "tokenizer.json", tokens=2048, length=1024)
    proj = calibrate(model, texts, 8)
    proj.save(projection_path(smollm2_dir, EngineArgs().resolved_cache_dir, 8))
    return proj


def test_the_basis_is_orthonormal_and_keeps_most_of_the_keys_energy(rank8, smollm2_dir, model,
                                                                     tmp_path):
    basis = rank8.basis                                       # [L, KVH, D, r]
    assert basis.shape == (30, 3, 64, 8) and rank8.tokens == 2048
    eye = basis.transpose(-1, -2) @ basis
    assert torch.allclose(eye, torch.eye(8).expand_as(eye), atol=1e-4)
    texts = calibration_texts(smollm2_dir / "tokenizer.json", tokens=1024, length=1024)
    stats = collect(model, texts)
    keys8 = fit(stats, 8, "keys")                             # KVSwap's: the keys' SVD
    assert all(0.5 < e <= 1.0 for e in keys8.energy)
    # the query-weighted basis gives up some key energy for the directions queries use
    assert sum(fit(stats, 8).energy) < sum(keys8.energy)
    for weighting in ("keys", "queries"):                     # every direction kept
        assert all(abs(e - 1.0) < 1e-6 for e in fit(stats, 64, weighting).energy)
    rank8.save(tmp_path / "p.pt")
    again = LowRankProjection.load(tmp_path / "p.pt")
    assert torch.equal(again.basis, rank8.basis) and again.energy == rank8.energy
    with pytest.raises(ValueError, match="calibrate"):
        again.check(30, 3, 32)


def test_projected_queries_and_keys_keep_dot_products_in_the_basis_span(rank8):
    # keys inside the span of a KV head's basis: (q A).(k A) == q.k exactly
    a = rank8.basis[4]                                        # [KVH, D, r]
    k = (torch.randn(2, 3, 16, 8) @ a.transpose(-1, -2))      # [n, KVH, ps, D] in the span
    q = torch.randn(1, 9, 64)
    exact = torch.einsum("bhd,nhtd->bnht", q.view(1, 3, 3, 64).reshape(1, 9, 64),
                         k.repeat_interleave(3, 1))
    qp, kp = rank8.queries(4, q, 3), rank8.keys(4, k)
    approx = torch.einsum("bhr,nhtr->bnht", qp, kp.repeat_interleave(3, 1))
    assert torch.allclose(approx, exact, atol=1e-3)


def _run(smollm2_dir, **kw):
    return engine_helpers.run_code_prompt(smollm2_dir, **kw)


def test_lowrank_with_a_budget_covering_the_context_equals_dense(rank8, smollm2_dir):
    _, dense = _run(smollm2_dir)
    engine, got = _run(smollm2_dir, sparse_budget=4096, selector="lowrank", lowrank_rank=8)
    assert got == dense
    rkv_dim = engine.store.selection.summary_dim
    assert rkv_dim == 8                       # 3 x 8 values a page and KV head, not 3 x 64


def test_lowrank_over_the_identity_basis_selects_as_quest(smollm2_dir):
    # the full-rank identity basis leaves keys and queries as they are: the same pages
    ident = LowRankProjection(torch.eye(64).expand(30, 3, 64, 64).contiguous(), 0,
                              (1.0,) * 30)
    ident.save(projection_path(smollm2_dir, EngineArgs().resolved_cache_dir, 64))
    kw = dict(sparse_budget=128, sparse_local_tokens=32, sparse_sink_tokens=16)
    _, quest = _run(smollm2_dir, selector="quest", **kw)
    engine, low = _run(smollm2_dir, selector="lowrank", lowrank_rank=64, **kw)
    assert low == quest
    assert engine.store.stats.snapshot().selected_count > 0


def test_keys_rotated_otherwise_get_a_basis_of_their_own(smollm2_dir, tmp_path):
    from engine.llm_engine import LLMEngine
    from engine.model_config import ModelConfig, rope_identity
    cfg = ModelConfig.from_hf(smollm2_dir)
    assert rope_identity(cfg, {}, 8192) == ""           # the model's own keys: the plain name
    assert projection_path(tmp_path, None, 16).name == "lowrank-r16.pt"
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                             "original_max_position_embeddings": 8192}}
    ident = rope_identity(ModelConfig.from_hf(smollm2_dir, yarn), yarn, 16384)
    path = projection_path(smollm2_dir, EngineArgs().resolved_cache_dir, 4, ident)
    assert path != projection_path(smollm2_dir, EngineArgs().resolved_cache_dir, 4)
    # serve with those overrides reads that file (calibrating the plain one would differ)
    basis = torch.linalg.qr(torch.randn(30, 3, 64, 4, generator=torch.Generator().manual_seed(
        0)))[0].contiguous()
    LowRankProjection(basis, 0, (1.0,) * 30).save(path)
    import json
    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), selector="lowrank", lowrank_rank=4,
                                  kv_device_gb=0.05, hf_overrides=json.dumps(yarn),
                                  max_model_len=4096))
    assert torch.equal(engine.store.selection.projection.basis, basis)
