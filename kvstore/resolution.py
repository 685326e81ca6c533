"""Resolution: where each page a micro-batch needs is, between `Fetcher.resolve` (which decides
it) and `Fetcher.fill` (which moves the data); the pipeline's stages hand it over."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

NONE = torch.empty(0, dtype=torch.int64)     # no keys, no slots


@dataclass
class Resolution:
    """Where each page a micro-batch needs is, decided by `Fetcher.resolve`: every key has a
    device slot (hits keep theirs, misses got a reserved one); misses are filled from the host
    tier (host_src -> host_dst) or from disk (disk_keys -> disk_dst) by `Fetcher.fill`; with
    KV recompute, some disk pages are rebuilt from their layer inputs instead (input_keys ->
    input_dst, kvstore/recompute.py)."""
    slots: torch.Tensor                  # int32 [n] device slot of each key
    host_src: torch.Tensor               # int64 host slots to copy from (pinned until filled)
    host_dst: torch.Tensor               # int64 device slots they go to
    disk_keys: torch.Tensor              # int64 keys to read from disk
    disk_dst: torch.Tensor               # int64 device slots they go to
    counted: bool = True                 # lookups/hits counted (not for speculative prefetch)
    reads: Future | None = None          # the disk reads, once issued (`Fetcher.start_reads`)
    keys: torch.Tensor | None = None     # the keys resolved (slots[i] holds keys[i])
    input_keys: torch.Tensor = field(default_factory=lambda: NONE)   # recomputed disk pages
    input_dst: torch.Tensor = field(default_factory=lambda: NONE)
    inputs: tuple[Future, torch.Tensor] | None = None    # their inputs' read, once issued
    # a device pool behind a copy stream (kvstore/tiers/transfers.py): the compute-stream
    # event the fill's copies wait for (`mark` at resolve), and the fill's last copy event
    after: object = None
    ready: object = None
    staged: torch.Tensor | None = None   # the staging buffer its disk reads land in

    @property
    def misses(self) -> int:
        return self.host_src.numel() + self.disk_keys.numel() + self.input_keys.numel()

    @property
    def disk_slots(self) -> torch.Tensor:
        """The device slots filled from disk (read or recomputed)."""
        return torch.cat([self.disk_dst, self.input_dst])

    def fills(self, slots: torch.Tensor) -> torch.Tensor:
        """bool per device slot of `slots`: whether this resolution's fill writes it (a miss)."""
        return torch.isin(slots.long(), torch.cat([self.host_dst, self.disk_slots]))
