"""Micro-batch size of the SFC pipeline when `--micro-batch` is not given.

KVDrive (section 6.2) picks it with "a short pre-run calibration" over a limited set of
candidates: too large and the stages barely overlap, too small and per-call costs dominate.
Here the first decode-only steps (no prefill chunk beside the decodes: a chunk's time would
swamp the sample) with at least two sparse sequences try each candidate (1, 2, 4, 8, 16
sequences, and the whole batch: one micro-batch, what wins when there is little to fetch) for
CALIBRATION_STEPS steps, interleaved (the first steps after a prefill drift as residency
settles, and that must not favour one candidate). A sample is the whole forward of the step per
sparse sequence, since the size changes more than the KV stages; the candidate with the lowest
median wins and is logged. Steps with a prefill chunk before that run without micro-batches.
"""
from __future__ import annotations

import logging
import statistics
import time

logger = logging.getLogger(__name__)

CALIBRATION_CANDIDATES = (1, 2, 4, 8, 16)
# decode steps timed per candidate (median taken); 3 let this shared 2-core box's noise pick
# micro-batch 8 over 4 in two of four bench/pipeline.py runs where 4 was faster
CALIBRATION_STEPS = 5


class MicroBatchCalibration:
    """`begin` gives each step's micro-batch size; `end` closes the step's sample."""

    def __init__(self, fixed: int = 0):
        self.chosen = fixed                       # 0 until calibrated
        self._samples: dict[int, list[float]] = {}
        self._plan: list[int] = []
        self._current = 0
        self._start = 0.0
        self._seqs = 0                            # > 0 while a sample is open

    def begin(self, num_sparse: int, decode_only: bool = True) -> int:
        """The micro-batch size for a step with `num_sparse` sparse decodes (0: none);
        `decode_only`: the step has no prefill chunk (only those are sampled)."""
        self._seqs = 0
        if self.chosen or num_sparse < 2 or not decode_only:
            return self.chosen
        if not self._plan and not self._samples:
            cands = [c for c in CALIBRATION_CANDIDATES if c < num_sparse] + [num_sparse]
            self._samples = {c: [] for c in cands}
            self._plan = [c for _ in range(CALIBRATION_STEPS) for c in cands]
        if self._plan:
            self._current = self._plan.pop(0)
            self._seqs = num_sparse
            self._start = time.perf_counter()
            return self._current
        best = {c: statistics.median(v) for c, v in self._samples.items() if v}
        self.chosen = min(best, key=best.get)
        logger.info("pipeline sfc: calibrated --micro-batch %d (forward time per sequence: "
                    "%s)", self.chosen,
                    ", ".join(f"{c}: {1e3 * t:.2f} ms" for c, t in sorted(best.items())))
        return self.chosen

    def end(self) -> None:
        """The step's forward is done (stage threads drained)."""
        if self._seqs:
            self._samples[self._current].append(
                (time.perf_counter() - self._start) / self._seqs)
        self._seqs = 0
