"""Decode attention's K/V in float32 where the CPU's half-precision SDPA is the slow path.

torch's CPU SDPA kernel in bf16 is fast on some CPUs and several times slower than in float32
on others. Measured, one thread, 24 (sequence, KV head) rows x 1040 tokens x 64, group 3:
- AMD EPYC (avx512_bf16, no AMX), the box of 2026-11-23: bf16 9.5 ms, float32 1.0 ms; with the
  gather and this upcast, a sparse layer 12.5 ms -> 4.2 ms;
- the Intel Xeon of earlier runs: bf16 ~1.1 ms (kernels/sparse_attention.py's note).
A decode query is one token, so copying the gathered K/V into a float32 workspace costs less
than the slow kernel wherever there is one. Which path runs is decided once per process and
dtype by timing both on a decode-sized problem (`upcast_wins`); both give the same attention
up to the rounding of the output (SDPA accumulates in float32 either way).

Leaf module: imports only torch.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_WINS: dict[torch.dtype, bool] = {}


def upcast_wins(dtype: torch.dtype) -> bool:
    """Is float32 SDPA over upcast K/V faster than SDPA in `dtype` on this CPU? (timed once)"""
    if dtype == torch.float32:
        return False
    if dtype not in _WINS:
        rows, group, length, d = 24, 3, 1024, 64
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(rows, group, 1, d, generator=gen)
        kv = torch.randn(2, rows, 1, length, d, generator=gen).to(dtype)
        ws = Upcast()

        def low():
            F.scaled_dot_product_attention(q.to(dtype), kv[0], kv[1], enable_gqa=True)

        def up():
            k, v = ws(kv)
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        t_low, t_up = best(low), best(up)
        _WINS[dtype] = t_up < 0.8 * t_low
        logger.info("decode attention in %s: %s (SDPA %.2f ms in %s, %.2f ms upcast to "
                    "float32, on a decode-sized probe)", dtype,
                    "upcast to float32" if _WINS[dtype] else "native", 1e3 * t_low, dtype,
                    1e3 * t_up)
    return _WINS[dtype]


class Upcast:
    """Copies a half-precision tensor into a float32 workspace reused across calls (fresh
    multi-MB buffers page-fault on every layer)."""

    def __init__(self) -> None:
        self._ws: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        ws = self._ws
        if ws is None or ws.numel() < n or ws.device != x.device:
            ws = self._ws = torch.empty(n, dtype=torch.float32, device=x.device)
        out = ws[:n].view(x.shape)
        out.copy_(x)
        return out
