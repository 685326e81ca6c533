"""The resident decode path (kvstore/resident.py) against the general one: decode steps whose
pages are all on the device tier (or opened by the step) give the same tokens,
log-probabilities, tier statistics, recency stamps and backing-tier writes as the per-layer
path of kvstore/step.py."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from kernels.select_plan import SelectPlan
from kvstore.budget_plan import BudgetPlan
from kvstore.resident import ResidentDecode
from scheduler.sampling_params import SamplingParams
from tests.model_helpers import greedy_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture
def plans(monkeypatch):
    """Counts the steps that took the resident path."""
    made = []
    original = ResidentDecode.plan.__func__

    def plan(cls, *args, **kwargs):
        p = original(cls, *args, **kwargs)
        made.append(p is not None)
        return p

    monkeypatch.setattr(ResidentDecode, "plan", classmethod(plan))
    return made


def decode(folder, prompts, resident: bool, steps: int = 40, **kw):
    """Greedy `steps` tokens of each prompt: (request id -> [(token, logprob)], the engine)."""
    ResidentDecode.enabled = resident
    try:
        if "kv_disk_path" in kw:     # each engine its own folder (a server holds its lock)
            kw = dict(kw, kv_disk_path=kw["kv_disk_path"] / ("resident" if resident else "ref"))
        kw = {"prefix_cache": "off", **kw}
        engine = LLMEngine(EngineArgs(model=str(folder), page_size=16, **kw))
        return greedy_logprobs(engine, prompts, steps), engine
    finally:
        ResidentDecode.enabled = True


def prompts_of(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(100, 40000, (length + 9 * i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("backing", ["device", "disk", "sfc", "prefix-cache"])
def test_resident_steps_equal_the_general_path(smollm2_dir, tmp_path, plans, backing):
    kw = dict(kv_device_gb=0.1)
    if backing == "disk":       # pages that fill are written through to the disk tier
        kw.update(kv_disk_gb=0.2, kv_disk_path=tmp_path / "kv", kv_host_pool="separate",
                  kv_host_gb=0.05)
    if backing == "sfc":
        kw.update(pipeline="sfc", micro_batch=2)
    if backing == "prefix-cache":       # the prompts share their first pages
        kw.update(prefix_cache="on")
    prompts = prompts_of(3, 150)
    if backing == "prefix-cache":
        prompts = [prompts[0][:64] + p for p in prompts]
    ref, ref_engine = decode(smollm2_dir, prompts, resident=False, **kw)
    assert not any(plans)
    plans.clear()
    got, engine = decode(smollm2_dir, prompts, resident=True, **kw)
    # the prefill took the general path, then every decode step the resident one, those that
    # open a page (2 or 3 of 40 a sequence: its slots are reserved at the step's start) too
    first = plans.index(True)
    assert 0 < first and all(plans[first:]), plans
    assert got == ref
    for e in (engine, ref_engine):      # disk writes count once they are in
        e.store.tiers.wait_writes()
        e.store.tiers.check_writes()
    a, b = engine.store.stats.snapshot(), ref_engine.store.stats.snapshot()
    assert (a.lookups, a.hits, a.evictions, a.transfer_bytes) == \
        (b.lookups, b.hits, b.evictions, b.transfer_bytes)
    if backing == "disk":
        assert a.transfer_bytes[("device", "disk")] > 0
    assert torch.equal(engine.store.tiers.residency.last_used,
                       ref_engine.store.tiers.residency.last_used)


def test_a_step_with_a_page_off_the_device_takes_the_general_path(smollm2_dir, tmp_path, plans):
    # a device tier smaller than the context: every decode step fetches, none is resident
    kw = dict(kv_device_gb=0.004, kv_disk_gb=0.2, kv_disk_path=tmp_path / "kv",
              kv_host_pool="separate", kv_host_gb=0.004)
    prompts = prompts_of(1, 900)
    ref, _ = decode(smollm2_dir, prompts, resident=False, steps=12, **kw)
    got, engine = decode(smollm2_dir, prompts, resident=True, steps=12, **kw)
    assert plans and not any(plans)
    assert got == ref
    assert engine.store.stats.snapshot().hits.get("disk", 0) > 0


def test_resident_steps_keep_the_page_summaries_sparse_decode_selects_by(smollm2_dir, plans):
    # contexts within the sparse budget decode densely (resident), then grow past it (sparse
    # from the first page past it): the selection then reads the summaries of the pages the
    # resident steps wrote
    kw = dict(kv_device_gb=0.1, sparse_budget=256, sparse_threshold=256, sparse_sink_tokens=16,
              sparse_local_tokens=32)
    prompts = prompts_of(2, 200)
    ref, _ = decode(smollm2_dir, prompts, resident=False, steps=96, **kw)
    plans.clear()
    got, engine = decode(smollm2_dir, prompts, resident=True, steps=96, **kw)
    assert any(plans) and not all(plans)
    assert engine.store.stats.snapshot().selected_count > 0       # it did go sparse
    assert got == ref


def test_every_full_page_keeps_the_summary_of_its_keys(smollm2_dir, plans):
    # pages filled by prefill and by decode steps: their summaries (selection's input) are
    # those of the keys on the device; a sequence's partial last page is not summarized
    # until it fills (the local window always keeps it)
    from kernels.page_summary import summarize_pages
    kw = dict(kv_device_gb=0.1, sparse_budget=64, sparse_sink_tokens=16,
              sparse_local_tokens=16)
    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), page_size=16, prefix_cache="off",
                                  **kw))
    for i, p in enumerate(prompts_of(2, 300)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=60, temperature=0.0,
                                                      ignore_eos=True))
    for _ in range(45):
        engine.step()
    store, tiers = engine.store, engine.store.tiers
    for rid in ("r0", "r1"):
        pages = torch.tensor(store.pages(rid), dtype=torch.int64)
        tokens = 300 + 9 * int(rid[1]) + 45
        full = tokens // 16
        assert full > 300 // 16 + 1         # decode filled some
        for layer in (0, 17, 29):
            slots = tiers.device_tier.slots(tiers.keys_of(pages[:full], range(layer, layer + 1)))
            assert bool((slots >= 0).all())
            want = summarize_pages(tiers.pool[slots.long(), 0], [16] * full,
                                   store.request(rid).summaries.dtype)
            assert torch.equal(store.request(rid).summaries[layer, :full], want), (rid, layer)


@pytest.mark.parametrize("residency,per_head", [("lru", False), ("score", False),
                                                ("lru", True)])
def test_resident_sparse_steps_equal_the_general_path(smollm2_dir, plans, tmp_path, monkeypatch,
                                                      residency, per_head):
    # every context on the device tier; three past the budget from the first decode step (their
    # sparse layers select), one within it until it grows past it (a dense row in sparse
    # layers, then a sparse one): the same tokens, selections, statistics and recency stamps
    # (the score policy's weak marks too); per_head: a budget per layer and KV head
    kw = dict(kv_device_gb=0.1, sparse_budget=64, sparse_sink_tokens=16,
              sparse_local_tokens=16, residency=residency)
    if per_head:
        budgets = tuple(tuple((32, 64, 128)[(i + h) % 3] for h in range(3)) for i in range(30))
        BudgetPlan(budgets, 64, 16, 2, (32, 64, 128), [[[1.0] * 3] * 3] * 30, 100,
                   "quest").save(tmp_path / "plan.json")
        kw = dict(kw, sparse_budget_plan=str(tmp_path / "plan.json"))
    prompts = prompts_of(3, 300) + [prompts_of(1, 40)[0]]
    ref, ref_engine = decode(smollm2_dir, prompts, resident=False, **kw)
    plans.clear()
    prepared = []       # the resident steps' layers select with the step's SelectPlan
    select = SelectPlan.select
    monkeypatch.setattr(SelectPlan, "select", lambda *a: prepared.append(1) or select(*a))
    got, engine = decode(smollm2_dir, prompts, resident=True, **kw)
    assert sum(plans) > len(plans) // 2 and prepared
    assert got == ref
    a, b = engine.store.stats.snapshot(), ref_engine.store.stats.snapshot()
    assert a.selected_count > 0 and a.dense_fallbacks["fits_budget"] > 0
    for field in ("lookups", "hits", "evictions", "transfer_bytes", "dense_fallbacks",
                  "selected_buckets", "selected_sum", "selected_count"):
        assert getattr(a, field) == getattr(b, field), field
    assert torch.equal(engine.store.tiers.residency.last_used,
                       ref_engine.store.tiers.residency.last_used)


def test_pipelined_sparse_decodes_take_the_general_path(smollm2_dir, plans):
    kw = dict(kv_device_gb=0.1, sparse_budget=64, sparse_sink_tokens=16,
              sparse_local_tokens=16, pipeline="sfc", micro_batch=1)
    got, _ = decode(smollm2_dir, prompts_of(2, 300), resident=True, steps=8, **kw)
    assert plans and not any(plans)
