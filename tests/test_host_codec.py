"""The KV tier codec in the host tier (kvstore/tiers/host.py): a slot holds a page's codes and
meta, encoded as pages enter the tier and decoded where they leave it, bit for bit the codec's
round trip; the same DRAM holds ~1.9x (int8) the pages."""
from __future__ import annotations

import pytest
import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.codec import PageCodec
from kvstore.tiers.errors import PageMissing
from kvstore.tiers.host import HostTier

SHAPE = PageShape(page_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *SHAPE.shape, generator=g).to(SHAPE.dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_pages_in_a_coded_host_tier_come_back_as_the_codecs_round_trip(bits):
    codec = PageCodec.from_name(f"int{bits}", SHAPE)
    budget = 64 * SHAPE.nbytes
    host = HostTier(SHAPE, budget, 512, pin_memory=False, codec=codec)
    plain = HostTier(SHAPE, budget, 512, pin_memory=False)
    assert host.page_bytes == codec.code_bytes + codec.meta_bytes
    assert host.capacity_pages == budget // host.page_bytes > 1.8 * plain.capacity_pages
    x = _pages(10)
    keys = torch.arange(10) * 7
    host.put(keys, x)
    out = torch.empty_like(x)
    host.get(keys.flip(0), out)
    assert torch.equal(out, codec.round_trip(x).flip(0))
    # slot to slot, as fills and demotions move pages between the device pool and this tier
    device_pool = _pages(20, seed=1)
    host.store_from(device_pool, torch.tensor([3, 17, 5]), torch.tensor([40, 41, 2]))
    back = torch.zeros(8, *SHAPE.shape, dtype=SHAPE.dtype)
    host.load_into(back, torch.tensor([6, 0, 1]), torch.tensor([40, 41, 2]))
    assert torch.equal(back[[6, 0, 1]], codec.round_trip(device_pool[[3, 17, 5]]))
    assert not bool(back[2:6].any())                           # nothing else written
    with pytest.raises(IndexError, match="host tier slots"):
        host.load_into(back, torch.tensor([0]), torch.tensor([host.num_slots]))
    with pytest.raises(IndexError, match="page slots"):
        host.store_from(device_pool, torch.tensor([20]), torch.tensor([0]))
    with pytest.raises(PageMissing):
        host.get(torch.tensor([1]), out[:1])


@pytest.mark.slow
def test_the_engine_decodes_from_a_coded_host_tier(smollm2_dir, tmp_path):
    """Every page evicted to the host tier after each step, read back as int8 codes: the
    greedy tokens of the exact KV; a host page moves ~1.9x fewer bytes."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests import engine_helpers
    from tests.engine_helpers import code_prompt
    prompts = [code_prompt(smollm2_dir)]

    def run(**kw):
        engine = LLMEngine(EngineArgs(model=str(smollm2_dir), page_size=16, kv_device_gb=0.05,
                                      kv_host_gb=0.1, kv_host_pool="separate",
                                      kv_force_tier="host", prefix_cache="off",
                                      sparse_budget=4096, **kw))
        got, errors = engine_helpers.run(engine, prompts, 24)
        assert not errors
        st = engine.store.stats.snapshot()
        assert st.hits.get("host", 0) > 0
        return got["r0"], st.transfer_bytes[("host", "device")] / st.hits["host"]

    exact, plain = run()
    got, coded = run(kv_tier_codec="int8")
    assert got == exact
    assert plain == SHAPE.nbytes and coded == 6144 + 384
