"""KVStats: counters of the KV store, read by the engine for /metrics (plain ints, no tensors)."""
from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

TIERS = ("device", "host", "disk")
# strata_sparse_selected_tokens: tokens attended per request, layer and KV head in sparse steps
SELECTED_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# decode-step stages of the KV path (issue 4's pipeline): selection of pages, hit/miss resolution
# against the device tier, fetch of missing pages into device slots, attention compute
STAGES = ("select", "resolve", "fetch", "compute")
# strata_stage_seconds: one observation per stage per micro-batch (per layer when not pipelined)
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5)


@dataclass
class KVStats:
    transfer_bytes: Counter = field(default_factory=Counter)   # (src, dst) -> bytes
    lookups: Counter = field(default_factory=Counter)          # tier -> pages looked up
    hits: Counter = field(default_factory=Counter)             # tier -> pages found there
    evictions: Counter = field(default_factory=Counter)        # tier -> pages evicted
    recomputed: Counter = field(default_factory=Counter)       # tier -> pages rebuilt from inputs
    dense_fallbacks: Counter = field(default_factory=Counter)  # reason -> (request, layer) steps
    selected_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(SELECTED_TOKEN_BUCKETS) + 1))
    selected_sum: int = 0
    selected_count: int = 0
    stage_buckets: dict = field(default_factory=lambda: {
        st: [0] * (len(STAGE_BUCKETS) + 1) for st in STAGES})
    stage_busy: Counter = field(default_factory=Counter)       # stage -> seconds spent working
    stage_stall: Counter = field(default_factory=Counter)      # stage -> seconds waiting on input
    stage_count: Counter = field(default_factory=Counter)      # stage -> observations
    lookahead_hits: int = 0      # exact-selected pages the layer-ahead prediction had fetched
    lookahead_exact: int = 0     # exact-selected pages in layers with a prediction
    window_dropped: int = 0      # sliding-window layer-pages dropped (kvstore/window_trim.py)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_stage(self, stage: str, seconds: float, stall: float = 0.0) -> None:
        """One micro-batch went through `stage` in `seconds` of work, after waiting `stall`
        seconds for the stage before it."""
        with self._lock:
            self.stage_buckets[stage][bisect.bisect_left(STAGE_BUCKETS, seconds)] += 1
            self.stage_busy[stage] += seconds
            self.stage_count[stage] += 1
            if stall > 0:
                self.stage_stall[stage] += stall

    def observe_selected(self, tokens: list[int]) -> None:
        with self._lock:
            for t in tokens:
                self.selected_buckets[bisect.bisect_left(SELECTED_TOKEN_BUCKETS, t)] += 1
            self.selected_sum += sum(tokens)
            self.selected_count += len(tokens)

    def add_busy(self, stage: str, seconds: float) -> None:
        """More work of a micro-batch already observed in `stage`."""
        with self._lock:
            self.stage_busy[stage] += seconds

    def add_stall(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.stage_stall[stage] += seconds

    def count(self, counter: str, tier: str, n: int) -> None:
        """counter in lookups | hits | evictions | recomputed (thread-safe: pipeline stages run on
        threads)."""
        with self._lock:
            getattr(self, counter)[tier] += n

    def observe_lookahead(self, predicted_hits: int, exact: int) -> None:
        """Layer-ahead prefetch: of `exact` pages the exact selection kept, `predicted_hits`
        were among the predicted ones."""
        with self._lock:
            self.lookahead_hits += predicted_hits
            self.lookahead_exact += exact

    def add_window_dropped(self, n: int) -> None:
        with self._lock:
            self.window_dropped += n

    def add_transfer(self, src: str, dst: str, nbytes: int) -> None:
        with self._lock:
            self.transfer_bytes[(src, dst)] += nbytes

    def snapshot(self) -> "KVStatsSnapshot":
        with self._lock:
            return KVStatsSnapshot(dict(self.transfer_bytes), dict(self.lookups), dict(self.hits),
                                   dict(self.evictions), dict(self.dense_fallbacks),
                                   tuple(self.selected_buckets), self.selected_sum,
                                   self.selected_count,
                                   {st: tuple(b) for st, b in self.stage_buckets.items()},
                                   dict(self.stage_busy), dict(self.stage_stall),
                                   dict(self.stage_count), self.lookahead_hits,
                                   self.lookahead_exact, dict(self.recomputed),
                                   self.window_dropped)


@dataclass(frozen=True)
class KVStatsSnapshot:
    transfer_bytes: dict
    lookups: dict
    hits: dict
    evictions: dict
    dense_fallbacks: dict
    selected_buckets: tuple      # non-cumulative counts per SELECTED_TOKEN_BUCKETS bucket
                                 # (+Inf last)
    selected_sum: int
    selected_count: int
    stage_buckets: dict = field(default_factory=dict)   # stage -> non-cumulative bucket counts
    stage_busy: dict = field(default_factory=dict)      # stage -> seconds
    stage_stall: dict = field(default_factory=dict)     # stage -> seconds
    stage_count: dict = field(default_factory=dict)     # stage -> observations
    lookahead_hits: int = 0
    lookahead_exact: int = 0
    recomputed: dict = field(default_factory=dict)     # tier -> pages rebuilt from inputs
    window_dropped: int = 0                            # sliding-window layer-pages dropped
