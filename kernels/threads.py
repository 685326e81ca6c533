"""The C kernels' threads on torch's OpenMP team (kernels/_pool.h), where that is possible.

kernels/_decode.c (the decode attention, and the page selection that runs on its pool) and
kernels/_qmatmul.c are built with OpenMP where the compiler has it (setup.py). A process loads
one libgomp.so.1: torch's (its wheel ships it), which the kernels then share, so their
parallel calls run on the threads torch's ops run on, and no second team spins beside
torch's. `share_torch_openmp` checks that before turning it on: two thread counts set through
torch must be the ones the kernels' runtime sees (a torch built with another OpenMP, or
kernels built without one, keep their own threads). A forked child does not share its
parent's team: the kernels' pools go back to their own threads there (kernels/_pool.h), and
this module's answer to False.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

import os

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
        n, same = torch.get_num_threads(), bool(mods)
        try:
            for probe in (n + 1, n + 2):        # counts only this check sets; two, so that
                torch.set_num_threads(probe)    # another runtime's default cannot match both
                same &= all(m.pool_openmp(0)[1] == probe for m in mods)
        finally:
            torch.set_num_threads(n)
        _shared = same
        for m in mods:
            m.pool_openmp(int(_shared))
    return _shared


def _after_fork_in_child() -> None:
    global _shared
    _shared = False         # the C pools turned theirs off (their own threads from now on)


os.register_at_fork(after_in_child=_after_fork_in_child)
