"""The C kernels' threads on torch's OpenMP team (kernels/_pool.h), where that is possible.

kernels/_decode.c (the decode attention, and the page selection that runs on its pool) and
kernels/_qmatmul.c are built with OpenMP where the compiler has it (setup.py). A process loads
one libgomp.so.1: torch's (its wheel ships it), which the kernels then share, so their
parallel calls run on the threads torch's ops run on, and no second team spins beside
torch's. `share_torch_openmp` checks that before turning it on: a thread count set through
torch must be the one the kernels' runtime sees (a torch built with another OpenMP, or
kernels built without one, keep their own threads).

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

import torch

try:
    from kernels import _decode
except ImportError:         # a checkout whose extensions are not built (`make setup` builds them)
    _decode = None
try:
    from kernels import _qmatmul
except ImportError:
    _qmatmul = None

_shared: bool | None = None


def share_torch_openmp() -> bool:
    """Run the C kernels' threaded calls on torch's OpenMP team where their runtime is
    torch's; returns whether they do (checked once a process)."""
    global _shared
    if _shared is None:
        mods = [m for m in (_decode, _qmatmul) if m is not None]
        n = torch.get_num_threads()
        torch.set_num_threads(n + 1)            # a count only this check sets
        try:
            seen = [m.pool_openmp(False) for m in mods]
        finally:
            torch.set_num_threads(n)
        _shared = bool(mods) and all(s == n + 1 for s in seen)
        for m in mods:
            m.pool_openmp(_shared)
    return _shared
