"""CoreSplit (engine/core_split.py): each decode step shape times both splits of the cores in
turns, then keeps the faster; and the engine hands a decode step the split's threads."""
from __future__ import annotations

import pytest
import torch

from engine.core_split import CoreSplit
from kernels.threads import share_torch_openmp


def run(split: CoreSplit, rows: int, tokens: int, cost: dict, steps: int) -> list:
    """`steps` decode steps of one shape, each taking cost[split] seconds: the splits used."""
    used = []
    for _ in range(steps):
        s = split.choose(rows, tokens)
        used.append(s)
        split.observe(cost[s])
    return used


def test_each_shape_times_both_splits_then_keeps_the_faster():
    split = CoreSplit(cores=2, decode=1, probes=3, warmup=2, settle=1)
    matmul, attention = (2, 1), (1, 2)
    assert split.timing_steps == 2 + 1 + (1 + 3) + (1 + 2)
    used = run(split, 1, 1000, {matmul: 0.010, attention: 0.013}, 14)
    # runs A, B, A: warmup and A's first probe, then B settles and probes, then A again
    assert used[:10] == [matmul] * 3 + [attention] * 4 + [matmul] * 3
    assert used[10:] == [matmul] * 4
    # another shape decides on its own: many rows over a long context, the attention wins
    used = run(split, 8, 64000, {matmul: 0.040, attention: 0.034}, 12)
    assert used[10:] == [attention] * 2
    assert split.decided() == {CoreSplit.shape(1, 1000): matmul,
                               CoreSplit.shape(8, 64000): attention}


def test_on_torchs_openmp_team_the_first_split_gives_both_every_core():
    split = CoreSplit(cores=4, decode=3, shared=True)
    assert split.splits == ((4, 4), (3, 4))
    assert CoreSplit(cores=4, decode=3).splits == ((4, 1), (3, 4))


def test_the_median_decides_not_one_outlier():
    split = CoreSplit(cores=4, decode=3, probes=3, warmup=0, settle=0)
    # A BBB AA: the matmul split's steps 0.010, 0.500 (one slow step), 0.010
    times = iter([0.010, 0.012, 0.012, 0.012, 0.500, 0.010])
    for _ in range(6):
        split.choose(2, 3000)
        split.observe(next(times))
    assert split.choose(2, 3000) == (4, 1)


def test_the_steps_just_after_a_switch_are_not_timed():
    """A split's first steps after the other's are slow (its threads wake, the other's still
    spin): they settle untimed, and the split that is faster once settled wins."""
    split = CoreSplit(cores=2, decode=1, probes=2, warmup=0, settle=2)
    matmul, attention = (2, 1), (1, 2)
    last, since = None, 0
    for _ in range(split.timing_steps):
        s = split.choose(1, 7000)
        since = since + 1 if s == last else 0
        last = s
        # the attention's split: 16 ms settled, 24 ms in the two steps after a switch
        split.observe(0.019 if s == matmul else 0.024 if since < 2 else 0.016)
    assert split.decided() == {CoreSplit.shape(1, 7000): attention}


def test_close_shapes_share_a_decision_and_far_ones_do_not():
    assert CoreSplit.shape(1, 1000) == CoreSplit.shape(1, 1100) == CoreSplit.shape(1, 4000)
    assert CoreSplit.shape(1, 1000) != CoreSplit.shape(1, 7000)
    assert CoreSplit.shape(1, 1000) != CoreSplit.shape(2, 2000)
    assert CoreSplit.shape(8, 8000) == CoreSplit.shape(8, 8200)     # 1K tokens a row
    assert CoreSplit.shape(9, 1000) == CoreSplit.shape(16, 1000)


def test_a_shape_is_timed_again_every_period_steps():
    # the load changed: the attention's split got faster, and the next timing finds it
    split = CoreSplit(cores=2, decode=1, probes=2, period=10, warmup=0, settle=0)
    matmul, attention = (2, 1), (1, 2)
    used = run(split, 1, 1000, {matmul: 0.010, attention: 0.013}, 14)
    assert used[4:14] == [matmul] * 10
    used = run(split, 1, 1000, {matmul: 0.010, attention: 0.008}, 6)
    assert sorted(used[:4]) == [attention, attention, matmul, matmul]
    assert used[4:] == [attention] * 2


@pytest.mark.slow
def test_the_engine_runs_decode_steps_on_the_chosen_split(smollm2_dir):
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests.engine_helpers import greedy

    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), kv_device_gb=0.1, prefix_cache="off"))
    engine.use_threads(2, 1)
    assert engine.core_split is not None
    seen = []
    kernel = engine.store.sparse_attention
    execute = engine.runner.execute

    def spy(batch, requests):
        # the page selection shares the attention's pool and threads
        assert engine.store.selection.threads == kernel.threads
        seen.append((batch.decode_only, torch.get_num_threads(), kernel.threads))
        return execute(batch, requests)

    engine.runner.execute = spy
    engine.add_request("r", list(range(100, 400)), greedy(20))
    while engine.has_unfinished():
        engine.step()
    decided = engine.core_split.decided()
    assert len(decided) == 1
    (torch_threads, kernel_threads), = decided.values()
    assert seen[0] == (False, 2, 2)         # the prefill: every core, the attention's default
    assert seen[-1] == (True, torch_threads, kernel_threads)
    # torch on both cores and the attention on both too where they share torch's OpenMP
    # team (kernels/threads.py), else on one
    both = 2 if share_torch_openmp() else 1
    assert {s[1:] for s in seen[3:3 + engine.core_split.timing_steps]} == {(2, both), (1, 2)}
    fixed = LLMEngine(EngineArgs(model=str(smollm2_dir), kv_device_gb=0.1, prefix_cache="off",
                                 decode_threads=1))
    fixed.use_threads(2, 1)
    assert fixed.core_split is None         # --decode-threads: the user's choice


def test_a_plan_without_probes_is_refused():
    with pytest.raises(ValueError, match="probes"):
        CoreSplit(cores=2, decode=1, probes=0)


def test_timed_again_the_other_split_takes_over_only_by_a_margin():
    """Re-timing on a noisy machine: 2% faster is noise and keeps the choice, 10% switches."""
    split = CoreSplit(cores=2, decode=1, probes=2, period=10, warmup=0, settle=0, margin=0.05)
    matmul, attention = (2, 1), (1, 2)
    run(split, 1, 1000, {matmul: 0.010, attention: 0.013}, 4)
    assert split.decided() == {CoreSplit.shape(1, 1000): matmul}
    run(split, 1, 1000, {matmul: 0.010, attention: 0.013}, 10)     # then timed again
    used = run(split, 1, 1000, {matmul: 0.010, attention: 0.0098}, 14)
    assert used[4:] == [matmul] * 10
    used = run(split, 1, 1000, {matmul: 0.010, attention: 0.0090}, 6)
    assert used[4:] == [attention] * 2
