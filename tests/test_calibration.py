"""The SFC micro-batch calibration (kvstore/calibration.py), driven step by step: what it
samples, which candidates it tries, and that it settles on the fastest."""
from __future__ import annotations

import time

from kvstore.calibration import CALIBRATION_STEPS, MicroBatchCalibration


def step(cal: MicroBatchCalibration, num_sparse: int, decode_only: bool = True,
         slow: set[int] = frozenset()) -> int:
    mb = cal.begin(num_sparse, decode_only)
    # NOTE: a 20x gap between the sizes, so the box's noise cannot flip the order
    time.sleep(0.02 if mb in slow else 0.001)
    cal.end()
    return mb


def test_prefill_steps_are_not_sampled_and_run_without_micro_batches():
    cal = MicroBatchCalibration()
    assert step(cal, 8, decode_only=False) == 0          # a prefill chunk beside the decodes
    assert step(cal, 1) == 0                              # one sparse sequence: nothing to split
    tried = [step(cal, 8) for _ in range(4 * CALIBRATION_STEPS)]
    assert step(cal, 8, decode_only=False) == 0           # mid-calibration: still not sampled
    assert sorted(set(tried)) == [1, 2, 4, 8]             # 8: the whole batch, one micro-batch
    assert all(tried.count(c) == CALIBRATION_STEPS for c in (1, 2, 4, 8))
    assert tried[:4] == [1, 2, 4, 8]                      # interleaved, not one after another


def test_the_fastest_candidate_wins_and_stays():
    for fastest in (2, 5):
        cal = MicroBatchCalibration()
        slow = {1, 2, 4, 5} - {fastest}
        while not cal.chosen:
            step(cal, 5, slow=slow)
        assert cal.chosen == fastest                      # 5 = the whole batch of 5
        assert step(cal, 8) == fastest and step(cal, 8, decode_only=False) == fastest


def test_a_given_micro_batch_is_never_calibrated():
    cal = MicroBatchCalibration(3)
    assert [step(cal, 8) for _ in range(3)] == [3, 3, 3]
    assert step(cal, 8, decode_only=False) == 3


def test_each_batch_size_is_calibrated_once_and_keeps_its_choice():
    """A batch that grows past a power of two calibrates again (the size that wins at 4
    sequences need not at 8); a size seen before keeps its choice, also when the batch moves
    between sizes while one of them is calibrating."""
    cal = MicroBatchCalibration()
    while not cal.chosen:
        step(cal, 4, slow={1, 4})                         # 2 wins at 3-4 sequences
    assert cal.chosen == 2 and cal.choices == {4: 2}
    tried = {step(cal, 7, slow={1, 2, 7}) for _ in range(3)}   # 5-8 sequences: calibrating
    assert cal.chosen == 0 and tried <= {1, 2, 4, 7}
    assert step(cal, 3) == 2 and cal.chosen == 2         # back to 3-4: its choice, no sampling
    while 8 not in cal.choices:
        step(cal, 7, slow={1, 2, 7})
    assert cal.chosen == 4 and cal.choices == {4: 2, 8: 4}
    assert step(cal, 4) == 2 and step(cal, 8) == 4 and step(cal, 8, decode_only=False) == 4
    assert step(cal, 1) == 4                              # one sequence: nothing to split


def test_a_prefill_step_of_a_new_size_runs_whole_and_is_not_sampled():
    cal = MicroBatchCalibration()
    while not cal.chosen:
        step(cal, 2, slow={2})
    assert step(cal, 6, decode_only=False) == 0 and cal.chosen == 0
    assert step(cal, 2) == 1
