"""The disk tier over several folders (`--kv-disk-path A,B`, kvstore/tiers/disk_set.py): pages
dealt out over the folders, their I/O split and joined, the request lifecycle and a restart
of the prefix cache through every folder, and the engine's outputs unchanged. (The tier
conformance suite, tests/test_tiers.py, runs on a two-folder set too.)"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.args import EngineArgs, disk_folders
from engine.llm_engine import LLMEngine
from kvstore.tiers.disk_set import DiskSet
from kvstore.tiers.errors import PageMissing, TierFull
from server.cli import main as cli_main
from tests.engine_helpers import run
from tests.test_tiers import MAX_PAGES, NUM_LAYERS, SHAPES, random_pages, same_bits

SHAPE = SHAPES["bf16"]


def make_set(tmp_path, capacity_pages: int = 4 * NUM_LAYERS * MAX_PAGES, n: int = 2) -> DiskSet:
    return DiskSet(SHAPE, capacity_pages * SHAPE.nbytes_aligned,
                   [tmp_path / f"d{i}" for i in range(n)], max_keys=NUM_LAYERS * MAX_PAGES,
                   num_layers=NUM_LAYERS, max_pages=MAX_PAGES, threads=2)


def keys_of(pids, layers=range(NUM_LAYERS)) -> torch.Tensor:
    return torch.tensor([layer * MAX_PAGES + p for layer in layers for p in pids])


def test_a_request_is_dealt_out_page_by_page_over_the_folders(tmp_path):
    tier = make_set(tmp_path)
    pids = list(range(10, 20))
    tier.register_request(7, 12)
    tier.bind(pids, 7, 0)
    keys = keys_of(pids)
    pages = random_pages(SHAPE, keys.numel())
    tier.put(keys, pages)
    out = torch.empty_like(pages)
    order = torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(0))
    tier.get(keys[order], out)
    assert same_bits(out, pages[order])
    # index i in folder i % 2 (its index i // 2 there); each folder wrote and read half
    assert tier.page_indices(np.array(pids)).tolist() == list(range(10))
    assert [m.page_indices(np.array(pids[i::2])).tolist() for i, m in
            enumerate(tier.members)] == [list(range(5)), list(range(5))]
    per = tier.per_path()
    assert [p["bytes_written"] for p in per.values()] == [keys.numel() // 2 * tier.page_bytes] * 2
    assert all(p["bytes_read"] >= keys.numel() // 2 * tier.page_bytes for p in per.values())
    assert all((tmp_path / f"d{i}" / "seg-7.kv").exists() for i in range(2))
    assert tier.num_pages == keys.numel() and bool(tier.contains(keys).all())
    # the pool path: straight into slots, from both folders
    pool = torch.zeros(64, *SHAPE.shape, dtype=SHAPE.dtype)
    slots = torch.arange(keys.numel()).flip(0) + 3
    tier.get_into(keys, pool, slots).result()
    assert same_bits(pool[slots], pages)
    tier.close()


def test_lifecycle_calls_reach_every_folder(tmp_path):
    tier = make_set(tmp_path)
    tier.register_request(1, 9)
    used = tier.used_bytes
    assert used == sum(m.used_bytes for m in tier.members) and used > 0
    tier.skip(1, 3)                        # the first 3 are shared: 2 in folder 0, 1 in 1
    assert tier.used_bytes < used
    tier.bind([40, 41, 42, 43], 1, 3)      # indices 3..6
    assert tier.occupants(1, 3, 4) == [] or set(tier.occupants(1, 3, 4)) <= {40, 41, 42, 43}
    assert tier.page_indices(np.array([40, 41, 42, 43])).tolist() == [3, 4, 5, 6]
    keys = keys_of([40, 41, 42, 43])
    tier.put(keys, random_pages(SHAPE, keys.numel()))
    tier.unbind([41])
    assert not bool(tier.contains(keys_of([41])).any())
    with pytest.raises(PageMissing):
        tier.get(keys_of([41]), torch.empty(NUM_LAYERS, *SHAPE.shape, dtype=SHAPE.dtype))
    tier.release_request(1)
    tier.close()


def test_a_request_too_big_reserves_nothing(tmp_path):
    tier = make_set(tmp_path, capacity_pages=2 * NUM_LAYERS * 4)      # 4 pages a folder
    with pytest.raises(TierFull):
        tier.register_request(1, 9)        # 5 + 4 pages: the first folder cannot
    assert tier.used_bytes == 0
    tier.register_request(2, 8)
    tier.close()


def test_config_refuses_a_folder_twice_and_recompute_over_several(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        DiskSet(SHAPE, 1 << 20, [tmp_path / "a", tmp_path / "a"], NUM_LAYERS * MAX_PAGES,
                NUM_LAYERS, MAX_PAGES)
    assert disk_folders(f"{tmp_path}/a, {tmp_path}/b") == [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(ValueError, match="single --kv-disk-path"):
        EngineArgs(kv_disk_gb=1, kv_disk_path=f"{tmp_path}/a,{tmp_path}/b", kv_recompute="auto")


def _engine(folder, disk_path, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(folder), dtype="auto", page_size=16, kv_device_gb=0.1,
                                kv_disk_gb=0.2, kv_disk_path=disk_path, **kw))


@pytest.fixture(scope="module")
def prompt(smollm2_dir):
    from server.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(smollm2_dir)
    text = "The lighthouse keeper wrote in his log every night. " * 40 + "The code is 4921."
    return tok.encode_chat([{"role": "user", "content": text + " What is the code?"}])


def test_outputs_and_a_restart_through_two_folders(smollm2_dir, prompt, tmp_path):
    """Every page read back from disk each step: the same tokens from one folder or two; the
    prefix cache restarts from both folders, and a set of another shape is another
    namespace (no hit, its files left alone)."""
    one = f"{tmp_path}/one"
    two = f"{tmp_path}/a,{tmp_path}/b"
    got = {}
    for name, path in (("one", one), ("two", two)):
        engine = _engine(smollm2_dir, path, kv_force_tier="disk", sparse_budget=128,
                         prefix_cache="off")
        got[name], errors = run(engine, [prompt], 8)
        assert not errors
        if name == "two":
            per = engine.store.tiers.disk_tier.per_path()
            assert all(p["bytes_read"] > 0 and p["bytes_written"] > 0 for p in per.values())
        engine.store.close()
    assert got["one"] == got["two"]

    def restarted(path):
        engine = _engine(smollm2_dir, path)
        out, errors = run(engine, [prompt], 8)
        assert not errors
        hits = engine.scheduler.prefix_hit_tokens
        engine.store.close()
        return out["r0"], hits

    out, hits = restarted(two)
    assert hits == 0 and out == got["one"]["r0"]
    out, hits = restarted(two)                          # after a restart: from both folders
    assert hits > 0 and out == got["one"]["r0"]
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    _, hits = restarted(f"{tmp_path}/a")               # the first folder alone: no hit
    assert hits == 0 and set(files) <= {p.name for p in (tmp_path / "a").iterdir()}
    # `strata cache clear` clears every folder of the set
    assert cli_main(["cache", "clear", "--kv-disk-path", two]) == 0
    assert not any(p.suffix in (".kv", ".idx") for d in ("a", "b")
                   for p in (tmp_path / d).iterdir())


def test_a_request_as_big_as_the_budget_fits_and_a_refused_bind_binds_nothing(tmp_path):
    pages = 5                                   # per layer: 3 in the first folder, 2 in the other
    tier = make_set(tmp_path, capacity_pages=pages * NUM_LAYERS)
    tier.register_request(1, pages)
    assert tier.used_bytes <= tier.capacity_bytes
    tier.bind([0, 1, 2, 3, 4], 1, 0)
    with pytest.raises(ValueError):
        tier.bind([10, 11, 12], 1, 3)           # indices 3-5: past the request's pages
    assert not bool(tier.contains(keys_of([10, 11, 12])).any())
    tier.unbind([10, 11, 12, 40])               # never bound: ignored, as DiskTier does
    tier.unbind([3, 4])
    tier.bind([10, 11], 1, 3)                   # the freed indices take new pages
    assert tier.page_indices(np.array([10, 11])).tolist() == [3, 4]
    tier.close()


def test_a_read_failing_in_every_folder_names_every_folders_pages(tmp_path):
    import errno

    from kvstore.tiers.disk_fault import DiskFault
    from kvstore.tiers.errors import TierIOError
    tier = make_set(tmp_path)
    tier.register_request(1, 4)
    tier.bind([0, 1, 2, 3], 1, 0)
    keys = keys_of([0, 1, 2, 3], layers=[0])
    tier.put(keys, random_pages(SHAPE, 4))
    tier.fault = DiskFault(read_errno=errno.EIO)
    with pytest.raises(TierIOError) as info:
        tier.get(keys, torch.empty(4, *SHAPE.shape, dtype=SHAPE.dtype))
    assert sorted(info.value.keys.tolist()) == keys.tolist()
    tier.fault = None
    tier.close()
