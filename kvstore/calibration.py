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
Each batch size (rounded up to a power of two) is calibrated the first time the batch has it.
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


class _Run:
    """One batch size's calibration: candidates left to time, and the samples so far."""

    def __init__(self, num_sparse: int):
        cands = [c for c in CALIBRATION_CANDIDATES if c < num_sparse] + [num_sparse]
        self.samples: dict[int, list[float]] = {c: [] for c in cands}
        self.plan = [c for _ in range(CALIBRATION_STEPS) for c in cands]


class MicroBatchCalibration:
    """`begin` gives each step's micro-batch size; `end` closes the step's sample.

    Calibrated once per batch size, rounded up to a power of two (2, 4, 8, 16, ...): a server's
    batch grows and shrinks, and the size that wins at 4 sequences need not at 8. A size's
    calibration runs over its own steps (interleaved with other sizes' steps when the batch
    changes meanwhile); `chosen` is the choice for the last step's size, 0 while it calibrates."""

    def __init__(self, fixed: int = 0):
        self.fixed = fixed
        self.chosen = fixed                       # for the last step's batch size; 0: calibrating
        self.choices: dict[int, int] = {}         # batch size (power of two) -> micro-batch
        self._runs: dict[int, _Run] = {}
        self._run: _Run | None = None
        self._current = 0
        self._start = 0.0
        self._seqs = 0                            # > 0 while a sample is open

    def begin(self, num_sparse: int, decode_only: bool = True) -> int:
        """The micro-batch size for a step with `num_sparse` sparse decodes (0: none);
        `decode_only`: the step has no prefill chunk (only those are sampled)."""
        self._seqs = 0
        if self.fixed or num_sparse < 2:
            return self.chosen
        size = 1 << (num_sparse - 1).bit_length()
        if size in self.choices:
            self.chosen = self.choices[size]
            return self.chosen
        self.chosen = 0
        if not decode_only:
            return 0
        run = self._runs.setdefault(size, _Run(num_sparse))
        if run.plan:
            self._run, self._current = run, run.plan.pop(0)
            self._seqs = num_sparse
            self._start = time.perf_counter()
            return self._current
        best = {c: statistics.median(v) for c, v in run.samples.items() if v}
        self.chosen = self.choices[size] = min(best, key=best.get)
        del self._runs[size]
        logger.info("pipeline sfc: calibrated --micro-batch %d for %d-%d sequences (forward "
                    "time per sequence: %s)", self.chosen, size // 2 + 1, size,
                    ", ".join(f"{c}: {1e3 * t:.2f} ms" for c, t in sorted(best.items())))
        return self.chosen

    def end(self) -> None:
        """The step's forward is done (stage threads drained)."""
        if self._seqs and self._run is not None:
            self._run.samples[self._current].append(
                (time.perf_counter() - self._start) / self._seqs)
        self._seqs = 0
