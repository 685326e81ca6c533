"""llama.cpp's samplers, for clients that send its fields (llama-server takes them on its /v1
routes too): DRY, dynamic temperature, top-n-sigma, locally typical sampling, XTC and Mirostat
(1 and 2), each as llama.cpp's src/llama-sampling.cpp defines it (in vLLM's order, the
temperature first, where llama.cpp's default chain puts it last). DRY is a penalty, applied
beside the others to every row (greedy ones too). engine/sampler.py calls the rest on the
rows that sample (temperature > 0), in this order: the temperature (dynamic where
`dynatemp_range` is set), then top-n-sigma, typical, vLLM's min_p / top_k / top_p, XTC, and
the draw; a Mirostat row replaces the truncations and the draw with Mirostat's (llama.cpp's
chain with mirostat on is temperature then Mirostat).

All work in float32 on one row's logits [V] (-inf: a token already excluded) and change
them in place or return a new row; random choices draw from the row's own generator, so a
seeded request stays reproducible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

MIROSTAT_M = 100            # Mirostat 1: the top tokens its Zipf exponent is estimated from
DRY_MAX_PENALTY = 1e6       # DRY's penalty at most: a logit this far down is never drawn


@dataclass
class MirostatState:
    """A request's Mirostat target surprise, mu (starts at 2 tau), updated after each token."""
    mu: float


def dry(row: torch.Tensor, context: list[int], multiplier: float, base: float,
        allowed_length: int, breakers: frozenset[int]) -> None:
    """In place: DRY ("don't repeat yourself", p-e-w's, as llama.cpp and text-generation-webui
    apply it): where the context's last tokens repeat an earlier stretch of it, the token that
    followed that stretch loses multiplier x base^(length - allowed_length) of its logit, for
    its longest such repeat of at least `allowed_length` tokens; a breaker token ends a
    stretch (and a context ending in one is not penalized). Repeats are measured up to the
    length whose penalty passes DRY_MAX_PENALTY (longer ones are banned as surely), all
    earlier occurrences at once, so a step costs O(context x that length) in numpy."""
    n = len(context)
    if multiplier <= 0 or n < 2 or context[-1] in breakers:
        return
    ctx = np.asarray(context, dtype=np.int64)
    stops = np.isin(ctx, np.fromiter(breakers, dtype=np.int64)) if breakers \
        else np.zeros(n, dtype=bool)
    cand = np.flatnonzero(ctx[:-1] == ctx[-1])              # earlier ends of the last token
    cand = cand[~stops[cand + 1]]                           # followed by a breaker: no repeat
    if not cand.size:
        return
    cap = allowed_length if base <= 1.0 else allowed_length + int(
        math.ceil(math.log(DRY_MAX_PENALTY / multiplier) / math.log(base)))
    length, active = np.ones(cand.size, dtype=np.int64), np.ones(cand.size, dtype=bool)
    for k in range(1, min(cap, n - 1) + 1):
        if stops[n - 1 - k]:                                # the repeat reaches a breaker
            break
        j = cand - k
        active &= (j >= 0) & (ctx[np.maximum(j, 0)] == ctx[n - 1 - k])
        if not active.any():
            break
        length += active
    followers, inverse = np.unique(ctx[cand + 1], return_inverse=True)
    longest = np.zeros(followers.size, dtype=np.int64)
    np.maximum.at(longest, inverse, length)
    hit = longest >= allowed_length
    if hit.any():
        penalty = multiplier * np.power(float(base), longest[hit] - allowed_length)
        row[torch.from_numpy(followers[hit]).to(row.device)] -= torch.from_numpy(
            np.minimum(penalty, DRY_MAX_PENALTY)).to(row.device, row.dtype)


def dynamic_temperature(row: torch.Tensor, temp: float, spread: float,
                        exponent: float) -> float:
    """llama.cpp's dynatemp: a temperature in [temp - spread, temp + spread] that grows with
    the row's normalized entropy (raised to `exponent`)."""
    lo, hi = max(0.0, temp - spread), temp + spread
    finite = row[torch.isfinite(row)]
    if finite.numel() <= 1:
        return max(hi, 1e-6)
    p = torch.softmax(finite, dim=-1)
    entropy = float(-(p * p.clamp_min(1e-30).log()).sum())
    norm = entropy / math.log(finite.numel())
    return max(lo + (hi - lo) * norm ** exponent, 1e-6)


def top_n_sigma(row: torch.Tensor, n: float) -> None:
    """In place: tokens more than n standard deviations (of the finite logits) below the top
    logit get -inf (llama.cpp's top-n-sigma; temperature scales both sides alike)."""
    finite = row[torch.isfinite(row)]
    if n <= 0 or finite.numel() < 2:
        return
    cutoff = finite.max() - n * finite.std(unbiased=False)
    row.masked_fill_(row < cutoff, float("-inf"))


def typical(row: torch.Tensor, mass: float) -> None:
    """In place: locally typical sampling (Meister et al.; llama.cpp's typ_p): keep the tokens
    whose surprise is closest to the row's entropy until they hold `mass` (at least one)."""
    if mass >= 1.0:
        return
    logp = torch.log_softmax(row, dim=-1)
    p = logp.exp()
    entropy = -(p * logp.nan_to_num(neginf=0.0)).sum()
    shifted = (-logp - entropy).abs()                  # inf for excluded tokens
    order = shifted.argsort()
    cum = p[order].cumsum(0)
    keep = int((cum <= mass).sum()) + 1                # the first prefix to pass `mass`
    drop = order[min(keep, order.numel()):]
    row[drop] = float("-inf")


def xtc(row: torch.Tensor, probability: float, threshold: float,
        generator: torch.Generator | None) -> None:
    """In place: llama.cpp's XTC ("exclude top choices"): with `probability`, every token at
    or above `threshold` but the least likely of them gets -inf (only where at least two are;
    a threshold above 0.5 never has two)."""
    if probability <= 0 or threshold > 0.5:
        return
    if float(torch.rand((), generator=generator)) > probability:
        return
    p = torch.softmax(row, dim=-1)
    above = (p >= threshold).nonzero()[:, 0]
    if above.numel() < 2:
        return
    last = above[p[above].argmin()]
    row[above[above != last]] = float("-inf")


def mirostat(row: torch.Tensor, version: int, tau: float, eta: float, state: MirostatState,
             u: float) -> int:
    """One token by Mirostat (Basu et al.) `version` 1 or 2 from a tempered row, with the
    uniform draw `u`; updates `state.mu` by the surprise of the token taken (on the CPU,
    whatever the row's device: a row is one vocabulary of floats)."""
    p, order = torch.softmax(row.float().cpu(), dim=-1).sort(descending=True)
    p = p[p > 0]
    order = order[:p.numel()]
    if version == 2:
        k = int((-p.log2() <= state.mu).sum())
    else:
        m = min(MIROSTAT_M, p.numel())
        i = torch.arange(m - 1, dtype=torch.float64)
        t = ((i + 2) / (i + 1)).log()
        b = (p[:m - 1].double() / p[1:m].double()).log()
        s_hat = float((t * b).sum() / (t * t).sum()) if m > 1 else 1.0
        eps, vocab = s_hat - 1, row.numel()
        # (eps -> 0: eps / (1 - V^-eps) -> 1 / ln V)
        ratio = 2 ** state.mu * (eps / (1 - vocab ** -eps) if abs(eps) > 1e-6
                                 else 1 / math.log(vocab))
        k = int(math.exp(min(math.log(ratio) / s_hat, 700.0))) \
            if s_hat > 0 and ratio > 0 else p.numel()
    k = max(1, min(k, p.numel()))
    q = p[:k] / p[:k].sum()
    cdf = q.cumsum(0)
    j = min(int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True)), k - 1)
    state.mu -= eta * (-math.log2(float(q[j])) - tau)
    return int(order[j])
