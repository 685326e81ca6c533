"""1000 requests in a row (finished and aborted) through the tiered store leak no files, file
descriptors, memory or slots. A tiny random-weight Llama keeps it fast."""
from __future__ import annotations

import os
import random


from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_thousand_requests_leak_no_files_memory_or_slots(tiny_folder, tmp_path):
    disk = tmp_path / "kv"
    engine = LLMEngine(EngineArgs(model=str(tiny_folder), dtype="fp32", page_size=8,
                                  kv_device_gb=0.002, kv_host_gb=0.002, kv_host_pool="separate",
                                  kv_disk_gb=0.01,
                                  kv_disk_path=disk, sparse_budget=16, sparse_local_tokens=8,
                                  sparse_sink_tokens=8, dense_layers=1, max_num_seqs=8))
    store = engine.store
    rng = random.Random(0)
    fds_before = rss_before = None
    done = 0
    for wave in range(50):
        ids = []
        for i in range(20):
            rid = f"w{wave}-{i}"
            prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randrange(1, 12),
                                                           temperature=0.0, ignore_eos=True))
            ids.append(rid)
        engine.step()
        for rid in ids[::3]:                     # abort a third of them mid-flight
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        done += len(ids)
        if wave == 9:                            # after warm-up: buffers and pools exist
            fds_before, rss_before = len(os.listdir("/proc/self/fd")), rss_bytes()
    assert done == 1000
    assert not store.request_ids()
    assert store.num_used_pages == 0
    assert store.num_cached_pages > 0          # prompts' full pages stay cached, until
    store.clear_prefix_cache()                 # the cache lets them go: nothing is left
    assert all(used == 0 for used, _ in store.tier_usage().values())
    assert not bool(store.tiers.clean.any())
    assert store.tiers.device_tier.num_free == store.tiers.device_tier.capacity_pages
    assert list(disk.iterdir()) == []
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    assert rss_bytes() - rss_before < 64 * 2**20
