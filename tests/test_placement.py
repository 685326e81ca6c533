"""Placement after prefill (--kv-placement recency | mass, kvstore/placement.py) on the real
model: which of a prompt's pages the device tier gives up first, and that placement changes
where pages are, never the output."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams

LAYERS, DENSE = 30, 2


def prefilled(smollm2_dir, tmp_path, placement: str):
    """One ~450-token prompt, prefilled; the device tier holds it all, and the request's quota
    (capacity / max_num_seqs per layer) is about half of its pages."""
    from server.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(smollm2_dir)
    text = "Notes about a lighthouse keeper. " * 40 + "The code is 4921. " + "More. " * 20
    ids = tok.encode_chat([{"role": "user", "content": text + " What is the code?"}])
    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), dtype="auto", page_size=16,
                                  kv_device_gb=0.05, max_num_seqs=8, sparse_budget=128,
                                  sparse_local_tokens=32, prefix_cache="off",
                                  kv_disk_gb=0.2, kv_disk_path=tmp_path / "kv",
                                  kv_placement=placement))
    engine.add_request("r", ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    while not tokens:
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    return engine, tokens


def aged(engine) -> torch.Tensor:
    """bool [layers, pages]: the request's pages placement made the first to evict."""
    store = engine.store
    pages = torch.tensor(store._allocator.pages("r"), dtype=torch.int64)
    keys = store.tiers.keys_of(pages)
    slots = store.tiers.device_tier.slots(keys)
    assert bool((slots >= 0).all())                 # all resident: only their order differs
    return (store.tiers.residency.last_used[slots.long()] < 0).view(LAYERS, -1)


@pytest.mark.parametrize("placement", ["recency", "mass"])
def test_placement_ages_the_pages_decode_needs_least(smollm2_dir, tmp_path, placement):
    engine, _ = prefilled(smollm2_dir, tmp_path, placement)
    cold = aged(engine)
    n = cold.shape[1]
    quota = engine.store.tiers.device_tier.capacity_pages // (8 * LAYERS)
    assert 0 < quota < n
    assert int((~cold).sum()) == quota * LAYERS     # a quota of pages a layer, in total
    cfg = engine.store.cfg
    sink, local = cfg.sink_pages, cfg.local_pages
    if placement == "recency":                      # per layer: sinks, then the newest
        want = torch.ones(n, dtype=torch.bool)
        want[:sink] = False
        want[n - (quota - sink):] = False
        assert bool((cold == want).all())
        return
    # mass: every page decode certainly reads is kept (dense layers, sinks, local pages) ...
    assert not bool(cold[:DENSE].any())
    assert not bool(cold[:, :sink].any()) and not bool(cold[:, n - local:].any())
    # ... and of the rest, the heaviest by the observation window's mass, across layers
    prior = engine.store.request("r").prior[:, :n].float().sum(-1)
    free = torch.ones(LAYERS, n, dtype=torch.bool)
    free[:DENSE] = False
    free[:, :sink] = False
    free[:, n - local:] = False
    kept, gone = prior[free & ~cold], prior[free & cold]
    assert kept.numel() and gone.numel()
    assert float(kept.min()) >= float(gone.max())
    # the per-layer split follows the mass: layers differ in how many pages they keep
    per_layer = (~cold[DENSE:]).sum(1)
    assert int(per_layer.max()) > int(per_layer.min())


def test_placement_changes_no_output(smollm2_dir, tmp_path):
    """Greedy tokens with a device tier too small for the working set (every step evicts and
    reads back from disk) are the same whichever pages placement kept."""
    out = {}
    for placement in ("recency", "mass"):
        engine, tokens = prefilled(smollm2_dir, tmp_path / placement, placement)
        engine.store.reconfigure(force_tier="disk")         # every page from disk from now on
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        out[placement] = tokens
    assert len(out["recency"]) == 8 and out["recency"] == out["mass"]
