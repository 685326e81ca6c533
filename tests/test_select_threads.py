"""The C page selection's threads: in sequential mode the decode attention's (it runs on that
pool, between the attention's calls), in pipelined modes one (stage threads select while the
engine thread's attention has the pool)."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from kernels.select_plan import SelectPlan
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pipeline", ["sequential", "sfc"])
def test_selection_threads_follow_the_pipeline_mode(smollm2_dir, monkeypatch, pipeline):
    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), kv_device_gb=0.1, page_size=16,
                                  prefix_cache="off", sparse_budget=64, sparse_sink_tokens=16,
                                  sparse_local_tokens=16, pipeline=pipeline, micro_batch=1))
    if pipeline == "sequential":
        engine.use_threads(2, 1)
    else:       # the decode count, 2 (a bigger machine's), is the attention's there too
        engine.use_threads(3, 2)
    selector = engine.store.selection.selector
    seen = []
    original = selector.select

    def spy(*args, threads=1, **kwargs):
        seen.append((threads, engine.store.attention_threads))
        return original(*args, threads=threads, **kwargs)

    selector.select = spy
    build = SelectPlan.build.__func__       # a resident step's selection, prepared a step

    def spy_plan(cls, *args, threads=1, **kwargs):
        seen.append((threads, engine.store.attention_threads))
        return build(cls, *args, threads=threads, **kwargs)

    monkeypatch.setattr(SelectPlan, "build", classmethod(spy_plan))
    gen = torch.Generator().manual_seed(3)
    for i in range(2):
        engine.add_request(f"r{i}", torch.randint(100, 40000, (300,), generator=gen).tolist(),
                           SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert seen
    if pipeline == "sequential":
        assert all(t == a >= 1 for t, a in seen) and any(t == 2 for t, _ in seen)
    else:
        assert set(seen) == {(1, 2)}
