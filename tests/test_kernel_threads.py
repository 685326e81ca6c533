"""The C kernels' threads on torch's OpenMP team (kernels/threads.py, kernels/_pool.h): the
same bits as on their own threads, the team torch's (a count set through torch is the one
the kernels see), and a forked child back on threads of its own."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kernels import threads
from kernels.page_table import PageTable
from kernels.sparse_attention import NativeSparseDecode, _decode

pytestmark = pytest.mark.skipif(_decode is None, reason="the C extensions are not built")


@pytest.fixture
def shared():
    """Whether this build shares torch's team; the pools back on it after each test."""
    on = threads.share_torch_openmp()
    yield on
    for m in (threads._decode, threads._qmatmul):
        if m is not None:
            m.pool_openmp(int(on))


def _attend(kernel, q, pool, table):
    return kernel.forward(q, pool, table, 3, 0.125)


def test_the_team_is_torchs_and_gives_the_same_bits(shared):
    if not shared:
        pytest.skip("the kernels are built without OpenMP, or torch has another runtime")
    n = torch.get_num_threads()
    torch.set_num_threads(n + 2)
    try:
        assert _decode.pool_openmp(1) == (1, n + 2)     # torch's count is the kernels' count
    finally:
        torch.set_num_threads(n)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(300, 2, 3, 16, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(5, 9, 64, generator=gen).to(torch.bfloat16)
    lens = [1000, 37, 530, 16, 1]
    counts = [3 * -(-n // 16) for n in lens]            # each sequence's 3 heads' rows
    indptr = torch.tensor([0] + [c // 3 for c in counts for _ in range(3)]).cumsum(0)
    table = PageTable(indptr.int(), torch.randint(0, 300, (int(indptr[-1]),),
                                                  generator=gen).int(),
                      torch.tensor([(n - 1) % 16 + 1 for n in lens for _ in range(3)]).int(),
                      16)
    kernel = NativeSparseDecode()
    kernel.threads = 2
    on_team = _attend(kernel, q, pool, table)
    _decode.pool_openmp(0)
    own = _attend(kernel, q, pool, table)
    kernel.threads = 1
    one = _attend(kernel, q, pool, table)
    assert torch.equal(on_team, own) and torch.equal(on_team, one)


def test_a_forked_child_runs_the_kernel_on_threads_of_its_own(shared):
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(64, 2, 3, 16, 64, generator=gen)
    q = torch.randn(2, 9, 64, generator=gen)
    table = PageTable(torch.tensor([0, 40, 80, 120, 125, 130, 135]).int(),
                      torch.randint(0, 64, (135,), generator=gen).int(),
                      torch.tensor([16, 16, 16, 3, 3, 3]).int(), 16)
    kernel = NativeSparseDecode()
    kernel.threads = 2
    want = _attend(kernel, q, pool, table)              # the parent's team (or pool) in use
    pid = os.fork()
    if pid == 0:        # the child: exit status 0 only if on its own threads it computes the same
        try:
            own = _decode.pool_openmp(-1)[0] == 0 and not threads.share_torch_openmp()
            os._exit(0 if own and torch.equal(_attend(kernel, q, pool, table), want) else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60         # a child hung on its parent's team fails, late
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0
