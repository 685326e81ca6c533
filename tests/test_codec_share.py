"""--kv-tier-codec-share: some layers' pages on disk as codes, the others as they are
(kvstore/codec_share.py, kvstore/tiers/disk_layers.py)."""
from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch

from kvstore.backing import backing_geometry
from kvstore.codec_share import ShareCost, coded_layers, plan_share
from kvstore.config import KVStoreConfig
from kvstore.tiers.base import PageShape
from kvstore.tiers.codec import PageCodec
from kvstore.tiers.disk_layers import DiskLayers
from kvstore.tiers.disk_layout import RAW_FOLDER, SHARE_FILE
from kvstore.tiers.errors import PageCorrupted, PageMissing

SHAPE = PageShape(16, 3, 64, torch.bfloat16)
LAYERS, MAX_PAGES = 4, 16


def test_a_share_codes_that_many_layers_spread_over_the_depth():
    assert coded_layers(0.0, 30) == [] and coded_layers(1.0, 30) == list(range(30))
    half = coded_layers(0.5, 30)
    assert len(half) == 15 and 0 not in half and half == list(range(1, 30, 2))
    for share in (0.1, 0.25, 0.34, 0.9):
        got = coded_layers(share, 30)
        assert len(got) == round(share * 30) and len(set(got)) == len(got)
        gaps = np.diff([-1] + got)
        assert gaps.max() - gaps.min() <= 1 + (gaps.min() == 0)        # evenly spread


def test_the_cost_model_meets_where_reading_and_decoding_take_as_long():
    # codes read in half the time, decoding is fast: all layers coded
    assert ShareCost(10.0, 5.0, 1.0).share() == 1.0
    # codes read no faster (an IOPS-bound drive): none
    assert ShareCost(10.0, 10.0, 0.1).share() == 0.0
    # decoding slower than the read it saves: the share where both sides take as long
    cost = ShareCost(10.0, 5.0, 20.0)
    s = cost.share()
    assert 0 < s < 1
    read = (1 - s) * 10.0 + s * 5.0
    assert read == pytest.approx(s * 20.0)
    assert all(cost.seconds(s) <= cost.seconds(x) + 1e-9 for x in np.linspace(0, 1, 101))
    # slower decoding never codes more
    shares = [ShareCost(10.0, 5.0, d).share() for d in (1, 5, 10, 20, 40, 80)]
    assert shares == sorted(shares, reverse=True)
    # a gain under the minimum is not taken
    assert ShareCost(10.0, 9.9, 0.1).share(min_gain=0.05) == 0.0


def test_auto_measures_once_per_folder_and_logs_why(tmp_path, caplog):
    codec = PageCodec(SHAPE, 8, 64)
    with caplog.at_level(logging.INFO, logger="kvstore.codec_share"):
        layers = plan_share("auto", codec, 30, tmp_path)
    assert "decodes in" in caplog.text and f"{len(layers)} of 30 layers coded" in caplog.text
    # the probes' scratch files are gone; the choice stays, so a restart keeps the split
    assert [p.name for p in tmp_path.iterdir()] == [SHARE_FILE]
    kept = json.loads((tmp_path / SHARE_FILE).read_text())
    kept["coded"] = 15
    (tmp_path / SHARE_FILE).write_text(json.dumps(kept))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvstore.codec_share"):
        assert plan_share("auto", codec, 30, tmp_path) == coded_layers(0.5, 30)
    assert "as measured when" in caplog.text and "decodes in" not in caplog.text
    # another codec or model measures again (and keeps its own choice)
    assert len(plan_share("auto", PageCodec(SHAPE, 4, 32), 30, tmp_path)) in range(31)
    (tmp_path / SHARE_FILE).write_text("{torn")
    assert len(plan_share("auto", codec, 30, tmp_path)) in range(31)
    assert plan_share("0.5", codec, 30, tmp_path) == coded_layers(0.5, 30)
    assert plan_share("auto", None, 30, tmp_path) == []


def test_config_refuses_a_share_without_a_coded_disk_tier(tmp_path):
    with pytest.raises(ValueError, match="share"):
        KVStoreConfig(tier_codec_share="0.5", disk_bytes=1 << 30, disk_path=tmp_path)
    with pytest.raises(ValueError, match="share"):
        KVStoreConfig(tier_codec="int8", tier_codec_share="auto", host_bytes=1 << 30)
    with pytest.raises(ValueError, match="auto or a share"):
        KVStoreConfig(tier_codec="int8", tier_codec_share="half", disk_bytes=1 << 30,
                      disk_path=tmp_path)
    KVStoreConfig(tier_codec="int8", tier_codec_share="auto", disk_bytes=1 << 30,
                  disk_path=tmp_path)
    # KV recompute reads K/V pages of one size: refused when the share codes some layers only
    cfg = KVStoreConfig(tier_codec="int8", tier_codec_share="0.5", disk_bytes=1 << 30,
                        disk_path=tmp_path, recompute="auto")
    codec = PageCodec(SHAPE, 8, 64)
    with pytest.raises(ValueError, match="2 of 4 layers.*recompute"):
        backing_geometry(cfg, SHAPE, 4, cfg.budgets("cpu"), codec, torch.device("cpu"), 0,
                         None)
    cfg = dataclasses.replace(cfg, tier_codec_share="0.9")      # rounds to every layer
    coded, plan, max_pages = backing_geometry(cfg, SHAPE, 4, cfg.budgets("cpu"), codec,
                                              torch.device("cpu"), 0, None)
    assert coded == [0, 1, 2, 3] and plan is None and max_pages == (1 << 30) // (4 * 6144)


def make_tier(paths, share=0.5, bits=8) -> DiskLayers:
    return DiskLayers(SHAPE, 1 << 26, paths, LAYERS, MAX_PAGES, PageCodec(SHAPE, bits, 64),
                      coded_layers(share, LAYERS), namespace=b"n" * 16, threads=2)


def layer_keys(pids, layers=range(LAYERS)) -> torch.Tensor:
    return torch.cat([layer * MAX_PAGES + torch.as_tensor(pids) for layer in layers])


@pytest.mark.parametrize("folders", [1, 2])
def test_coded_layers_come_back_decoded_and_the_others_exact(tmp_path, folders):
    paths = [tmp_path / f"d{i}" for i in range(folders)]
    tier = make_tier(paths)
    codec = tier.codec
    try:
        assert tier.layer_lists == ([1, 3], [0, 2])
        tier.register_request(0, 8)
        tier.bind(torch.arange(6), 0, 0)
        keys = layer_keys(range(6))
        x = torch.randn(keys.numel(), *SHAPE.shape).to(SHAPE.dtype)
        tier.put(keys, x)
        out = torch.zeros_like(x)
        tier.get(keys, out)
        for layer in range(LAYERS):
            rows = slice(6 * layer, 6 * layer + 6)
            want = codec.round_trip(x[rows]) if layer in (1, 3) else x[rows]
            assert torch.equal(out[rows], want), layer
        # bytes: the coded layers' pages at their codes' size
        per_layer = 6 * np.array([SHAPE.nbytes_aligned, codec.stride] * 2)
        assert tier.bytes_of(keys) == per_layer.sum() == tier.bytes_written
        assert tier.bytes_of(keys[6:12]) == 6 * codec.stride
        assert torch.equal(tier.keys(), torch.sort(keys).values)
        assert tier.contains(keys).all() and not tier.contains(layer_keys([6])).any()
        assert all(p["bytes_written"] > 0 for p in tier.per_path().values())
        assert len(tier.per_path()) == 2 * folders
        pool = torch.zeros(40, *SHAPE.shape, dtype=SHAPE.dtype)
        slots = torch.randperm(40)[:keys.numel()]
        tier.get_into(keys, pool, slots).result()
        assert torch.equal(pool[slots], out)
        tier.delete(keys[:6])
        with pytest.raises(PageMissing) as exc:
            tier.get(keys[:7], torch.zeros(7, *SHAPE.shape, dtype=SHAPE.dtype))
        assert set(np.asarray(exc.value.keys)) <= set(range(6))
    finally:
        tier.close()


def test_a_corrupt_page_is_named_by_its_own_key(tmp_path):
    tier = make_tier([tmp_path])
    try:
        tier.register_request(0, 8)
        tier.bind(torch.arange(4), 0, 0)
        keys = layer_keys(range(4))
        tier.put(keys, torch.randn(keys.numel(), *SHAPE.shape).to(SHAPE.dtype))
        raw = tmp_path / RAW_FOLDER / "seg-0.kv"       # the raw member: layers 0 and 2
        data = bytearray(raw.read_bytes())
        data[8 * SHAPE.nbytes_aligned + 2 * SHAPE.nbytes_aligned + 7] ^= 1   # layer 2, page 2
        raw.write_bytes(bytes(data))
        with pytest.raises(PageCorrupted) as exc:
            tier.get(keys, torch.zeros(keys.numel(), *SHAPE.shape, dtype=SHAPE.dtype))
        assert list(np.asarray(exc.value.keys)) == [2 * MAX_PAGES + 2]
        assert f"[{2 * MAX_PAGES + 2}]" in str(exc.value)
        # pages absent in either member: all named, before any read
        tier.delete(torch.tensor([0 * MAX_PAGES + 1, 1 * MAX_PAGES + 3]))
        with pytest.raises(PageMissing) as exc:
            tier.get(keys, torch.zeros(keys.numel(), *SHAPE.shape, dtype=SHAPE.dtype))
        assert sorted(np.asarray(exc.value.keys)) == [1, MAX_PAGES + 3]
    finally:
        tier.close()


def test_a_restart_restores_pages_both_members_kept_and_another_share_none(tmp_path):
    tier = make_tier([tmp_path])
    x = torch.randn(4 * LAYERS, *SHAPE.shape).to(SHAPE.dtype)
    tier.register_request(3, 8)
    tier.bind(torch.arange(4), 3, 0)
    tier.put(layer_keys(range(4)), x)
    out = torch.zeros_like(x)
    tier.get(layer_keys(range(4)), out)
    names = [bytes([i]) * 16 for i in range(4)]
    assert tier.record(torch.arange(3), names[:3], [None] * 3).all()
    tier.members[0].record(torch.arange(3, 4), names[3:], [None])      # one member only
    tier.members[0].record(torch.arange(2, 3), [b"x" * 16], [None])    # members disagree
    tier.release_request(3)
    tier.close()

    other = make_tier([tmp_path], share=0.75)        # another layer split: not its pages
    try:
        assert other.restore() == []
    finally:
        other.close()
    again = make_tier([tmp_path])
    try:
        (seg,) = again.restore()
        assert seg.handle == 3 and list(seg.indices) == [0, 1] and seg.keys == names[:2]
        assert seg.crcs.shape == (2, LAYERS)
        again.adopt(seg.handle, [9, 10], seg.indices, seg.crcs, seg.meta)
        again.finish_restore()
        got = torch.zeros(2 * LAYERS, *SHAPE.shape, dtype=SHAPE.dtype)
        again.get(layer_keys([9, 10]), got)
        want = torch.cat([out[4 * layer:4 * layer + 2] for layer in range(LAYERS)])
        assert torch.equal(got, want)
    finally:
        again.close()


@pytest.mark.slow
def test_the_engine_reads_a_share_of_layers_as_codes(smollm2_dir, tmp_path):
    """Every page read back from disk each step: share 0 is the uncoded tier token for token,
    share 0.5 moves the bytes of half the layers coded and keeps int8's tokens."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from server.tokenizer import Tokenizer
    from tests import engine_helpers
    tok = Tokenizer.from_folder(smollm2_dir)
    text = ("The lighthouse keeper wrote in his log every night. " * 12
            + "The secret code is 4921. Remember it. " + "Waves hit the rocks. " * 10)
    prompts = [tok.encode_chat([{"role": "user", "content": text + " What is the code?"}])]

    def run(name, **kw):
        engine = LLMEngine(EngineArgs(model=str(smollm2_dir), page_size=16, kv_device_gb=0.1,
                                      prefix_cache="off", sparse_budget=4096, kv_disk_gb=0.2,
                                      kv_disk_path=tmp_path / name, kv_force_tier="disk", **kw))
        got, errors = engine_helpers.run(engine, prompts, 24)
        assert not errors
        st = engine.store.stats.snapshot()
        engine.store.close()
        return got["r0"], st.transfer_bytes[("disk", "device")] / st.hits["disk"]

    plain, plain_bytes = run("none")
    zero, zero_bytes = run("zero", kv_tier_codec="int8", kv_tier_codec_share="0")
    assert zero == plain and zero_bytes == plain_bytes == 12288
    half, half_bytes = run("half", kv_tier_codec="int8", kv_tier_codec_share="0.5")
    assert half == plain and half_bytes == pytest.approx((12288 + 6144) / 2, rel=0.05)
    assert (tmp_path / "half" / RAW_FOLDER).is_dir()


def test_cache_clear_removes_the_uncoded_layers_files_too(tmp_path):
    from kvstore.cache_files import clear_cache, list_cache
    tier = make_tier([tmp_path])
    tier.register_request(0, 8)
    tier.bind(torch.arange(2), 0, 0)
    tier.put(layer_keys(range(2)), torch.randn(2 * LAYERS, *SHAPE.shape).to(SHAPE.dtype))
    assert tier.record(torch.arange(2), [b"a" * 16, b"b" * 16], [None, None]).all()
    tier.release_request(0)
    tier.close()
    files = lambda d: [p for p in d.iterdir() if p.suffix in (".kv", ".idx")]  # noqa: E731
    assert files(tmp_path) and files(tmp_path / RAW_FOLDER)
    (seg,) = list_cache(tmp_path)          # its bytes in both folders
    assert seg.pages == 2 and seg.disk_bytes >= 2 * (SHAPE.nbytes_aligned + 6144) * 2
    (tmp_path / SHARE_FILE).write_text("{}")
    assert clear_cache(tmp_path) == 5
    assert not files(tmp_path) and not files(tmp_path / RAW_FOLDER)
