"""KVStoreConfig: tier budgets and sparse-decode settings, chosen once at start-up."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FORCE_TIERS = ("none", "host", "disk")
HEAD_PAGES = ("per-head", "union")
PIPELINES = ("sequential", "sfc", "layer-ahead")
RESIDENCY_POLICIES = ("cycle", "lru", "score")       # kvstore/residency.py
PLACEMENTS = ("recency", "mass")            # kvstore/placement.py
OBS_REDUCE = ("sum", "max")
SELECTORS = ("quest", "mean", "lowrank", "centroid")   # kernels/page_select.py,
                                                       # kvstore/centroids.py
TIER_CODECS = ("none", "int8", "int4")      # kvstore/tiers/codec.py


def parse_share(value: str) -> float | None:
    """`auto` -> None; a number in [0, 1] -> it; else ValueError."""
    if value == "auto":
        return None
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--kv-tier-codec-share must be auto or a share in [0, 1], "
                         f"got {value!r}")
    return share


@dataclass(frozen=True)
class KVStoreConfig:
    page_size: int = 16
    device_bytes: int = 1 << 30          # --kv-device-gb: the pool attention reads from
    host_bytes: int = 0                  # --kv-host-gb: DRAM cache below the device
    # on a CPU the device and host tiers are the same DRAM: one pool attention reads in place
    # (False: a separate host pool, the GPU-shaped three tiers, for tests)
    merge_host: bool = True
    disk_bytes: int = 0                  # --kv-disk-gb: files under disk_path (the backing store)
    disk_path: Path | None = None        # --kv-disk-path (its first folder)
    disk_paths: tuple[Path, ...] = ()    # --kv-disk-path A,B,...: every folder, pages striped
                                         # (disk_set.py)
    disk_threads: int = 8
    sparse_budget: int = 0               # --sparse-budget tokens per request/layer/KV head;
                                         # 0: dense
    # --sparse-threshold: a decode attends sparsely once its context is past this many tokens
    # (and the budget); 0: twice the budget (below that, selecting costs more than it skips)
    sparse_threshold: int = 0
    # --sparse-budget-plan: tokens per [layer][KV head] (kvstore/budget_plan.py); (): uniform
    budget_plan: tuple[tuple[int, ...], ...] = ()
    sink_tokens: int = 16                # --sparse-sink-tokens: first tokens always attended
    local_tokens: int = 64               # --sparse-local-tokens: last tokens always attended
    dense_layers: int = 2                # --dense-layers: the first layers always run dense
    selector: str = "quest"              # --selector: quest | mean | lowrank
    lowrank_rank: int = 16               # --lowrank-rank: dims of the projected keys (lowrank)
    centroid_pages: int = 2              # --centroid-pages: pages per k-means centroid (centroid)
    obs_window: int = 32                 # --sparse-obs-window: last prompt tokens whose attention
                                         # ranks pages at prefill; 0: off
    obs_reduce: str = "max"              # --sparse-obs-reduce: sum | max over the window's queries
                                         # and a group's heads
    prior_share: float = 0.25            # --sparse-prior-share: part of the selected pages kept for
                                         # the prompt's top pages
    head_pages: str = "per-head"         # --sparse-head-pages: each KV head attends its own pages,
                                         # or the union
    residency: str = "score"             # --residency: cycle | lru | score (device and host tiers)
    placement: str = "recency"           # --kv-placement: recency | mass (which prompt pages stay
                                         # in DRAM after prefill)
    max_num_seqs: int = 16               # for per-request placement quotas
    pipeline: str = "sequential"         # --pipeline: sequential | sfc | layer-ahead
    micro_batch: int = 0                 # --micro-batch: sequences per SFC micro-batch;
                                         # 0: calibrate
    prefix_cache: bool = True            # --prefix-cache: reuse the KV of full pages of earlier
                                         # prompts
    swa_full: bool = False               # --swa-full: keep a sliding-window layer's pages before
                                         # its window (kvstore/window_trim.py)
    max_step_tokens: int = 2048          # --max-num-batched-tokens: the pages a windowed layer
                                         # holds at most (a window and a step's)
    force_tier: str = "none"             # --kv-force-tier: after every step, evict down to this
                                         # tier (tests, diagnostics)
    tier_codec: str = "none"             # --kv-tier-codec: pages on disk as 8- or 4-bit codes
    tier_codec_group: int = 0            # --kv-tier-codec-group: channels per scale (0: 64 for
                                         # int8, 32 for int4)
    tier_codec_share: str = "1"          # --kv-tier-codec-share: auto | the share of layers the
                                         # disk tier codes
    recompute: str = "off"               # --kv-recompute: off | auto | a share of each fill's disk
                                         # pages (KVPR)
    # fills into a device pool that is not host memory: "auto" a CUDA copy stream on a GPU
    # (in place on a CPU); "thread" its CPU stand-in (kvstore/tiers/transfers.py; tests)
    copy_stream: str = "auto"

    def __post_init__(self):
        if self.device_bytes <= 0:
            raise ValueError("--kv-device-gb must be > 0")
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("--kv-host-gb and --kv-disk-gb must be >= 0")
        if self.disk_paths and (len(self.disk_paths) < 2 or self.disk_paths[0] != self.disk_path):
            raise ValueError("disk_paths lists every folder of a disk set, disk_path first")
        if self.disk_paths and self.recompute != "off":
            raise ValueError("--kv-recompute keeps the pages' layer inputs beside them in one "
                             "folder: it takes a single --kv-disk-path")
        if self.disk_bytes > 0 and self.disk_path is None:
            raise ValueError("--kv-disk-gb needs --kv-disk-path")
        if self.sparse_budget < 0:
            raise ValueError("--sparse-budget must be >= 0 (0 means dense)")
        if self.sparse_threshold < 0:
            raise ValueError("--sparse-threshold must be >= 0 (0: twice --sparse-budget)")
        if self.budget_plan and (self.sparse_budget == 0
                                 or min(min(b) for b in self.budget_plan) < 1):
            raise ValueError("--sparse-budget-plan needs a sparse budget and positive budgets")
        if self.force_tier not in FORCE_TIERS:
            raise ValueError(f"--kv-force-tier must be one of {FORCE_TIERS}")
        if self.force_tier == "host" and self.host_bytes == 0 and self.disk_bytes == 0:
            raise ValueError("--kv-force-tier host needs --kv-host-gb > 0 (or a disk tier)")
        if self.force_tier == "disk" and self.disk_bytes == 0:
            raise ValueError("--kv-force-tier disk needs --kv-disk-gb > 0")
        if self.head_pages not in HEAD_PAGES:
            raise ValueError(f"--sparse-head-pages must be one of {HEAD_PAGES}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"--pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        if self.micro_batch < 0:
            raise ValueError(f"--micro-batch must be >= 0 (0: calibrate), got {self.micro_batch}")
        if self.obs_window < 0:
            raise ValueError(f"--sparse-obs-window must be >= 0 (0: off), got {self.obs_window}")
        if self.obs_reduce not in OBS_REDUCE:
            raise ValueError(f"--sparse-obs-reduce must be sum or max, got {self.obs_reduce!r}")
        if not 0.0 <= self.prior_share <= 1.0:
            raise ValueError(f"--sparse-prior-share must be in [0, 1], got {self.prior_share}")
        if self.selector not in SELECTORS:
            raise ValueError(f"--selector must be one of {', '.join(SELECTORS)}, "
                             f"got {self.selector!r}")
        if self.lowrank_rank < 1:
            raise ValueError(f"--lowrank-rank must be >= 1, got {self.lowrank_rank}")
        if self.centroid_pages < 1:
            raise ValueError(f"--centroid-pages must be >= 1, got {self.centroid_pages}")
        if self.tier_codec not in TIER_CODECS:
            raise ValueError(f"--kv-tier-codec must be one of {', '.join(TIER_CODECS)}, "
                             f"got {self.tier_codec!r}")
        if self.tier_codec != "none" and self.disk_bytes == 0 and self.host_bytes == 0:
            raise ValueError("--kv-tier-codec encodes the host and disk tiers' pages: it needs "
                             "--kv-disk-gb or --kv-host-gb > 0")
        share = parse_share(self.tier_codec_share)
        if share != 1.0 and (self.tier_codec == "none" or self.disk_bytes == 0):
            raise ValueError("--kv-tier-codec-share is the share of the disk tier's layers "
                             "stored as codes: it needs --kv-tier-codec int8|int4 and "
                             "--kv-disk-gb > 0")
        if self.tier_codec_group not in (0, 32, 64):
            raise ValueError(f"--kv-tier-codec-group must be 32 or 64 (0: by codec), got "
                             f"{self.tier_codec_group}")
        if self.recompute not in ("auto", "off"):
            try:
                share = float(self.recompute)
            except ValueError:
                share = -1.0
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"--kv-recompute must be auto, off or a share in [0, 1], got "
                                 f"{self.recompute!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--kv-placement must be one of {', '.join(PLACEMENTS)}, "
                             f"got {self.placement!r}")
        if self.residency not in RESIDENCY_POLICIES:
            raise ValueError(f"--residency must be one of {', '.join(RESIDENCY_POLICIES)}, "
                             f"got {self.residency!r}")

    @property
    def backing(self) -> str:
        """The lowest tier with a budget: it holds every full page; faster tiers cache."""
        return "disk" if self.disk_bytes else ("host" if self.host_bytes else "device")

    def budgets(self, device_type: str) -> dict[str, int]:
        """Bytes per tier as built on `device_type`: on a CPU (with merge_host) the host budget
        joins the device pool, the same DRAM."""
        if self.merge_host and device_type == "cpu":
            return {"device": self.device_bytes + self.host_bytes, "host": 0,
                    "disk": self.disk_bytes}
        return {"device": self.device_bytes, "host": self.host_bytes, "disk": self.disk_bytes}

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    @property
    def budget_pages(self) -> int:
        return self.pages(self.sparse_budget)

    @property
    def sparse_from_pages(self) -> int:
        """Decodes of more pages than this attend sparsely (`sparse_threshold`, at least the
        budget; 0 where decode is dense)."""
        if self.sparse_budget <= 0:
            return 0
        return max(self.budget_pages, self.pages(self.sparse_threshold or 2 * self.sparse_budget))

    @property
    def sink_pages(self) -> int:
        return self.pages(self.sink_tokens)

    def check_plan(self, num_layers: int, num_kv_heads: int) -> None:
        """A budget plan must be the model's shape."""
        if self.budget_plan and (len(self.budget_plan), len(self.budget_plan[0])) != \
                (num_layers, num_kv_heads):
            raise ValueError(f"--sparse-budget-plan is for {len(self.budget_plan)} layers x "
                             f"{len(self.budget_plan[0])} KV heads, the model has {num_layers} "
                             f"x {num_kv_heads}: run `strata profile` for it")

    def head_budget_pages(self, layer: int) -> list[int] | None:
        """The plan's budget of each KV head in `layer`, in pages; None without a plan."""
        if not self.budget_plan:
            return None
        return [self.pages(b) for b in self.budget_plan[layer]]

    def head_prior_pages(self, budget_pages: int) -> int:
        """prior_pages for a head whose budget is budget_pages."""
        if self.obs_window == 0:
            return 0
        free = max(0, budget_pages - self.sink_pages - self.local_pages)
        return int(round(self.prior_share * free))

    @property
    def prior_pages(self) -> int:
        """Pages per (request, layer, KV head) picked by the prompt's observation window: a
        share of what the budget leaves after the sink and local pages."""
        return self.head_prior_pages(self.budget_pages)

    @property
    def local_pages(self) -> int:
        # NOTE: at least one, even for --sparse-local-tokens 0: a sequence's partial last
        # page is always selected, so StepKV.summarize leaves it unsummarized until it fills
        return max(1, self.pages(self.local_tokens))
