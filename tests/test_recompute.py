"""KV recompute (KVPR, kvstore/recompute.py): the cost model's split, the start-up decision,
and an engine whose fills rebuild a share of their disk pages from stored layer inputs."""
from __future__ import annotations

import logging

import pytest
import torch

from kvstore.recompute import RecomputeCost, joined, plan_recompute
from kvstore.tiers.base import PageShape


@pytest.mark.parametrize("a,d,c", [(1.0, 2.0, 20.0), (1.0, 2.0, 0.5), (0.5, 2.0, 2.0),
                                   (1.0, 2.0, 1e-9), (2.0, 2.0, 0.1), (3.0, 2.0, 0.1)])
def test_split_is_the_fill_time_minimum(a, d, c):
    cost = RecomputeCost(a, d, c)
    for n in range(0, 90):
        s = cost.split(n)
        assert 0 <= s <= n
        best = min(cost.seconds(n, k) for k in range(n + 1))
        assert cost.seconds(n, s) == pytest.approx(best)
        if a >= d:              # inputs no smaller than the K/V: never recompute
            assert s == 0


def test_split_follows_kvpr_closed_form():
    # l* = n d / (c + d): a page recomputes in 3x the time its K/V reads in -> a quarter
    cost = RecomputeCost(input_page_s=1.0, kv_page_s=2.0, compute_page_s=6.0)
    assert cost.split(100) == 25
    assert cost.seconds(100, 25) < cost.seconds(100, 0)


def _no_projection(layer, x, pos):          # never called on the paths below
    raise AssertionError("the planner must decide from sizes alone here")


@pytest.mark.parametrize("kv_page_bytes", [12288, 6144, 3072])
def test_the_bundled_gqa_model_gets_split_zero_and_the_log_says_why(tmp_path, caplog,
                                                                    kv_page_bytes):
    # SmolLM2: 576 input values a token against 384 of K/V (3 KV heads x 64, K and V); with
    # the codec the K/V page shrinks further
    shape = PageShape(16, 3, 64, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="kvstore.recompute"):
        plan = plan_recompute("auto", shape, kv_page_bytes, 576, _no_projection, tmp_path, True)
    assert plan is None
    assert "split 0" in caplog.text and "no smaller than its K/V" in caplog.text


def test_recompute_is_off_without_a_disk_tier(caplog):
    shape = PageShape(16, 9, 64, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="kvstore.recompute"):
        assert plan_recompute("auto", shape, 36864, 576, _no_projection, None, True) is None
    assert "no disk tier" in caplog.text
    assert plan_recompute("off", shape, 36864, 576, _no_projection, "/nonexistent", True) is None


def test_an_mha_model_measures_costs_and_plans(tmp_path):
    shape = PageShape(16, 4, 16, torch.bfloat16)            # hidden 64 = 4 heads x 16

    def project(layer, x, pos):
        return x[:, :64].reshape(-1, 4, 16), x[:, :64].reshape(-1, 4, 16)
    plan = plan_recompute("0.5", shape, 4096, 64, project, tmp_path, True)
    assert plan is not None and plan.share == 0.5
    assert plan.input_stride == 2048                # 16 tokens x 64 values x 2 bytes
    assert plan.cost.input_page_s < plan.cost.kv_page_s and plan.cost.compute_page_s > 0


def test_joined_waits_for_both_and_carries_the_first_ones_outcome():
    from concurrent.futures import Future
    a, b = Future(), Future()
    j = joined(a, b)
    a.set_result(None)
    assert not j.done()
    b.set_exception(OSError("disk full"))       # the inputs' write: not the page's failure
    assert j.result() is None
    a, b = Future(), Future()
    j = joined(a, b)
    b.set_result(None)
    a.set_exception(OSError("disk full"))       # the K/V write: the page's failure
    with pytest.raises(OSError):
        j.result()


@pytest.fixture(scope="module")
def mha_folder(tmp_path_factory):
    """A tiny random-weight multi-head (not GQA) Llama: its layer inputs are half its K/V."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("tiny-mha")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1, initializer_range=0.25)
    LlamaForCausalLM(cfg).save_pretrained(folder)       # (sharp attention: K/V errors show)
    return folder


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_outputs_are_the_same_at_every_split(mha_folder, tmp_path, dtype):
    """Every page evicted to disk after each step, so each decode step fills all of them:
    recomputing any share of them from their inputs gives the tokens of reading them all."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests import engine_helpers
    prompts = [[1] + [(7 * i + 3) % 250 + 3 for i in range(150)],
               [1] + [(11 * i + 5) % 250 + 3 for i in range(97)]]

    def run(mode):
        engine = LLMEngine(EngineArgs(model=str(mha_folder), page_size=16, kv_device_gb=0.01,
                                      kv_disk_gb=0.05, kv_disk_path=tmp_path / mode,
                                      kv_force_tier="disk", prefix_cache="off", dtype=dtype,
                                      kv_recompute=mode))
        got, errors = engine_helpers.run(engine, prompts, 12)
        assert not errors
        return engine, got

    _, exact = run("off")
    for mode in ("0.25", "0.5", "0.75", "1", "auto"):
        engine, got = run(mode)
        assert got == exact, mode
        tiers = engine.store.tiers
        if mode == "auto" and tiers.recompute is None:      # this machine: no gain predicted
            continue
        if mode != "auto":
            assert engine.store.stats.snapshot().recomputed["disk"] > 0, mode
        # the pages' inputs went with them: nothing is left in the sidecar, nor a file
        assert tiers.disk_tier.inputs.num_pages == 0
        assert not list((tmp_path / mode / "inputs").glob("seg-*"))


def test_rebuilt_pages_equal_the_stored_ones(mha_folder, tmp_path):
    """Mid-run, every page's K/V rebuilt from its stored inputs (at its own positions) equals
    the K/V stored on disk: to the bit where the activations are bf16."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests import engine_helpers
    engine = LLMEngine(EngineArgs(model=str(mha_folder), page_size=16, kv_device_gb=0.01,
                                  kv_disk_gb=0.05, kv_disk_path=tmp_path, kv_force_tier="disk",
                                  prefix_cache="off", dtype="bf16", kv_recompute="1"))
    engine.add_request("r0", [1] + [(5 * i + 9) % 250 + 3 for i in range(120)],
                       engine_helpers.greedy(40))
    for _ in range(25):                     # 121 + 24 tokens: 9 full pages
        engine.step()
    tiers = engine.store.tiers
    rec, disk = tiers.recompute, tiers.disk_tier
    keys = rec.inputs.keys()
    assert keys.numel() == 9 * 3
    for layer in range(3):
        k = keys[keys // tiers.max_pages == layer]
        stored = torch.empty(k.numel(), *tiers.page_shape.shape, dtype=tiers.page_shape.dtype)
        disk.get(k, stored)
        rebuilt = torch.zeros_like(stored)
        assert rec.rebuild(k, rec.read(k), rebuilt, torch.arange(k.numel()), disk)
        assert torch.equal(rebuilt, stored), (rebuilt - stored).abs().max()
    engine_helpers.drive(engine, ["r0"])


def test_a_split_that_saves_too_little_is_not_taken():
    cost = RecomputeCost(input_page_s=1.0, kv_page_s=2.0, compute_page_s=20.0)
    s = cost.split(100)
    assert s > 0 and cost.seconds(100, s) > 0.95 * cost.seconds(100, 0)    # ~4.5% saved
    assert cost.split(100, min_gain=0.05) == 0
    assert RecomputeCost(1.0, 2.0, 6.0).split(100, min_gain=0.05) == 25


def test_strata_cache_clear_takes_the_inputs_too(tmp_path):
    from kvstore.cache_files import clear_cache
    from kvstore.tiers.disk_inputs import inputs_path
    (tmp_path / "seg-1.kv").write_bytes(b"k")
    (tmp_path / "seg-1.idx").write_bytes(b"i")
    inputs_path(tmp_path).mkdir()
    (inputs_path(tmp_path) / "seg-4.kv").write_bytes(b"x")     # left by a crashed server
    (inputs_path(tmp_path) / "notes.txt").write_text("not ours")
    assert clear_cache(tmp_path) == 3
    assert [p.name for p in inputs_path(tmp_path).iterdir()] == ["notes.txt"]


def test_unreadable_inputs_are_read_as_kv_instead(mha_folder, tmp_path):
    """A corrupt inputs file fails nobody: those pages are read as K/V, outputs unchanged."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from kvstore.tiers.disk_inputs import inputs_path
    from tests import engine_helpers
    prompt = [1] + [(3 * i + 7) % 250 + 3 for i in range(130)]

    def engine(mode, path):
        return LLMEngine(EngineArgs(model=str(mha_folder), page_size=16, kv_device_gb=0.01,
                                    kv_disk_gb=0.05, kv_disk_path=path, kv_force_tier="disk",
                                    prefix_cache="off", dtype="bf16", kv_recompute=mode))
    exact, errors = engine_helpers.run(engine("off", tmp_path / "off"), [prompt], 10)
    assert not errors
    eng = engine("1", tmp_path / "on")
    eng.add_request("r0", prompt, engine_helpers.greedy(10))
    eng.step()                                      # the prefill writes every full page
    eng.store.tiers.wait_writes()
    files = list(inputs_path(tmp_path / "on").glob("seg-*.kv"))
    assert files
    for f in files:
        engine_helpers.flip_bytes(f, 1 << 16)
    got, errors = engine_helpers.drive(eng, ["r0"])
    assert not errors and got["r0"] == exact["r0"][1:]
    assert eng.store.stats.snapshot().recomputed.get("disk", 0) == 0     # all read as K/V
