"""Who gets the cores in a decode step: torch's matmuls, or the C decode attention.

Both run pools of threads that spin between calls: torch's OpenMP workers after each op, the
C kernel's (kernels/_pool.h) after each layer's attention. With both on every core each pool's
threads take the other's cores, and a step is slower than with either alone (2-core AMD EPYC
with AVX-512, 1 x 1K tokens: 13.8 ms against 10.1 or 12.7). Which one should have them depends
on the step: at 1 x 1K the weights are most of the bytes a step reads (torch on both cores,
the attention on one: 10.1 ms, against 12.7 the other way round), at 8 x 1K the KV is (35
against 37 ms the other way round), and the crossover moves with the CPU, the weights' format
and the server's own threads. So each step shape (rows, and context tokens a row in log2
buckets of 4K) times both splits over its first steps, in turns, and keeps the one with the
lower median; it times them again every `period` steps (contexts grow, the load changes).
The first steps after a switch are slower than the split's own (1 x 7K tokens: 20.8-25.6 ms,
then 16.1, a pool's threads still spinning or asleep from the other split), so the turns are
runs of steps whose first `settle` steps are not timed.

Where the C kernels run on torch's own OpenMP team (kernels/threads.py: one libgomp in the
process, the usual case) there is no second pool to spin beside torch's: the first split
then gives both every core (2-core AMD EPYC with AVX-512, in-process: 1 x 1K dense 8.5 ->
7.8 ms a step, 8 x 7K sparse 44.7 -> 35.3, against the split; docs/perf-notes.md), and the
second, torch a core short, stays for the server's threads (timed as before).
"""
from __future__ import annotations

import logging
import statistics

logger = logging.getLogger(__name__)

# a split: (torch threads, C attention threads)
Split = tuple[int, int]


class CoreSplit:
    def __init__(self, cores: int, decode: int, probes: int = 4, period: int = 1024,
                 warmup: int = 2, settle: int = 2, margin: float = 0.05,
                 shared: bool = False):
        """cores: every core the engine may use; decode: torch's threads when the attention
        has the cores (one left to the server's threads); shared: the attention runs on
        torch's own OpenMP team (kernels/threads.py), so the first split gives both every
        core (torch's matmuls, then the attention, on the same threads) rather than the
        attention one. A shape's first `warmup` steps are
        not timed (a fresh server's first steps fault its pages in), then the splits run
        `probes` timed steps each in runs A, B, A (half of A's before B's, half after: a drift
        in step time weighs on both alike), each run after a switch starting with `settle`
        untimed steps; period: steps of a shape before it is timed again, when the other
        split takes over only if `margin` faster (noise on a shared machine does not flip a
        choice for another `period` steps)."""
        if probes < 1 or warmup < 0 or settle < 0:
            raise ValueError(f"CoreSplit needs probes >= 1 and warmup, settle >= 0 (got "
                             f"{probes}, {warmup}, {settle})")
        self.splits: tuple[Split, Split] = ((cores, cores if shared else 1), (decode, cores))
        self.period, self.margin = period, margin
        first = probes // 2
        # (split, timed) of each step of a shape's timing
        self._plan = [(0, False)] * warmup + [(0, True)] * first
        for which, n in ((1, probes), (0, probes - first)):
            self._plan += [(which, False)] * settle + [(which, True)] * n
        self._timing: dict[tuple[int, int], list[tuple[int, bool, float]]] = {}
        self._chosen: dict[tuple[int, int], Split] = {}
        self._runs: dict[tuple[int, int], int] = {}     # steps since the shape's choice
        self._previous: dict[tuple[int, int], int] = {}  # the choice a shape is timed again from
        self._pending: tuple[tuple[int, int], int, bool] | None = None

    @staticmethod
    def shape(rows: int, context_tokens: int) -> tuple[int, int]:
        """A step's shape: rows as they are up to 4 then in log2 buckets, and the context
        tokens a row attends to in log2 buckets of 4K (a request's context crosses a bucket's
        edge rarely: each crossing times the splits again)."""
        return (rows if rows <= 4 else 4 + (rows - 1).bit_length(),
                (context_tokens // max(rows, 1) // 4096).bit_length())

    def choose(self, rows: int, context_tokens: int) -> Split:
        """The split for a decode step of this shape (`observe` then takes its time)."""
        key = self.shape(rows, context_tokens)
        chosen = self._chosen.get(key)
        if chosen is not None:
            self._pending = None
            self._runs[key] += 1
            if self._runs[key] >= self.period:      # time the splits again from the next step
                self._previous[key] = self.splits.index(self._chosen.pop(key))
            return chosen
        which, timed = self._plan[len(self._timing.setdefault(key, []))]
        self._pending = (key, which, timed)
        return self.splits[which]

    def observe(self, seconds: float) -> None:
        """The wall time of the step `choose` last planned (ignored once a shape is decided)."""
        if self._pending is None:
            return
        key, which, timed = self._pending
        self._pending = None
        timing = self._timing[key]
        timing.append((which, timed, seconds))
        if len(timing) == len(self._plan):
            medians = [statistics.median(t for w, on, t in timing if on and w == i)
                       for i in (0, 1)]
            best = 0 if medians[0] <= medians[1] else 1
            prev = self._previous.pop(key, None)
            if prev is not None and best != prev and \
                    medians[best] > (1 - self.margin) * medians[prev]:
                best = prev             # timed again: the other split must win by the margin
            self._chosen[key] = self.splits[best]
            self._runs[key] = 0
            del self._timing[key]
            logger.info("decode steps of shape %s: torch on %d threads and the attention on "
                        "%d (%.1f ms a step, against %.1f the other way)", key,
                        *self.splits[best], 1e3 * medians[best], 1e3 * medians[1 - best])

    @property
    def timing_steps(self) -> int:
        """Steps a shape takes to decide (the first `choose`s of a new shape)."""
        return len(self._plan)

    def decided(self) -> dict[tuple[int, int], Split]:
        """Shape -> the split it runs with (the shapes timed so far, but those being timed
        again)."""
        return dict(self._chosen)
