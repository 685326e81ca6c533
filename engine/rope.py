"""Rotary position embedding in HF Llama's "rotate_half" convention, with a precomputed cache.

cos/sin are computed once for positions [0, max_positions) as [max_positions, head_dim] float32
tables; applying gathers the rows of the step's positions [T]. Scaling types follow
transformers' `modeling_rope_utils`: default, linear, dynamic (NTK, fixed at max_positions),
llama3, yarn (with its attention factor folded into cos/sin), longrope (Phi-3's LongRoPE).

Partial rotary (Phi-4-mini rotates the first 3/4 of each head, in rotate_half pairs (i, i +
rotary_dim / 2)) is served by a fixed reordering of each q and k head's dims, applied to the
weights once at load (`rotary_order`): the rotated pairs become (i, i + head_dim / 2) as in a
full rotation, the other dims sit in the pairs whose cos is 1 and sin 0. Attention sums over
a head's dims, so q . k is unchanged, and every RoPE kernel (torch, C) runs as for a full
rotation.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None,
                  max_position_embeddings: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] float32 and the cos/sin attention factor
    (head_dim: the dims RoPE rotates, the rotary dim where only part of a head turns)."""
    base_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                 / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return base_freq, 1.0
    factor = scaling.get("factor")
    if kind == "linear":
        return base_freq / factor, 1.0
    if kind == "dynamic":
        # NOTE: HF grows the NTK base with the longest sequence seen; we fix it for the longest
        # sequence we serve, so it matches HF exactly while max_positions <= max_position_emb.
        seq_len = max(max_positions, max_position_embeddings)
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim)), 1.0
    if kind == "llama3":
        return _llama3(base_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_position_embeddings, max_positions)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: Mapping[str, Any],
          max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    orig = s.get("original_max_position_embeddings") or max_position_embeddings
    factor = s.get("factor") or max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attn_factor)


def _longrope(dim: int, theta: float, s: Mapping[str, Any], max_position_embeddings: int,
              max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: each frequency divided by its own factor, the long ones when the
    served length passes the pretraining length. transformers switches per forward call on
    the longest position in it, so one sequence's cache would hold keys rotated both ways;
    like llama.cpp (by its context size) we choose once, by the length served
    (--max-model-len), and every key of every request is rotated alike."""
    orig = int(s.get("original_max_position_embeddings") or max_position_embeddings)
    factor = s.get("factor") or max_position_embeddings / orig
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        attn_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(s["long_factor"] if max_positions > orig else s["short_factor"],
                       dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise ValueError(f"longrope factors have {ext.numel()} entries; the rotary dim "
                         f"{dim} needs {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * theta ** shape), float(attn_factor)


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a q or k head's dims that turns a partial rotation (rotate_half over the
    first `rotary_dim` dims) into a full one (see the module's note): the first half holds the
    rotated pairs' first members, then half the pass-through dims; the second half, their
    partners, then the other pass-through half."""
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    idx = torch.arange(head_dim)
    return torch.cat([idx[:r], idx[2 * r:2 * r + rest], idx[r:2 * r], idx[2 * r + rest:]])


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, KVH, D] at positions [T]. With a rotary_dim below
    head_dim, q and k come in `rotary_order` and the tables leave the pass-through dims as
    they are (cos 1, sin 0: no attention factor either, as transformers' partial rotary)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Mapping[str, Any] | None = None,
                 max_position_embeddings: int | None = None, rotary_dim: int | None = None):
        super().__init__()
        rot = rotary_dim or head_dim
        inv_freq, attn_factor = rope_inv_freq(rot, theta, scaling,
                                              max_position_embeddings or max_positions,
                                              max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos = torch.ones(max_positions, head_dim)
        sin = torch.zeros(max_positions, head_dim)
        half, r = head_dim // 2, rot // 2
        for at in (0, half):        # the rotated pairs' two members
            cos[:, at:at + r] = freqs.cos() * attn_factor
            sin[:, at:at + r] = freqs.sin() * attn_factor
        self.max_positions = max_positions
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] in `dtype` for positions [T] (gather once per step)."""
        # NOTE: checked on CPU only, where it costs no device sync
        if positions.device.type == "cpu" and positions.numel() \
                and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} is beyond the "
                             f"{self.max_positions} positions this model was loaded for")
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by cos/sin [T, 1, D] (x's dtype, like HF)."""
        return _rotate(x, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64; q [T, H, D], k [T, KVH, D] -> rotated (q, k), input dtypes."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); computed in x's dtype like HF
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
