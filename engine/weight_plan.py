"""Which weight format and dtype each phase runs, chosen at start-up by timing this CPU.

A prefill chunk multiplies thousands of rows by each weight: it is bound by compute, and a
CPU's fastest GEMM decides (float32 on an AVX2-only CPU, where torch's bf16 matmul is emulated
and 5-9x slower; bf16 where the CPU has AVX512_BF16 or AMX). A decode step multiplies a few
rows: it is bound by the bytes of the weights, and the packed int4 / int8 kernels read 4-8x
fewer than float32. So `--dtype auto` (activations, dense prefill weights) and
`--weights auto` (the decode form) are picked by timing the candidates on matmuls of the
model's own shapes, once per process, and logged:

  --dtype auto      float32 or bf16, whichever multiplies a prefill-sized block faster; the KV
                    cache is bf16 (attention is bound by its bytes; the kernels read bf16
                    into float32)
  --weights auto    the fastest over 1- and 8-row steps of the forms that keep the file's
                    values: its own (a GGUF file's Q4_0 / Q4_1 / Q4_K blocks as 4-bit, Q5_0 /
                    Q5_1 / Q5_K / Q6_K / Q8_0 as 8-bit groups: engine/gguf_blocks.py) and the
                    dense dtypes --dtype allows; a float checkpoint is
                    never quantized unless asked (--weights int8 | int4)

A width has two kernels, timed against each other too: our own (kernels/_qmatmul.c, formats
q4 / q8; "native" is the file's widths in them) and torch's packed ones (int4 / int8;
"native-torch").

A step of at least `prefill_rows` rows uses the dense prefill form, fewer rows the decode
form; when both are the same, one copy is kept. A GGUF model whose dense copy would not fit
(more than DENSE_SHARE of the memory available beside its packed weights: a 7-8B model in
bf16 on a 24 GB machine), or one served with --prefill-weights staged, keeps its packed
weights alone (`keep_dense` False; packed as they load, engine/llama_weights.py): a step
of `prefill_rows` or more then dequantizes each matmul of our kernel's formats when it runs
(kernels/packed_linear.py `StagedWeight`; the crossover timed against that form), and
torch's packed formats run every step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.args import DTYPES, PREFILL_WEIGHTS, WEIGHTS
from engine.model_config import ModelConfig
from kernels.packed_linear import BITS, DENSE, NATIVE, OURS, PackedWeight, StagedWeight

logger = logging.getLogger(__name__)

PROBE_LAYERS = 6            # distinct layers a probe sweeps, so weights stream from memory,
PROBE_BYTES = 256 << 20     # or fewer: as many as span this many float32 bytes (a 7-8B
                            # model's one layer: making 6 of each format took 2.5 minutes)
DECODE_ROWS = (1, 8)
PREFILL_PROBE_ROWS = 128
CROSSOVER_ROWS = (16, 24, 32, 64, 128)
# a cgroup's memory limit and use (v2, v1): a container's room
CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
DENSE_SHARE = 0.5           # of the memory available beside the packed weights, the most a
                            # dense prefill copy may take (the rest: KV, activations, the OS)


@dataclass(frozen=True)
class WeightPlan:
    dtype: str              # activations and the dense prefill weights: bf16 | fp32
    kv_dtype: str           # the KV cache: bf16 | fp32
    decode_format: str      # a packed_linear format, or "native" / "native-torch": each
                            # tensor at its stored width, in our kernels or torch's
    prefill_rows: int       # steps with this many rows or more use the dense form
    keep_dense: bool = True     # False: no dense copy (long steps stage one, StagedWeight)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DENSE[self.dtype]

    @property
    def two_forms(self) -> bool:
        return self.decode_format != self.dtype


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """[out, in] of one decoder layer's matmuls (fused q|k|v, o, gate|up, down; an MoE
    model's: an expert's gate|up and down)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    inter = cfg.intermediate_size if cfg.moe is None else cfg.moe.expert_size
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]


_PROBES: dict[tuple, float] = {}
_WEIGHTS: dict[tuple, list[PackedWeight]] = {}      # the probes' weights, while a plan is made


def probe_layers(shapes: list[tuple[int, int]]) -> int:
    """How many layers of `shapes` a probe sweeps: PROBE_LAYERS, or fewer where fewer span
    PROBE_BYTES."""
    per_layer = 4 * sum(n * k for n, k in shapes)
    return max(1, min(PROBE_LAYERS, -(-PROBE_BYTES // per_layer)))


def staged(act: str, fmt: str) -> str:
    """The probes' name of `fmt` weights dequantized to `act` when they run (StagedWeight)."""
    return f"{fmt}>{act}"


def _probe_weights(fmt: str, shapes: list[tuple[int, int]]) -> list:
    """Random weights of `probe_layers` layers of `shapes` in `fmt` (made once a plan)."""
    key = (fmt, tuple(shapes))
    if ">" in fmt and key not in _WEIGHTS:
        packed, act = fmt.split(">")
        _WEIGHTS[key] = [StagedWeight(w, act) for w in _probe_weights(packed, shapes)]
    if key not in _WEIGHTS:
        gen = torch.Generator().manual_seed(0)
        _WEIGHTS[key] = [PackedWeight.from_dense(torch.randn(n, k, generator=gen) * 0.02, fmt)
                         for _ in range(probe_layers(shapes)) for n, k in shapes]
    return _WEIGHTS[key]


SWEEPS = 5


def _sweeps(fmts: list[str], shapes: list[tuple[int, int]], rows: int,
            threads: int) -> dict[str, float]:
    """Seconds of the best sweep of rows x every weight of `probe_layers` layers, per format
    (cached). The formats take turns, SWEEPS rounds after a warm-up one: noise from the
    machine, or a kernel's threads still spinning after its turn, falls on all of them."""
    todo = [f for f in dict.fromkeys(fmts) if (f, tuple(shapes), rows, threads) not in _PROBES]
    if todo:
        weights = {f: _probe_weights(f, shapes) for f in todo}
        gen = torch.Generator().manual_seed(1)
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in shapes}
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        best = dict.fromkeys(todo, float("inf"))
        try:
            for i in range(SWEEPS + 1):
                for f in todo:
                    t0 = time.perf_counter()
                    for w in weights[f]:
                        w.mm(xs[w.shape[1]])
                    if i:                               # the first round warms up
                        best[f] = min(best[f], time.perf_counter() - t0)
        finally:
            torch.set_num_threads(before)
        _PROBES.update({(f, tuple(shapes), rows, threads): t for f, t in best.items()})
    return {f: _PROBES[(f, tuple(shapes), rows, threads)] for f in fmts}


def _candidates(weights: str, dtype: str, native: str | None) -> list[str]:
    """Decode forms `--weights` allows (native: the file's own width, None for a float
    checkpoint, whose own values any dense dtype holds)."""
    if weights in BITS:                         # a width: our kernel's form and torch's
        return [forms[BITS[weights]] for forms in NATIVE.values()]
    if weights not in ("auto", "native"):
        return [weights]
    dense = ["fp32", "bf16"] if dtype == "auto" else [dtype]
    ours = list(NATIVE) if native else []
    if weights == "native":
        return ours or dense[:1]
    return ours + dense


def plan_weights(cfg: ModelConfig, dtype: str, weights: str, native: str | None,
                 threads: tuple[int, int], device: str = "cpu",
                 available: int | None = None, prefill: str = "auto") -> WeightPlan:
    """Resolve --dtype, --weights and --prefill-weights for this model on this CPU (timed
    where there is a choice). threads: torch threads of (prefill, decode) steps (the probes
    run on the first). available: memory bytes for `dense_copy_fits` (default: the OS's).
    On a GPU the weights are dense (the packed kernels are CPU kernels) and `auto` means
    bf16."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"--weights must be one of {WEIGHTS}, got {weights!r}")
    if prefill not in PREFILL_WEIGHTS:
        raise ValueError(f"--prefill-weights must be one of {PREFILL_WEIGHTS}, got {prefill!r}")
    try:
        return _plan(cfg, dtype, weights, native, threads, device, available, prefill)
    finally:
        _WEIGHTS.clear()                        # (a 7-8B model's: several GB)
        StagedWeight.release_workspace()        # (the staged probes': this thread steps not)


def _plan(cfg: ModelConfig, dtype: str, weights: str, native: str | None,
          threads: tuple[int, int], device: str, available: int | None,
          prefill: str) -> WeightPlan:
    if torch.device(device).type != "cpu":
        if weights in ("int8", "int4"):
            raise ValueError(f"--weights {weights} runs on the CPU only (device {device})")
        act = "bf16" if dtype == "auto" else dtype
        return WeightPlan(act, act, act, 0)
    shapes = layer_shapes(cfg)
    # NOTE: the dtype probe runs on the prefill threads (every core unless --threads); the
    # weight formats are timed on one thread. A choice that hung on --decode-threads would
    # differ between pipeline modes, whose outputs must agree token for token; and two
    # kernels' thread pools timed in turns on a small machine measure each other's spinning
    # threads (measured: our kernel 6 or 11 ms a sweep at 2 threads, by the turn it ran in)
    prefill_t, decode_t = threads[0], 1
    act = dtype
    if dtype == "auto":
        times = _sweeps(list(DENSE), shapes[:2], PREFILL_PROBE_ROWS, prefill_t)
        act = min(times, key=times.get)
        logger.info("--dtype auto: %s (a %d-row block: %s)", act, PREFILL_PROBE_ROWS,
                    ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in times.items()))
    def real(c: str) -> str:
        return NATIVE[c][BITS[native]] if c in NATIVE else c

    cands = [c for c in _candidates(weights, dtype, native)
             if all(PackedWeight.supports(real(c), s) for s in shapes)] or [act]
    fmt = cands[0]
    if len(cands) > 1:
        per_rows = [_sweeps([real(c) for c in cands], shapes, r, decode_t) for r in DECODE_ROWS]
        times = {c: sum(t[real(c)] for t in per_rows) for c in cands}
        fmt = min(times, key=times.get)
        logger.info("--weights %s: %s for decode (%s rows x %d layers: %s)", weights, fmt,
                    "+".join(map(str, DECODE_ROWS)), probe_layers(shapes),
                    ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in times.items()))
    keep = _keep_dense(cfg, act, fmt, native, prefill, available)
    # without the dense copy, long steps dequantize each matmul when it runs (our kernel's
    # formats only: torch's packed ones have no such form, and their long steps run packed)
    stage = not keep and real(fmt) in OURS
    long_form = staged(act, real(fmt)) if stage else act
    rows = 0
    if fmt != act:
        # NOTE: on the prefill threads: a step of more than one row per request is a prefill
        # chunk (often a short one: the new turn of a conversation whose prefix is cached),
        # and runs on them. Timed on one thread the crossover came out at 32 rows where, on
        # two (2-core AMD EPYC, AVX2), a 30-row step took 0.27 s in the 4-bit kernel against
        # 0.16 s dense over 30 layers
        def dense_wins(r: int) -> bool:
            t = _sweeps([long_form, real(fmt)], shapes, r, prefill_t)
            return t[long_form] <= t[real(fmt)]

        rows = next((r for r in CROSSOVER_ROWS if dense_wins(r)), 2 * CROSSOVER_ROWS[-1])
    if fmt != act and (keep or stage):      # (else every step runs `fmt`; an MoE layer's
        # decode rows and a tied head's dense form still go by `rows`)
        logger.info("steps of %d rows or more multiply by %s weights%s, fewer by %s", rows, act,
                    "" if keep else " (each matmul dequantized when it runs)", fmt)
    kv = "fp32" if dtype == "fp32" else "bf16"
    return WeightPlan(act, kv, fmt, rows, keep)


def _keep_dense(cfg: ModelConfig, act: str, fmt: str, native: str | None, prefill: str,
                available: int | None) -> bool:
    """Whether the model keeps a dense copy for long steps: always where it decodes dense, or
    from a float checkpoint, or with a partial rotary (its dense rows are reordered); else
    as --prefill-weights says (auto: where it fits)."""
    if fmt == act or native is None or fmt not in NATIVE or cfg.rope_dims != cfg.head_dim:
        return True
    if prefill != "auto":
        return prefill == "dense"
    return dense_copy_fits(cfg, act, BITS[native], available)


def dense_copy_fits(cfg: ModelConfig, act: str, bits: int, available: int | None = None
                    ) -> bool:
    """Whether the dense prefill copy of a model whose weights are `bits`-bit codes fits
    beside them: at most DENSE_SHARE of `available` bytes (default: the OS's MemAvailable,
    or the cgroup's room where that is less) less the packed weights' and the (always dense)
    embedding's (logged where it does not)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    shapes = layer_shapes(cfg)
    per_layer = sum(n * k for n, k in (shapes if cfg.moe is None else shapes[:2]))
    params = layers * per_layer + (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)
    dense = params * DENSE[act].itemsize
    packed = params * (bits / 8 + 0.125)        # (+ float16 scale and zero a group of 32)
    embedding = cfg.vocab_size * h * DENSE[act].itemsize
    if available is None:
        available = _mem_available()
    fits = dense <= DENSE_SHARE * (available - packed - embedding)
    if not fits:
        logger.info("a dense %s copy of the weights (%.1f GB) does not fit beside their packed "
                    "form (%.1f GB) in %.1f GB available: the packed form serves alone",
                    act, dense / 1e9, packed / 1e9, available / 1e9)
    return fits


def _mem_available() -> int:
    """Bytes this process may still take: the OS's MemAvailable (Linux; elsewhere
    unbounded), or less where its cgroup (a container's memory limit, v2 or v1) leaves less."""
    avail = 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit, used in CGROUP_MEMORY:
        try:
            with open(limit) as f, open(used) as g:
                cap = f.read().strip()
                if cap.isdigit() and int(cap) < 1 << 60:
                    avail = min(avail, int(cap) - int(g.read().strip()))
        except (OSError, ValueError):
            continue
    return avail
