"""KVStats: counters of the KV store, read by the engine for /metrics (plain ints, no tensors)."""
from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

TIERS = ("device", "host", "disk")
# strata_sparse_selected_tokens: tokens attended per request, layer and KV head in sparse steps
SELECTED_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class KVStats:
    transfer_bytes: Counter = field(default_factory=Counter)   # (src, dst) -> bytes
    lookups: Counter = field(default_factory=Counter)          # tier -> pages looked up
    hits: Counter = field(default_factory=Counter)             # tier -> pages found there
    evictions: Counter = field(default_factory=Counter)        # tier -> pages evicted
    dense_fallbacks: Counter = field(default_factory=Counter)  # reason -> (request, layer) steps
    selected_buckets: list[int] = field(default_factory=lambda: [0] * (len(SELECTED_TOKEN_BUCKETS) + 1))
    selected_sum: int = 0
    selected_count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_selected(self, tokens: list[int]) -> None:
        with self._lock:
            for t in tokens:
                self.selected_buckets[bisect.bisect_left(SELECTED_TOKEN_BUCKETS, t)] += 1
            self.selected_sum += sum(tokens)
            self.selected_count += len(tokens)

    def add_transfer(self, src: str, dst: str, nbytes: int) -> None:
        with self._lock:
            self.transfer_bytes[(src, dst)] += nbytes

    def snapshot(self) -> "KVStatsSnapshot":
        with self._lock:
            return KVStatsSnapshot(dict(self.transfer_bytes), dict(self.lookups), dict(self.hits),
                                   dict(self.evictions), dict(self.dense_fallbacks),
                                   tuple(self.selected_buckets), self.selected_sum,
                                   self.selected_count)


@dataclass(frozen=True)
class KVStatsSnapshot:
    transfer_bytes: dict
    lookups: dict
    hits: dict
    evictions: dict
    dense_fallbacks: dict
    selected_buckets: tuple      # non-cumulative counts per SELECTED_TOKEN_BUCKETS bucket (+Inf last)
    selected_sum: int
    selected_count: int
