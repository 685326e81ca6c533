"""Cost of one device eviction pass (victims, demotion with host admission, both slot maps):
the torch pass against the C one (kvstore/_evict.c), at bench/pipeline.py's tier sizes.

    .venv/bin/python bench/evict_pass.py

A real TieredKVStore (SmolLM2's page: 16 tokens x 3 KV heads x 64 dims, bf16) with every
device and host slot taken, mostly clean pages, a few pinned, the host holding a third of the
device's pages too, stamps spread over two steps of layer clocks (so live and stale pages); each
pass evicts `--want` pages (the batch `Fetcher._make_room` evicts: capacity / 32) outside
`--protect` pages of the layer computing. The state is restored between passes (untimed).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import parser  # noqa: E402
from kvstore.config import KVStoreConfig  # noqa: E402 - after the path above
from kvstore.fetcher import Fetcher  # noqa: E402
from kvstore.store import TieredKVStore  # noqa: E402

LAYERS = 30


def make_store(args, root: Path) -> TieredKVStore:
    cfg = KVStoreConfig(page_size=16, device_bytes=int(args.kv_device_gb * 2**30),
                        host_bytes=int(args.kv_host_gb * 2**30), disk_bytes=4 << 30,
                        merge_host=False, disk_path=root, residency=args.residency)
    store = TieredKVStore(cfg, LAYERS, 3, 64, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    dev, host = store.tiers.device_tier, store.tiers.host_tier
    keys = torch.randperm(store.tiers.clean.numel(), generator=g)
    dev.alloc_slots(keys[:dev.num_slots])
    both = dev.num_slots // 3
    host.alloc_slots(torch.cat([keys[:both], keys[dev.num_slots:dev.num_slots + host.num_slots
                                                   - both]]))
    store.tiers.clean[:] = torch.rand(store.tiers.clean.numel(), generator=g) < 0.95
    now = 50 * LAYERS
    store.tiers.clock_now = now
    for pol, n in ((store.tiers.residency, dev.num_slots),
                   (store.tiers.host_residency, host.num_slots)):
        pol.last_used[:] = now - torch.randint(0, 2 * LAYERS, (n,), generator=g)
    store.tiers.device_pinned[:] = torch.rand(dev.num_slots, generator=g) < 0.02
    return store


def snapshot(store: TieredKVStore) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tensors = []
    for tier in (store.tiers.device_tier, store.tiers.host_tier):
        tensors += [tier._slot_of, tier._key_of, tier._free]
    tensors += [store.tiers.residency.last_used, store.tiers.host_residency.last_used]
    return [(t, t.clone()) for t in tensors]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--kv-device-gb", type=float, default=0.064)
    ap.add_argument("--kv-host-gb", type=float, default=0.256)
    ap.add_argument("--residency", default="cycle")
    ap.add_argument("--want", type=int, default=0, help="pages a pass evicts (0: capacity/32)")
    ap.add_argument("--protect", type=int, default=1100, help="pages of the computing layer")
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(args, Path(tmp))
        dev = store.tiers.device_tier
        want = args.want or dev.num_slots // 32
        protect = dev.keys()[torch.randperm(dev.num_pages)[:args.protect]]
        saved = snapshot(store)
        free = (dev.num_free, store.tiers.host_tier.num_free)
        results = {}
        for native in (False, True, False, True):
            fetcher = Fetcher(store.tiers)
            fetcher.native = native
            times = []
            for _ in range(args.repeats):
                for t, copy in saved:
                    t.copy_(copy)
                dev.set_num_free(free[0])
                store.tiers.host_tier.set_num_free(free[1])
                store.tiers.demotions.clear()
                t0 = time.perf_counter()
                fetcher._evict(want, protect)
                times.append(time.perf_counter() - t0)
            results.setdefault(native, []).extend(times)
    print(f"device {dev.num_slots} slots, host {store.tiers.host_tier.num_slots} slots, "
          f"{args.residency}; a pass evicts {want} pages outside {args.protect} protected")
    for native, name in ((False, "torch (Fetcher._evictable, victims, evict_device)"),
                         (True, "C (kvstore/_evict.c)")):
        print(f"  {name:<52} median {1e3 * statistics.median(results[native]):6.3f} ms")
    print(f"  ratio {statistics.median(results[False]) / statistics.median(results[True]):.1f}x")


if __name__ == "__main__":
    main()
