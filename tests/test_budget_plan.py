"""Per-(layer, KV head) budgets (kvstore/budget_plan.py, `strata profile`,
--sparse-budget-plan): the knapsack, the recall measurement, the per-head selection, the file,
and the engine decoding with a plan."""
from __future__ import annotations

import json

import pytest
import torch

from kernels.page_topk import select_pages
from kvstore.budget_plan import BudgetPlan, recall_curves, solve
from tests import engine_helpers

OPTIONS = [128, 256, 512, 1024, 2048]


def test_solve_gives_the_tokens_to_the_heads_that_gain_from_them():
    # heads 0 and 1 put their attention on a few pages (all of it by 512 tokens); head 2
    # spreads it
    focused = [0.99, 0.995, 1.0, 1.0, 1.0]
    recall = torch.tensor([[focused, focused, [0.2, 0.35, 0.55, 0.75, 0.9]]])
    plan = solve(recall, OPTIONS, 1024)
    assert plan.tolist() == [[512, 512, 2048]]
    got = sum(recall[0, h, OPTIONS.index(int(b))] for h, b in enumerate(plan[0]))
    assert got > recall[0, :, OPTIONS.index(1024)].sum() + 0.1
    with pytest.raises(ValueError, match="below the smallest option"):
        solve(recall, OPTIONS, 64)


def test_solve_spends_what_a_hull_step_too_large_to_fit_leaves():
    # head 0's hull jumps 128 -> 512 (256 lies under it); 128 tokens are left after head 1
    # took its steps: a fill pass takes head 0 to 256 rather than leave them unspent
    options = [128, 256, 512]
    recall = torch.tensor([[[0.1, 0.15, 0.9], [0.5, 0.9, 0.95]]])
    plan = solve(recall, options, 256)
    assert plan.tolist() == [[256, 256]]
    assert plan.float().mean() <= 256


def test_solve_never_does_worse_than_uniform_on_concave_curves():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        rates = torch.rand(6, 3, 1, generator=g) * 3
        x = torch.tensor(OPTIONS, dtype=torch.float32) / 2048
        recall = 1 - torch.exp(-rates * x * 8)                    # concave, rising
        for budget in (256, 512, 1024):
            plan = solve(recall, OPTIONS, budget)
            assert plan.float().mean() <= budget + 1e-6
            idx = torch.tensor([[OPTIONS.index(int(b)) for b in row] for row in plan])
            mine = recall.gather(2, idx[..., None]).sum()
            assert mine >= recall[..., OPTIONS.index(budget)].sum() - 1e-5


def test_recall_grows_with_the_budget_and_finds_a_planted_key():
    g = torch.Generator().manual_seed(1)
    t, kvh, group, d = 600, 2, 3, 16
    q = torch.randn(t, kvh * group, d, generator=g)
    k = 0.1 * torch.randn(t, kvh, d, generator=g)         # (Quest's box is loose otherwise)
    # KV head 0: the last queries all look at one old key (a needle); head 1: nothing stands out
    q[-8:, :group] = 6 * torch.nn.functional.normalize(torch.ones(d), dim=0)
    k[100, 0] = 6 * torch.nn.functional.normalize(torch.ones(d), dim=0)
    pages = [3, 4, 6, 9, 40]
    r = recall_curves(q, k, 16, 1, 1, pages, 8, 1.0)
    assert r.shape == (kvh, len(pages))
    assert bool((r[:, 1:] >= r[:, :-1] - 1e-6).all())           # more pages keep more mass
    assert torch.allclose(r[:, -1], torch.ones(kvh), atol=1e-5)  # every page: everything
    assert r[0, 0] > 0.9 and r[1, 0] < 0.5                       # the needle's page at once
    with pytest.raises(ValueError, match="window"):
        recall_curves(q, k, 16, 1, 1, pages, 599, 1.0)


def test_a_budget_per_head_selects_each_row_as_its_own_uniform_budget():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 4, 50, generator=g)
    counts = [50, 30, 12]
    budgets = torch.tensor([4, 9, 20, 6])
    prior = torch.randn(3, 4, 50, generator=g)
    got = select_pages(scores, counts, budgets, 1, 2, prior, torch.tensor([1, 2, 5, 0]))
    for h, (b, p) in enumerate(zip(budgets.tolist(), [1, 2, 5, 0])):
        one = select_pages(scores, counts, b, 1, 2, prior, p)
        for s in range(3):
            assert got.row(s, h).tolist() == one.row(s, h).tolist()
    for s in range(3):                                 # the union is the heads' pages
        rows = set().union(*(got.row(s, h).tolist() for h in range(4)))
        assert got.union(s).tolist() == sorted(rows)


@pytest.mark.parametrize("quest", [True, False])
def test_the_c_kernel_takes_a_budget_per_head_as_the_torch_path(quest):
    from kernels.page_select import _select, mean_scores, native_select, quest_scores
    if _select is None:
        pytest.skip("kernels/_select.c is not built")
    g = torch.Generator().manual_seed(3)
    kvh, group, d = 3, 3, 64
    q = torch.randn(4, kvh * group, d, generator=g)
    counts = [70, 40, 9, 55]
    summ = [torch.randn(n, kvh, 3, d, generator=g) for n in counts]
    priors = [torch.randn(n, kvh, generator=g) for n in counts]
    budgets, prior_pages = torch.tensor([5, 30, 12]), torch.tensor([2, 0, 4])
    got, _ = native_select(q, summ, counts, group, quest, budgets, 1, 2, priors, prior_pages)
    scores = (quest_scores if quest else mean_scores)(q, summ, counts, group)
    prior = torch.full_like(scores, -float("inf"))
    for b, p in enumerate(priors):
        prior[b, :, :counts[b]] = p.t()
    want = select_pages(scores, counts, budgets, 1, 2, prior, prior_pages)
    for name in ("indptr", "page_indices", "union_indptr", "union_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def _plan(budgets, budget=1024, page_size=16) -> BudgetPlan:
    return BudgetPlan(tuple(tuple(b) for b in budgets), budget, page_size, 2, tuple(OPTIONS),
                      [[[1.0] * len(OPTIONS)] * len(budgets[0])] * len(budgets), 100, "quest")


def test_the_plan_file_round_trips_and_bad_files_are_clear_errors(tmp_path):
    plan = _plan([[1024, 1024, 1024]] * 2 + [[128, 2048, 896]] * 28)
    plan.save(tmp_path / "p.json")
    assert BudgetPlan.load(tmp_path / "p.json") == plan
    (tmp_path / "bad.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="budget plan of version 1"):
        BudgetPlan.load(tmp_path / "bad.json")
    (tmp_path / "neg.json").write_text(json.dumps({**json.loads(
        (tmp_path / "p.json").read_text()), "budgets": [[0, 1], [1, 1]]}))
    with pytest.raises(ValueError, match="positive"):
        BudgetPlan.load(tmp_path / "neg.json")
    with pytest.raises(ValueError, match="No such file"):
        BudgetPlan.load(tmp_path / "none.json")


def test_engine_args_take_the_plans_budget_and_refuse_another(tmp_path):
    from engine.args import EngineArgs
    _plan([[512, 1024, 1536]] * 30).save(tmp_path / "p.json")
    cfg = EngineArgs(sparse_budget_plan=str(tmp_path / "p.json")).kv_store_config()
    assert cfg.sparse_budget == 1024 and cfg.head_budget_pages(5) == [32, 64, 96]
    with pytest.raises(ValueError, match="was made for --sparse-budget 1024"):
        EngineArgs(sparse_budget=512, sparse_budget_plan=str(tmp_path / "p.json"))


def _run(smollm2_dir, **kw):
    return engine_helpers.run_code_prompt(smollm2_dir, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("selector", ["quest", "centroid"])
def test_a_plan_of_the_uniform_budget_decodes_as_the_uniform_budget(smollm2_dir, tmp_path,
                                                                    selector):
    kw = dict(sparse_sink_tokens=16, sparse_local_tokens=32, selector=selector)
    _, uniform = _run(smollm2_dir, sparse_budget=128, **kw)
    _plan([[128] * 3] * 30, budget=128).save(tmp_path / "same.json")
    _, same = _run(smollm2_dir, sparse_budget_plan=str(tmp_path / "same.json"), **kw)
    assert same == uniform
    # heads given the whole context decode as dense whatever the others get
    _, dense = _run(smollm2_dir)
    _plan([[4096] * 3] * 30, budget=128).save(tmp_path / "all.json")
    _, wide = _run(smollm2_dir, sparse_budget_plan=str(tmp_path / "all.json"), **kw)
    assert wide == dense


@pytest.mark.slow
def test_a_plan_for_another_model_is_refused(smollm2_dir, tmp_path):
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    _plan([[128] * 3] * 12, budget=128).save(tmp_path / "small.json")
    with pytest.raises(ValueError, match="12 layers x 3 KV heads, the model has 30"):
        LLMEngine(EngineArgs(model=str(smollm2_dir), kv_device_gb=0.1, prefix_cache="off",
                             sparse_budget_plan=str(tmp_path / "small.json")))


@pytest.mark.slow
def test_strata_profile_writes_a_plan_serve_loads(smollm2_dir, tmp_path, capsys):
    from server.cli import main
    out = tmp_path / "plan.json"
    assert main(["profile", "--model", str(smollm2_dir), "--sparse-budget", "256",
                 "--tokens", "2048", "--length", "1024", "--window", "8",
                 "--out", str(out)]) == 0
    assert "predicted attention recall" in capsys.readouterr().out
    plan = BudgetPlan.load(out)
    assert plan.options == (128, 256, 512) and plan.tokens == 2048
    sparse = [b for layer in plan.budgets[2:] for b in layer]
    assert len(sparse) == 28 * 3 and sum(sparse) <= 256 * len(sparse)
    assert len(set(sparse)) > 1                         # the heads do differ
    mine, uniform = plan.predicted()
    assert mine >= uniform
    _run(smollm2_dir, sparse_budget_plan=str(out))
