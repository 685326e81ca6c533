"""EngineArgs: every engine setting, chosen once at start-up (CLI flags map onto these fields)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.config import KVStoreConfig

DTYPES = ("auto", "bf16", "fp32")
WEIGHTS = ("auto", "native", "fp32", "bf16", "int8", "int4")  # kernels.packed_linear.FORMATS
BUNDLED_ALIAS = "bundled"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_served_name(model: str | None) -> str:
    """The API model id for --model: the bundled name, else the folder or .gguf file stem."""
    if model is None or model == BUNDLED_ALIAS:
        return BUNDLED_MODEL_NAME
    path = Path(str(model).rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def default_cache_dir() -> Path:
    return Path(os.environ.get("STRATA_CACHE_DIR", Path.home() / ".cache" / "strata" / "models"))


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None              # HF folder or .gguf file; None: the bundled SmolLM2 GGUF
    served_model_name: str | None = None  # id at /v1/models; default: derived from the model
    dtype: str = "auto"                   # activations, prefill weights (and KV unless auto)
    weights: str = "auto"                 # decode weight format (engine.weight_plan)
    page_size: int = 16                   # tokens per KV page
    max_model_len: int | None = None      # prompt + completion; default: the model's positions
    max_num_seqs: int = 16                # running requests at most
    max_num_batched_tokens: int = 2048    # per-step token budget (chunked prefill)
    max_waiting: int = 256                # queued requests at most (429 beyond)
    kv_device_gb: float = 1.0             # KV pool in device memory (a RAM pool on CPU)
    kv_host_gb: float = 0.0               # DRAM tier below the device (0: none)
    kv_disk_gb: float = 0.0               # disk tier, the backing store when set (0: none)
    kv_disk_path: Path | None = None      # where the disk tier's files go
    sparse_budget: int = 0                # tokens attended per request/layer/KV head; 0: dense
    sparse_sink_tokens: int = 16          # first tokens always attended in sparse decode
    sparse_local_tokens: int = 64         # last tokens always attended in sparse decode
    dense_layers: int = 2                 # the first layers always run dense
    selector: str = "quest"               # page selector: quest | mean
    sparse_head_pages: str = "per-head"   # per-head | union: which selected pages each KV head attends
    sparse_obs_window: int = 32           # last prompt tokens whose attention ranks pages at prefill; 0: off
    sparse_obs_reduce: str = "max"        # sum | max: how the window's queries and a group's heads combine
    sparse_prior_share: float = 0.25      # share of the selected pages kept for the prompt's top pages
    pipeline: str = "sequential"          # sparse decode stages: sequential | sfc | layer-ahead
    residency: str = "cycle"              # which pages the device and host tiers evict: cycle | lru
    micro_batch: int = 0                  # sequences per SFC micro-batch; 0: calibrate
    kv_force_tier: str = "none"           # tests/diagnostics: evict down to host or disk every step
    threads: int = 0                      # torch intra-op threads; 0: all cores
    decode_threads: int = 0               # torch threads of decode-only steps; 0: see torch_threads
    cache_dir: Path | None = None         # converted-model cache; default STRATA_CACHE_DIR or ~/.cache/strata/models
    device: str = "cpu"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"--weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--page-size must be a power of two, got {self.page_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_waiting < 0:
            raise ValueError("--max-waiting must be >= 0")
        if self.kv_device_gb <= 0:
            raise ValueError("--kv-device-gb must be > 0")
        for name in ("threads", "decode_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: the default)")
        self.kv_store_config()          # validates the KV store flags at start-up

    def kv_store_config(self) -> "KVStoreConfig":
        from kvstore.config import KVStoreConfig
        gb = 2**30
        disk_path = self.kv_disk_path
        if self.kv_disk_gb and disk_path is None:
            disk_path = self.resolved_cache_dir.parent / "kv"
        return KVStoreConfig(
            page_size=self.page_size, device_bytes=int(self.kv_device_gb * gb),
            host_bytes=int(self.kv_host_gb * gb), disk_bytes=int(self.kv_disk_gb * gb),
            disk_path=Path(disk_path) if disk_path else None, sparse_budget=self.sparse_budget,
            sink_tokens=self.sparse_sink_tokens, local_tokens=self.sparse_local_tokens,
            dense_layers=self.dense_layers, selector=self.selector,
            head_pages=self.sparse_head_pages, obs_window=self.sparse_obs_window,
            prior_share=self.sparse_prior_share, obs_reduce=self.sparse_obs_reduce,
            pipeline=self.pipeline, residency=self.residency,
            micro_batch=self.micro_batch,
            max_num_seqs=self.max_num_seqs, force_tier=self.kv_force_tier)

    def torch_threads(self) -> tuple[int, int]:
        """Torch threads of (steps with prompt tokens, decode-only steps). Prefill is bound by
        compute and takes every core (--threads). Decode leaves a core to the threads beside
        it unless --decode-threads says otherwise: the pipelined modes' select/resolve/fetch
        stages, and in every mode the server's HTTP and streaming threads, whose wake-ups stall
        every torch thread at its next barrier when all cores are torch's (2-core AMD EPYC,
        AVX2, 1 x 1K tokens: 47-56 ms a step on one decode thread against 54-84 on two,
        in-process; 100 ms in the server on two; bench/throughput.py at 8 x 7K tokens: sfc 224
        against 274 ms a step, sequential 204 against 206)."""
        full = self.threads or os.cpu_count() or 1
        if self.decode_threads:
            return full, self.decode_threads
        return full, max(1, full - 1)

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()
