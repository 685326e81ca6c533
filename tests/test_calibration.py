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
