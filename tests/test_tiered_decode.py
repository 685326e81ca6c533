"""The tiered KV store under the real engine: dense equivalence whatever the tier placement,
sparse decode, corrupt pages and I/O errors failing only their request."""
from __future__ import annotations

import errno

import pytest
import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from kvstore.tiers.disk_fault import DiskFault
from tests import engine_helpers
from tests.engine_helpers import drive, flip_bytes, greedy

pytestmark = pytest.mark.slow

STEPS = 64


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from server.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(smollm2_dir)
    text = ("The lighthouse keeper wrote in his log every night. " * 12
            + "The secret code is 4921. Remember it. " + "Waves hit the rocks. " * 10)
    return [tok.encode_chat([{"role": "user", "content": text + " What is the secret code?"}]),
            tok.encode_chat([{"role": "user", "content": "Tell me a long story about a cat "
                                                         "who learns to sail."}])]


def run(engine: LLMEngine, prompts, steps=STEPS, ids=None) -> dict[str, list[int]]:
    return engine_helpers.run(engine, prompts, steps, ids)


def make(folder, tmp_path=None, **kw) -> LLMEngine:
    kw.setdefault("kv_host_pool", "separate")       # the GPU-shaped three tiers
    kw.setdefault("prefix_cache", "off")            # the tiers alone (tests/test_prefix_cache.py)
    if "kv_disk_gb" in kw:
        kw.setdefault("kv_disk_path", tmp_path / "kv")
    return LLMEngine(EngineArgs(model=str(folder), dtype="auto", page_size=16, **kw))


@pytest.fixture(scope="module")
def dense(smollm2_dir, prompts):
    got, errors = run(make(smollm2_dir, kv_device_gb=0.1), prompts)
    assert not errors
    return got


@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_sparse_equals_dense_when_budget_covers_context(smollm2_dir, prompts, dense, tmp_path,
                                                        placement):
    kw = dict(kv_device_gb=0.1, sparse_budget=4096)
    if placement == "host":
        kw.update(kv_host_gb=0.1, kv_force_tier="host")
    if placement == "disk":
        kw.update(kv_host_gb=0.05, kv_disk_gb=0.2, kv_force_tier="disk")
    engine = make(smollm2_dir, tmp_path, **kw)
    got, errors = run(engine, prompts)
    assert not errors
    assert got == dense
    stats = engine.store.stats.snapshot()
    if placement == "host":
        assert stats.hits.get("host", 0) > 0 and stats.transfer_bytes[("host", "device")] > 0
    if placement == "disk":
        assert stats.hits.get("disk", 0) > 0 and stats.transfer_bytes[("disk", "device")] > 0
        assert stats.transfer_bytes[("device", "disk")] > 0
    assert engine.store.num_used_pages == 0
    assert all(used == 0 for used, _ in engine.store.tier_usage().values())


def test_on_a_cpu_the_host_tier_joins_the_device_pool(smollm2_dir, prompts, dense, tmp_path):
    # the same DRAM: attention reads host-budget pages in place, no host -> device copies
    engine = make(smollm2_dir, tmp_path, kv_device_gb=0.05, kv_host_gb=0.05, kv_disk_gb=0.2,
                  kv_host_pool="auto", kv_force_tier="disk", sparse_budget=4096)
    usage = engine.store.tier_usage()
    assert set(usage) == {"device", "disk"}
    assert usage["device"][1] == pytest.approx(0.1 * 2**30, rel=0.01)
    got, errors = run(engine, prompts)
    assert not errors and got == dense
    stats = engine.store.stats.snapshot()
    assert "host" not in stats.lookups and stats.hits.get("disk", 0) > 0
    assert not any("host" in pair for pair in stats.transfer_bytes)


@pytest.mark.parametrize("head_pages", ["per-head", "union"])
def test_sparse_decode_attends_within_budget_and_stays_on_topic(smollm2_dir, prompts, dense,
                                                               tmp_path, head_pages):
    # 256-token budget over a ~400-token context (sparse from the first page past the budget):
    # decode runs sparse past the dense layers
    engine = make(smollm2_dir, tmp_path, kv_device_gb=0.1, kv_disk_gb=0.2, sparse_budget=256,
                  sparse_threshold=256, sparse_local_tokens=64, sparse_head_pages=head_pages)
    got, errors = run(engine, prompts[:1])
    assert not errors
    stats = engine.store.stats.snapshot()
    assert stats.selected_count > 0
    assert stats.selected_sum / stats.selected_count <= 256
    assert stats.dense_fallbacks.get("dense_layer", 0) > 0
    # the first tokens agree with dense decoding (the needle sits in the selected pages)
    assert got["r0"][:8] == dense["r0"][:8]


def test_contexts_up_to_the_sparse_threshold_decode_densely(smollm2_dir, prompts, dense,
                                                           tmp_path):
    # the same ~400 tokens past a 256-token budget but not past the threshold (by default
    # twice the budget): dense decoding, the same tokens as without a budget
    engine = make(smollm2_dir, tmp_path, kv_device_gb=0.1, kv_disk_gb=0.2, sparse_budget=256)
    got, errors = run(engine, prompts[:1])
    assert not errors and got["r0"] == dense["r0"]
    stats = engine.store.stats.snapshot()
    assert stats.selected_count == 0 and stats.dense_fallbacks.get("fits_budget", 0) > 0


def test_corrupt_page_fails_only_its_request(smollm2_dir, prompts, dense, tmp_path):
    engine = make(smollm2_dir, tmp_path, kv_device_gb=0.1, kv_disk_gb=0.2,
                  kv_force_tier="disk")
    engine.add_request("victim", prompts[0], greedy(STEPS))
    engine.add_request("other", prompts[1], greedy(STEPS))
    corrupted = []

    def corrupt(got):
        if not corrupted and len(got["victim"]) >= 4:
            files = sorted((tmp_path / "kv").rglob("*"))
            flip_bytes([f for f in files if f.is_file()][0], 64)   # handles are issued in order
            corrupted.append(True)

    got, errors = drive(engine, ["victim", "other"], corrupt)
    assert "victim" in errors and "corrupt" in errors["victim"].lower()
    assert "other" not in errors
    assert got["other"] == dense["r1"]
    assert engine.store.num_used_pages == 0


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_disk_write_error_fails_only_its_request(smollm2_dir, prompts, dense, tmp_path, code):
    engine = make(smollm2_dir, tmp_path, kv_device_gb=0.1, kv_disk_gb=0.2)
    engine.add_request("victim", prompts[0], greedy(STEPS))
    victim_handle = engine.store.request("victim").handle
    engine.store.tiers.disk_tier.fault = DiskFault(write_errno=code, handles=frozenset({victim_handle}))
    engine.add_request("other", prompts[1], greedy(STEPS))
    got, errors = drive(engine, ["victim", "other"])
    assert "victim" in errors and "disk" in errors["victim"].lower()
    assert "other" not in errors and got["other"] == dense["r1"]


def test_a_full_disk_under_a_small_device_tier_is_reported_as_disk_full(smollm2_dir, prompts,
                                                                       dense, tmp_path):
    # the device tier cannot hold the prompt, and its pages can never be written to the full
    # disk (so never evicted): the request ends with "disk full", not "raise --kv-device-gb";
    # a request that fits on the device is unharmed
    engine = make(smollm2_dir, tmp_path, kv_device_gb=0.004, kv_disk_gb=0.2)
    engine.add_request("victim", prompts[0], greedy(STEPS))
    engine.store.tiers.disk_tier.fault = DiskFault(write_errno=errno.ENOSPC)
    got, errors = drive(engine, ["victim"])
    assert "disk full" in errors["victim"], errors["victim"]
    assert engine.store.num_used_pages == 0


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_prefill_ranks_pages_by_the_prompts_observation_window(smollm2_dir, prompts, tmp_path,
                                                                reduce):
    # SnapKV's window: the last prompt tokens' attention, computed once at the end of prefill
    engine = make(smollm2_dir, tmp_path, kv_device_gb=0.1, sparse_budget=256,
                  sparse_obs_window=32, sparse_obs_reduce=reduce,
                  max_num_batched_tokens=256)                           # chunked prefill
    ids = prompts[0]
    engine.add_request("r0", ids, greedy(4))
    rkv = engine.store.request("r0")
    group = engine.runner.config.group_size
    n = -(-len(ids) // 16)
    while not engine.scheduler.get_request("r0").output_token_ids:
        assert torch.isinf(rkv.prior).all(), "a prior before the prompt's last chunk"
        engine.step()
    dl = engine.store.cfg.dense_layers
    assert torch.isinf(rkv.prior[:dl]).all()               # dense layers never select
    mass = rkv.prior[dl:, :n]
    assert torch.isfinite(mass).all() and (mass >= 0).all()
    assert torch.isinf(rkv.prior[:, n:]).all()             # no page past the prompt
    if reduce == "sum":
        # each query head's rows sum to one: every KV head got group * window in all
        torch.testing.assert_close(mass.sum(1), torch.full_like(mass.sum(1), group * 32.0))
    else:
        # the largest share of one query head's attention: at most 1, and the pages of one
        # row of one head add up to 1, so the pages' maxima add up to at least 1
        assert (mass <= 1 + 1e-5).all() and (mass.sum(1) >= 1 - 1e-4).all()
    drive(engine, ["r0"])
    assert engine.store.request("r0") is None
