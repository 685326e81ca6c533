"""KV tier bandwidth: disk reads of sparse page selections, and host -> device copies.

    python -m bench.tier_bandwidth --path /tmp/strata-bench --gib 1 --threads 1 8

A file set of ~`--gib` GiB of SmolLM2 bf16 pages (16 tokens x 3 KV heads x 64 x K,V x 2 bytes
= 12288 bytes) for `--requests` requests x 30 layers. One read = one layer of a decode step:
for every request, `--select` pages of that layer (what a sparse selector asks for), either
random, in random runs of 8 adjacent pages, or one contiguous run.
Reported for coalesced extents (<= 1 MiB) and one preadv per page, 1 and 8 I/O threads, into
a plain tensor (O_DIRECT goes through an aligned staging buffer) and in place into host slots.
Every read verifies the XXH64 checksum of each page, as the tier always does.
"""
from __future__ import annotations

import shutil
import time
import sys
from pathlib import Path

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import parser  # noqa: E402
from kvstore.tiers.base import PageShape  # noqa: E402
from kvstore.tiers.device import DeviceTier  # noqa: E402
from kvstore.tiers.disk import DiskTier  # noqa: E402
from kvstore.tiers.host import HostTier  # noqa: E402

SHAPE = PageShape(16, 3, 64, torch.bfloat16)
LAYERS = 30


def build_disk(path: Path, requests: int, cap: int, threads: int, extent: int) -> DiskTier:
    max_pages = requests * cap
    tier = DiskTier(SHAPE, requests * LAYERS * cap * SHAPE.nbytes_aligned, path,
                    max_keys=LAYERS * max_pages, num_layers=LAYERS, max_pages=max_pages,
                    threads=threads, max_extent_bytes=extent)
    for r in range(requests):
        tier.register_request(r, cap)
        tier.bind(torch.arange(r * cap, (r + 1) * cap), r, 0)
    return tier


def fill(tier: DiskTier, requests: int, cap: int) -> float:
    """Write every page (one layer of one request per put); returns GB/s."""
    pages = torch.randn(cap, *SHAPE.shape).to(SHAPE.dtype)
    t0 = time.perf_counter()
    for r in range(requests):
        for layer in range(LAYERS):
            tier.put(layer * requests * cap + r * cap + torch.arange(cap), pages)
    return requests * LAYERS * cap * SHAPE.nbytes / (time.perf_counter() - t0) / 1e9


def selections(pattern: str, requests: int, cap: int, select: int, rounds: int, seed: int = 0):
    """`rounds` batches of keys [requests * select] of one random layer. Per request:
    "random": `select` random pages; "runs8": random runs of 8 adjacent pages;
    "contiguous": one run of `select` adjacent pages (e.g. the local window)."""
    g = torch.Generator().manual_seed(seed)
    run = {"random": 1, "runs8": 8, "contiguous": select}[pattern]
    out = []
    for _ in range(rounds):
        layer = int(torch.randint(LAYERS, (1,), generator=g))
        ids = []
        for r in range(requests):
            starts = torch.randperm(cap // run, generator=g)[:select // run] * run
            ids.append(r * cap + (starts[:, None] + torch.arange(run)).reshape(-1))
        out.append(layer * requests * cap + torch.cat(ids))
    return out


def read_gbps(tier: DiskTier, batches, host: HostTier | None) -> tuple[float, float]:
    """GB/s of page payload read, and preadv calls per batch."""
    calls0, nbytes, t = tier.preadv_calls, 0, 0.0
    for keys in batches:
        if host is not None:
            host.delete(host.keys())
            slots = host.alloc_slots(keys)
            t0 = time.perf_counter()
            tier.get_into(keys, host.pool, slots).result()
        else:
            out = torch.empty(len(keys), *SHAPE.shape, dtype=SHAPE.dtype)
            t0 = time.perf_counter()
            tier.get(keys, out)
        t += time.perf_counter() - t0
        nbytes += len(keys) * SHAPE.nbytes
    return nbytes / t / 1e9, (tier.preadv_calls - calls0) / len(batches)


def host_to_device_gbps(n: int, rounds: int) -> float:
    host = HostTier(SHAPE, n * SHAPE.nbytes, n)
    dev = DeviceTier(SHAPE, n * SHAPE.nbytes, n, "cuda" if torch.cuda.is_available() else "cpu")
    keys = torch.randperm(n)
    host.put(keys, torch.randn(n, *SHAPE.shape).to(SHAPE.dtype))
    hslots = host.slots(keys).long()
    dslots = dev.alloc_slots(keys).long().to(dev.device)
    dev.pool.index_copy_(0, dslots, host.pool.index_select(0, hslots).to(dev.device))  # warm-up
    t0 = time.perf_counter()
    for _ in range(rounds):
        dev.pool.index_copy_(0, dslots, host.pool.index_select(0, hslots).to(dev.device))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return rounds * n * SHAPE.nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--path", type=Path, default=Path("/tmp/strata-tier-bench"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--select", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    cap = int(args.gib * 2**30 // (args.requests * LAYERS * SHAPE.nbytes_aligned))
    print(f"file set: {args.requests} requests x {LAYERS} layers x {cap} pages x "
          f"{SHAPE.nbytes} B = {args.requests * LAYERS * cap * SHAPE.nbytes / 2**30:.2f} GiB; "
          f"read batch = {args.requests} requests x {args.select} pages of one layer "
          f"({args.requests * args.select * SHAPE.nbytes / 2**20:.1f} MiB)")
    patterns = ("random", "runs8", "contiguous")
    batches = {p: selections(p, args.requests, cap, args.select, args.rounds) for p in patterns}
    host = HostTier(SHAPE, args.requests * args.select * SHAPE.nbytes, LAYERS * args.requests * cap)
    try:
        for threads in args.threads:
            for mode, extent in (("coalesced", 1 << 20), ("per-page", SHAPE.nbytes_aligned)):
                shutil.rmtree(args.path, ignore_errors=True)
                tier = build_disk(args.path, args.requests, cap, threads, extent)
                wr = fill(tier, args.requests, cap)
                print(f"threads={threads} {mode} O_DIRECT={tier.direct_io}: "
                      f"fill (write) {wr:.2f} GB/s")
                for p in patterns:
                    plain, calls = read_gbps(tier, batches[p], None)
                    inplace, _ = read_gbps(tier, batches[p], host)
                    print(f"  {p:10s} read {plain:.2f} GB/s into tensor, {inplace:.2f} GB/s "
                          f"into host slots, {calls:.0f} preadv/batch")
                tier.close()
    finally:
        shutil.rmtree(args.path, ignore_errors=True)
    print(f"host -> device copy ({'cuda' if torch.cuda.is_available() else 'cpu RAM pool'}, "
          f"512 random pages): {host_to_device_gbps(512, 50):.2f} GB/s")


if __name__ == "__main__":
    main()
