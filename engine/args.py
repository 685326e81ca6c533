"""EngineArgs: every engine setting, chosen once at start-up (CLI flags map onto these fields)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from engine.devices import check_device_spec
from engine.generation_defaults import GENERATION_CONFIG_FILE, check_override
from engine.generation_defaults import MODES as GENERATION_MODES
from engine.settings import check_choices, setting
from kvstore.config import (FORCE_TIERS, HEAD_PAGES, OBS_REDUCE, PIPELINES, PLACEMENTS,
                            RESIDENCY_POLICIES, SELECTORS, TIER_CODECS, KVStoreConfig)
from scheduler.scheduler import POLICIES, SchedulerConfig
from scheduler.speculative import SpeculativeConfig

DTYPES = ("auto", "bf16", "fp32")
WEIGHTS = ("auto", "native", "fp32", "bf16", "int8", "int4")  # kernels.packed_linear.FORMATS
PREFILL_WEIGHTS = ("auto", "dense", "staged")
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


_KV, _SCHED = KVStoreConfig, SchedulerConfig    # their defaults are the flags' defaults
_GB = 2**30


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting (model, scheduler, KV store): `strata serve`'s flags are generated
    from these fields (engine/settings.py). Sizes and policies default to the layer's own
    config (SchedulerConfig, KVStoreConfig), so each default is written once."""
    model: str | None = setting(None, "HF model folder or .gguf file (default: the bundled "
                                "SmolLM2-135M-Instruct GGUF, also named 'bundled')", group="model")
    served_model_name: str | None = setting(
        None, "model id in the API (default: SmolLM2-135M-Instruct for the bundled model, else "
        "the folder or file name)", group="model")
    cache_dir: Path | None = setting(None, "where converted models are cached (default: "
                                     "$STRATA_CACHE_DIR or ~/.cache/strata/models)",
                                     group="model")
    dtype: str = setting("auto", "activations and the weights of prefill steps; auto: whichever "
                         "this CPU multiplies faster, timed at start-up (the KV cache is bf16 "
                         "unless fp32 is given)", DTYPES, group="model")
    weights: str = setting("auto", "weight format of decode steps: native (a GGUF file's "
                           "4-bit blocks (Q4_0/Q4_1/Q4_K) as 4-bit groups, Q5/Q6_K/Q8_0 as "
                           "8-bit, through our kernel or torch's packed ones), a dense dtype, "
                           "or int8/int4 (a float checkpoint quantized at load); auto: the "
                           "fastest on this CPU, timed at start-up", WEIGHTS, group="model")
    prefill_weights: str = setting(
        "auto", "a GGUF model decoding in its own codes multiplies long (prefill) steps by: "
        "dense, a dense copy of its weights kept beside the codes; staged, each matmul "
        "dequantized when a step reaches it (no copy: less memory, prefill a little slower); "
        "auto: dense where the copy takes at most half the memory left beside the codes",
        PREFILL_WEIGHTS, group="model")
    lora_modules: str = setting("", "LoRA adapters served beside the model, each a PEFT folder "
                                "(adapter_config.json, adapter_model.safetensors) a request "
                                "names in `model`: name=path, comma-separated", group="model")
    generation_config: str = setting(
        "auto", "a request's unset sampling fields take the model's defaults: auto, its "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) and a GGUF file's general.sampling.* keys; vllm: none (the API's "
        "defaults); or a folder holding a generation_config.json", group="model")
    override_generation_config: str = setting(
        "", "JSON object of sampling defaults over those of --generation-config, by request "
        "field name, e.g. '{\"temperature\": 0.6, \"top_k\": 20}'", group="model")
    hf_overrides: str = setting(
        "", "JSON object whose keys replace the model's config.json's at load, as vLLM's "
        "--hf-overrides; e.g. '{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4, "
        "\"original_max_position_embeddings\": 8192}}' serves 4x the model's positions",
        group="model")
    threads: int = setting(0, "torch CPU threads for the model (0: all cores)", group="model")
    decode_threads: int = setting(0, "torch CPU threads for steps that only decode (0: "
                                  "sequential mode times, per step shape, torch on every "
                                  "core against the C attention on every core; other "
                                  "modes: one fewer than --threads)", group="model")
    max_model_len: int | None = setting(None, "prompt + completion tokens (default: the "
                                        "model's positions)", group="scheduler")
    max_num_seqs: int = setting(_SCHED.max_num_seqs, "running requests at most",
                                group="scheduler")
    max_num_batched_tokens: int = setting(_SCHED.max_num_batched_tokens,
                                          "tokens per engine step at most", group="scheduler")
    max_waiting: int = setting(_SCHED.max_waiting, "waiting requests per client (OpenAI "
                               "`user`; requests without one share a queue) at most; more get "
                               "HTTP 429 (a request whose n x prompts exceeds it, 400)",
                               group="scheduler")
    max_waiting_total: int = setting(_SCHED.max_waiting_total, "waiting requests of all "
                                     "clients at most (0: 4 x --max-waiting)",
                                     group="scheduler")
    scheduling_policy: str = setting(
        _SCHED.policy, "which waiting request runs first and which running one is preempted "
        "when KV pages run out: arrival order (fcfs), or the request's `priority` (lower "
        "first), then arrival (priority: vLLM's); under fcfs a request with a priority is a "
        "400", POLICIES, group="scheduler")
    speculative_config: str = setting(
        "", "n-gram speculation (prompt lookup), vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'"
        ": a decode whose last tokens occurred earlier in its text also verifies the tokens "
        "that followed them, in one step, the output unchanged; drafts only while they are "
        "kept often enough to pay for their rows (measured; ours: \"draft_p_min\": 0..1 "
        "fixes the chance of being kept a draft needs); off: ''",
        group="scheduler")
    page_size: int = setting(_KV.page_size, "tokens per KV page (a power of two)", group="kv")
    kv_device_gb: float = setting(_KV.device_bytes / _GB, "device KV tier: GPU memory, a "
                                  "preallocated RAM pool on a CPU", group="kv")
    kv_host_gb: float = setting(_KV.host_bytes / _GB, "host DRAM KV tier (0: none)",
                                group="kv")
    kv_host_pool: str = setting("auto", "auto: on a CPU the host tier joins the device pool "
                                "(the same DRAM, read in place); separate: a host pool of its "
                                "own (the GPU-shaped three tiers), which --kv-tier-codec "
                                "stores as codes (~1.9x the pages at int8)",
                                ("auto", "separate"), group="kv")
    kv_disk_gb: float = setting(_KV.disk_bytes / _GB, "disk KV tier, the backing store when "
                                "set (0: none)", group="kv")
    kv_disk_path: Path | None = setting(None, "folder for the disk tier's files (default: "
                                        "beside the model cache); several folders, one per "
                                        "drive, comma-separated: pages are striped over them",
                                        group="kv")
    kv_tier_codec: str = setting(_KV.tier_codec, "store the disk tier's pages (and a separate "
                                 "host tier's) as 8- or 4-bit codes with a scale per group of "
                                 "channels (LeoAM's codec): 2x or 4x fewer bytes read and more "
                                 "context per GB, at some accuracy", TIER_CODECS, group="kv")
    kv_tier_codec_group: int = setting(_KV.tier_codec_group, "channels per scale of "
                                       "--kv-tier-codec (0: 64 for int8, 32 for int4, which "
                                       "loses fewer needles at 64)", (0, 32, 64), group="kv")
    kv_tier_codec_share: str = setting(_KV.tier_codec_share, "LeoAM's share: the part of "
                                       "the disk tier's layers stored as --kv-tier-codec codes "
                                       "(the rest as they are): a share in [0, 1], or auto, "
                                       "which weighs the drive's read time against the "
                                       "decoding CPU's, measured at start-up", group="kv")
    kv_recompute: str = setting(_KV.recompute, "KVPR: read a share of the pages a step "
                                "fetches from disk as their layer inputs and recompute their "
                                "K/V, overlapped with reading the rest (auto: the share a cost "
                                "model measured at start-up gives, none where inputs are no "
                                "smaller than the K/V, as on GQA models; or a fixed share in "
                                "[0, 1]); off by default: no split has paid on a CPU yet",
                                group="kv")
    prefix_cache: str = setting("on" if _KV.prefix_cache else "off", "reuse the KV of full "
                                "pages of earlier prompts (a document or conversation resent "
                                "is prefilled once); kept across restarts on the disk tier",
                                ("on", "off"), group="kv")
    swa_full: bool = setting(_KV.swa_full, "keep every layer's KV of the whole context "
                             "(llama.cpp's --swa-full); by default a sliding-window layer's "
                             "pages before its window leave the KV memory once no request "
                             "reads them (when the device tier is the backing store)",
                             group="kv")
    sparse_budget: int = setting(_KV.sparse_budget, "KV tokens attended per request, layer "
                                 "and KV head in decode (0: dense attention)", group="sparse")
    sparse_threshold: int = setting(_KV.sparse_threshold, "a decode attends sparsely once its "
                                    "context is past this many tokens (and the budget; 0: "
                                    "twice --sparse-budget, below which selecting costs more "
                                    "than it skips)", group="sparse")
    sparse_budget_plan: str = setting("", "a budget per layer and KV head (JSON from `strata "
                                      "profile`: KVDrive's 2D window scaling), spending the "
                                      "total of its uniform --sparse-budget, which it sets",
                                      group="sparse")
    sparse_sink_tokens: int = setting(_KV.sink_tokens, "first tokens always attended in "
                                      "sparse decode", group="sparse")
    sparse_local_tokens: int = setting(_KV.local_tokens, "most recent tokens always attended "
                                       "in sparse decode", group="sparse")
    dense_layers: int = setting(_KV.dense_layers, "the first layers always attend densely",
                                group="sparse")
    selector: str = setting(_KV.selector, "page scoring: Quest's min/max bound, the mean "
                            "key, Quest's bound over keys projected to --lowrank-rank "
                            "dims (KVSwap's low-rank keys: at rank 16 a quarter of Quest's "
                            "summaries; the projection is calibrated once per model, `strata "
                            "calibrate`), or KVDrive's centroid index (k-means over the "
                            "pages' mean keys, whole clusters best first)", SELECTORS,
                            group="sparse")
    lowrank_rank: int = setting(_KV.lowrank_rank, "dims of the keys' low-rank projection "
                                "(--selector lowrank)", group="sparse")
    centroid_pages: int = setting(_KV.centroid_pages, "pages per k-means centroid of the "
                                  "centroid index (--selector centroid)", group="sparse")
    sparse_head_pages: str = setting(_KV.head_pages, "each KV head attends to its own "
                                     "selected pages, or to the union of all heads' pages",
                                     HEAD_PAGES, group="sparse")
    sparse_obs_window: int = setting(_KV.obs_window, "the last N prompt tokens' attention, "
                                     "computed once at the end of prefill, ranks each page "
                                     "(SnapKV's observation window; 0: off)", group="sparse")
    sparse_obs_reduce: str = setting(_KV.obs_reduce, "how a page's attention from the "
                                     "window's queries and a GQA group's heads combine: "
                                     "summed (SnapKV) or the largest", OBS_REDUCE,
                                     group="sparse")
    sparse_prior_share: float = setting(_KV.prior_share, "share of the selected pages (after "
                                        "sink and local pages) kept for the pages the "
                                        "observation window attended most", group="sparse")
    pipeline: str = setting(_KV.pipeline, "how sparse decode schedules selection, fetch and "
                            "compute per layer: one after another; SFC micro-batches; or "
                            "layer-ahead prefetch of the next layer's predicted pages",
                            PIPELINES, group="pipeline")
    micro_batch: int = setting(_KV.micro_batch, "sequences per SFC micro-batch (0: calibrate "
                               "on the first decode steps)", group="pipeline")
    residency: str = setting(_KV.residency, "which pages the device and host tiers evict: "
                             "cycle (a fixed share of a step's layers stays), lru, or score "
                             "(cycle, but pages the step before did not select, and pages a "
                             "DRAM copy away, go first)", RESIDENCY_POLICIES, group="pipeline")
    kv_placement: str = setting(_KV.placement, "which of a prompt's pages stay in the faster "
                                "tiers after prefill: the first and newest of each layer, or "
                                "the ones the observation window attended most (KVDrive's "
                                "warm-up; dense layers' pages first)", PLACEMENTS,
                                group="pipeline")
    kv_force_tier: str = setting(_KV.force_tier, "diagnostics: evict pages down to this tier "
                                 "after every step", FORCE_TIERS, group="pipeline")
    device: str = setting("auto", "where the model runs and the device KV tier lives: auto "
                          "(the first CUDA device torch sees, else cpu), cpu, cuda or cuda:N",
                          group="model")

    def __post_init__(self):
        check_choices(self)
        check_device_spec(self.device)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"--page-size must be a power of two, got {self.page_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_waiting < 0 or self.max_waiting_total < 0:
            raise ValueError("--max-waiting and --max-waiting-total must be >= 0")
        for name in ("threads", "decode_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: the default)")
        self.kv_store_config()          # validates the KV store flags at start-up
        if self.lora_adapters() and self.kv_recompute != "off":
            raise ValueError("--kv-recompute rebuilds K/V from the base model's weights: it "
                             "cannot serve --lora-modules")
        check_override(self.override_generation_config)
        SpeculativeConfig.from_json(self.speculative_config)
        self.config_overrides()
        if self.generation_config not in GENERATION_MODES and not (
                Path(self.generation_config).expanduser() / GENERATION_CONFIG_FILE).is_file():
            raise ValueError(f"--generation-config: {self.generation_config} is not auto, vllm "
                             f"or a folder holding a {GENERATION_CONFIG_FILE}")

    def config_overrides(self) -> dict:
        """--hf-overrides as a dict (ValueError when it is not a JSON object)."""
        if not self.hf_overrides:
            return {}
        try:
            value = json.loads(self.hf_overrides)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hf-overrides is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--hf-overrides takes a JSON object, got {self.hf_overrides}")
        return value

    def lora_adapters(self) -> dict[str, Path]:
        """--lora-modules as {name: folder} (ValueError when malformed)."""
        return parse_lora_modules(self.lora_modules)

    def kv_store_config(self) -> KVStoreConfig:
        gb = _GB
        disk_path = self.kv_disk_path
        if self.kv_disk_gb and disk_path is None:
            disk_path = self.resolved_cache_dir.parent / "kv"
        paths = disk_folders(disk_path)
        budget, plan = self.sparse_budget, ()
        if self.sparse_budget_plan:
            from kvstore.budget_plan import BudgetPlan      # plain JSON: no torch
            bp = BudgetPlan.load(self.sparse_budget_plan)
            if budget not in (0, bp.budget) or bp.page_size != self.page_size:
                raise ValueError(f"--sparse-budget-plan {self.sparse_budget_plan} was made for "
                                 f"--sparse-budget {bp.budget} and --page-size {bp.page_size}")
            budget, plan = bp.budget, bp.budgets
        return KVStoreConfig(
            page_size=self.page_size, device_bytes=int(self.kv_device_gb * gb),
            host_bytes=int(self.kv_host_gb * gb), merge_host=self.kv_host_pool == "auto",
            disk_bytes=int(self.kv_disk_gb * gb),
            disk_path=paths[0] if paths else None,
            disk_paths=tuple(paths) if len(paths) > 1 else (), sparse_budget=budget,
            sparse_threshold=self.sparse_threshold, budget_plan=plan,
            sink_tokens=self.sparse_sink_tokens, local_tokens=self.sparse_local_tokens,
            dense_layers=self.dense_layers, selector=self.selector,
            lowrank_rank=self.lowrank_rank, centroid_pages=self.centroid_pages,
            head_pages=self.sparse_head_pages, obs_window=self.sparse_obs_window,
            prior_share=self.sparse_prior_share, obs_reduce=self.sparse_obs_reduce,
            pipeline=self.pipeline, residency=self.residency, placement=self.kv_placement,
            micro_batch=self.micro_batch,
            max_num_seqs=self.max_num_seqs, force_tier=self.kv_force_tier,
            tier_codec=self.kv_tier_codec, tier_codec_group=self.kv_tier_codec_group,
            tier_codec_share=str(self.kv_tier_codec_share),
            recompute=self.kv_recompute,
            prefix_cache=self.prefix_cache == "on", swa_full=self.swa_full,
            max_step_tokens=self.max_num_batched_tokens)

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


def disk_folders(value: str | Path | None) -> list[Path]:
    """--kv-disk-path's folders: one, or several comma-separated (one per drive)."""
    if value is None:
        return []
    return [Path(p.strip()) for p in str(value).split(",") if p.strip()]


LORA_CONFIG_FILE = "adapter_config.json"     # what makes a folder a PEFT adapter


def parse_lora_modules(spec: str) -> dict[str, Path]:
    """`--lora-modules`: "name=path,name2=path2" -> {name: path}; ValueError when malformed."""
    out: dict[str, Path] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules: {item!r} is not name=path")
        if name.strip() in out:
            raise ValueError(f"--lora-modules: {name.strip()!r} is named twice")
        out[name.strip()] = Path(path.strip()).expanduser()
    return out
