"""How a decode layer's KV stages are scheduled: sequential, SFC micro-batches, layer-ahead.

The stages of one layer (KVDrive, section 6): **select** the pages each sparse sequence needs
(score page summaries, top-k), **resolve** them against the device tier (hits keep their slot;
misses get a reserved slot, evicting clean pages, and are located on host or disk), **fetch**
the misses into their slots (host copy, disk read), then **compute** attention for the whole
batch. Modes (`--pipeline`):

- `sequential`: one stage after the other, the batch as one unit.
- `sfc`: sparse decodes and dense sequences (all of them in the dense first layers) split into
  micro-batches of `--micro-batch` sequences. The engine thread selects and resolves
  micro-batch i and hands its disk reads to the resolve thread (demotion copies and extent
  plan first, then issued at once), while the fetch thread fills i-1 (demotion copies, host
  copies, waiting for its reads; copies and reads run in C without the GIL). A micro-batch
  with nothing to fetch skips the fetch thread. The engine thread first attends to each
  micro-batch's pages the last step selected too (resident once the fetch ahead below is in),
  then to the rest as soon as its fetch is in (split attention: kernels/_decode.c goes on from
  the first half's state, so the bits are those of every mode). Projections and MLP run for
  the whole batch, as KVDrive's do; on a CPU attention has no batch efficiency to lose, so
  overlapping the fetch with it too pays (`sfc-whole` in bench/pipeline.py computes once every
  fetch of the layer is in, KVDrive's rule). `resolve_thread=True` resolves on its own thread
  (KVDrive's three stages; slower on 2 cores: 570 against 518 ms per step at bc83876).
  Bookkeeping (recency, write-back of full pages) runs on a stage thread while the engine
  thread goes on with the layer. Across layers (`reuse_ahead`, 1 layer by default), the pages
  the previous step selected in the next layer are fetched while this layer computes
  (kvstore/ahead.py), and room is made for the next layer's misses; it still selects exactly.
- `layer-ahead`: the model predicts layer l+1's queries from layer l's input (layer l+1's own
  q projection applied to it, as InfiniGen and KVSwap do); those pages are selected, resolved
  and fetched on the stage threads while layer l computes. Layer l+1 then selects exactly;
  pages the prediction missed are fetched before compute, so outputs stay exact.

For the same selections every mode attends to the same pages, so outputs are identical; only
which pages stay resident (and so what is fetched) differs.

Threading contract: tier bookkeeping (slot maps, residency, evictions, pins) is mutated by one
thread at a time: whichever thread resolves while a layer's pipeline runs, the engine thread
otherwise (`drain` waits for the stage threads before the engine thread touches the tiers).
The fetch thread moves data into slots reserved (and pinned) for it, from host slots pinned for
it, and unpins them when done (disjoint entries of the pin masks).

Metrics (kvstore.stats): `strata_stage_seconds{stage}` per stage per micro-batch, busy and
stall seconds (a stage waiting on the one before it). Stage functions and layer parts:
kvstore/stages.py; calibration of the micro-batch: kvstore/calibration.py; a layer's stages
one after the other: kvstore/sequential.py.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kernels.page_topk import SelectedPages, cat_selected
from kvstore.ahead import ReuseAhead, prefetch_predicted
from kvstore.calibration import MicroBatchCalibration
from kvstore.config import PIPELINES
from kvstore.fetcher import Fetcher
from kvstore.resolution import Resolution
from kvstore.sequential import run_sequential
from kvstore.stages import ComputeFn, LayerPart, LayerStages, filled, merge_sparse

logger = logging.getLogger(__name__)

_I64 = dict(dtype=torch.int64)
_THREAD_MODE = threading.local()


def _enter_inference_mode() -> None:
    """Stage threads run under torch.inference_mode for their whole life (the guard lives
    in a thread-local, so it is not collected when the initializer returns)."""
    _THREAD_MODE.guard = torch.inference_mode()
    _THREAD_MODE.guard.__enter__()


class Pipeline:
    """Schedules the stages of each layer (module docstring). One per KV store."""

    def __init__(self, tiers, fetcher: Fetcher, stats, mode: str = "sequential",
                 micro_batch: int = 0,
                 resolve_thread: bool = False, whole_batch_compute: bool = False,
                 reuse_ahead: int = 1):
        if mode not in PIPELINES:
            raise ValueError(f"--pipeline must be one of {', '.join(PIPELINES)} (got {mode!r})")
        if micro_batch < 0:
            raise ValueError(f"--micro-batch must be >= 0 (0: calibrate), got {micro_batch}")
        self.tiers = tiers                  # kvstore.tierset.TierSet (its public methods)
        self.fetcher = fetcher
        self.stats = stats
        self.mode = mode
        self.calibration = MicroBatchCalibration(micro_batch)
        # sfc: resolve on its own thread (three concurrent stages), or on the engine thread
        # right after each micro-batch's selection (two: select+resolve | fetch)
        self.resolve_thread = resolve_thread
        # sfc: compute attention once every fetch of the layer is in (KVDrive's rule) instead
        # of each micro-batch's as soon as its own fetch is in
        self.whole_batch_compute = whole_batch_compute
        # sfc: while layer l computes, fetch the pages of layer l + reuse_ahead that the last
        # step selected (0: off)
        self.ahead = ReuseAhead(self, reuse_ahead) if mode == "sfc" and reuse_ahead else None
        self._gate: Future | None = None         # the fill this layer's compute waits for
        self._resolver: ThreadPoolExecutor | None = None
        self._fetcher: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        self._predicted: tuple[int, Future] | None = None  # layer-ahead: (layer, fill job)
        self._resolver_free = 0.0                # when the resolve thread finished its last job
        self._step_mb = micro_batch

    # ------------------------------------------------------------------ threads
    def threads(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        if self._resolver is None:
            # NOTE: inference mode is per thread (in-place updates of the engine's buffers)
            self._resolver = ThreadPoolExecutor(1, thread_name_prefix="strata-resolve",
                                                initializer=_enter_inference_mode)
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="strata-fetch",
                                               initializer=_enter_inference_mode)
        return self._resolver, self._fetcher

    def close(self) -> None:
        self.drain()
        for ex in (self._resolver, self._fetcher):
            if ex is not None:
                ex.shutdown(wait=True)
        self._resolver = self._fetcher = None

    def drain(self, raise_errors: bool = True, keep_ahead: bool = False):
        """Wait for the stage threads' jobs (bookkeeping, prefetch); re-raise the first error
        of a bookkeeping job (else log it). Returns (layer, keys) of a finished layer-ahead
        prefetch, or None. Time waited counts as compute stall. `keep_ahead` (at the start of
        a layer): sfc's fetches ahead may go on; the layer's compute waits for them (`finish`)."""
        t0 = time.perf_counter()
        errors = []
        for f in self._pending:
            try:
                f.result()
            except Exception as exc:   # noqa: BLE001 - re-raised below, after every job ended
                errors.append(exc)
        self._pending.clear()
        if self.ahead is not None:
            self.ahead.collect()            # its resolve mutates the tiers: always waited for
            if not keep_ahead:      # a step ended (or failed) with fetches ahead in flight
                for job in self.ahead.fills() + [self._gate]:
                    if job is not None and (exc := self._settle_fill(job)[1]) is not None:
                        logger.debug("fetch ahead failed (an exact fetch retries): %s", exc)
                self._gate = None
        # NOTE: demotions a failed resolve recorded but no fill made (the engine thread may
        # write into the freed slots next)
        self.fetcher.demote()
        predicted = None
        if self._predicted is not None:
            layer, job = self._predicted
            res, exc = job.result()
            if exc is None:
                self.fetcher.arrived(res)
                predicted = (layer, res.keys)
            else:           # a prediction is only a hint
                self.fetcher.forget(res)
                logger.debug("layer-ahead prefetch failed (the exact fetch retries): %s", exc)
            self._predicted = None
        waited = time.perf_counter() - t0
        if waited > 1e-4:
            self.stats.add_stall("compute", waited)
        if errors:
            if raise_errors:
                raise errors[0]
            logger.warning("KV bookkeeping failed: %s", errors[0])
        return predicted

    # ------------------------------------------------------------------ step boundaries
    @property
    def micro_batch(self) -> int:
        """Sequences per sfc micro-batch: --micro-batch, or the calibrated size (0 until then)."""
        return self.calibration.chosen

    def begin_step(self, num_sparse: int, decode_only: bool = True) -> None:
        """Called by each StepKV: the micro-batch size of this step (`decode_only`: no prefill)."""
        if self.mode == "sfc":
            self._step_mb = self.calibration.begin(num_sparse, decode_only)

    def end_step(self) -> None:
        """Called once the step's forward is done (stage threads drained)."""
        self.calibration.end()

    def protected(self, keys: torch.Tensor) -> torch.Tensor:
        """`keys` and the pages fetched ahead for this layer and later ones: what a layer keeps
        resident (taken once per layer, before `run`)."""
        return torch.cat([keys] + self.ahead.held()) if self.ahead is not None else keys

    # ------------------------------------------------------------------ one layer
    def run(self, stages: LayerStages, dense_idx: list[int], sparse_idx: list[int],
            protect: torch.Tensor) -> list[LayerPart]:
        """Select and resolve one layer's pages, and fetch them (inline, or started on the fetch
        thread): the dense sequences dense_idx need every page, sparse decodes their selected
        pages; `protect` (`protected`) stays resident. Returns the layer's parts, for `finish`."""
        mb = self._step_mb if self.mode == "sfc" else 0
        ahead_keys = None
        if self.ahead is not None:          # this layer's compute waits for its pages fetched ahead
            ahead_keys, self._gate = self.ahead.take(stages.layer)
        if mb and max(len(sparse_idx), len(dense_idx)) > 1:
            parts = self._run_sfc(stages, dense_idx, sparse_idx, protect, mb)
        else:
            parts = run_sequential(self, stages, dense_idx, sparse_idx, protect)
        if self.ahead is not None and stages.step.sparse_idx:
            self.ahead.issue(stages, parts, protect, ahead_keys)
        return parts

    def finish(self, parts: list[LayerPart], compute: ComputeFn,
               compute_early: ComputeFn | None = None
               ) -> tuple[torch.Tensor, SelectedPages | None]:
        """Compute each part once its pages are in, in order (or, with whole_batch_compute, all
        of them once every fetch is in; else `compute_early` first runs the first half of
        `early` parts while their fills run); waiting counts as compute stall. After a failed
        fetch the remaining fetches are still waited for, then the first error is raised.
        Returns (device slots of every part's keys, in order; the sparse decodes' selection)."""
        waited, error = 0.0, None
        if self._gate is not None:              # this layer's pages fetched ahead
            t0 = time.perf_counter()
            error = self._settle_fill(self._gate)[1]
            self._gate = None
            waited = time.perf_counter() - t0
            if error is not None:
                waited += self._wait(parts)[0]
        if self.whole_batch_compute and error is None:
            w, error = self._wait(parts)
            waited += w
            if error is None:
                parts = merge_sparse(parts)
        early = compute_early if not self.whole_batch_compute and error is None else None
        try:
            for p in parts if early is not None else ():
                if p.early and p.filled is not None and not p.filled.done() \
                        and self._reused_in(p):
                    early(p)
            for k, p in enumerate(parts):
                if error is not None:
                    break
                if p.filled is not None:
                    w = time.perf_counter()
                    error = self._settle(p)
                    waited += time.perf_counter() - w
                    if error is not None:
                        waited += self._wait(parts[k + 1:])[0]
                        break
                compute(p)
        except BaseException:
            self._wait(parts)       # no fill left running, none left unsettled (settled: skipped)
            raise
        if waited > 1e-4:
            self.stats.add_stall("compute", waited)
        if error is not None:
            raise error
        sels = [p.sel for p in parts if p.sel is not None]
        slots = torch.cat([p.slots for p in parts]) if parts else torch.empty(0, **_I64)
        return slots, (cat_selected(sels) if sels else None)

    def _reused_in(self, part: LayerPart) -> bool:
        """Whether the pages of `part` the last step selected are in their slots now: a page
        it shares with an earlier micro-batch (a prefix page) may still be on its way there
        (its slot pinned until that fill is done); behind a copy stream, no early half."""
        if self.tiers.copies is not None:
            return False
        return not bool(self.tiers.device_pinned[part.slots[part.reused].long()].any())

    def _settle(self, part: LayerPart) -> BaseException | None:
        """Wait for a part's fill; set its slots, or (on an error) return the error."""
        res, exc = self._settle_fill(part.filled)
        part.filled = None
        if exc is None:
            part.slots = res.slots
        return exc

    def _settle_fill(self, filled: Future) -> tuple[Resolution | None, BaseException | None]:
        """Wait for a fill job: (its resolution, its error); after an error the unfilled slots
        are dropped."""
        res, exc = filled.result()
        if exc is None:
            self.fetcher.arrived(res)       # its copies, where a copy stream makes them
        else:
            # NOTE: a next layer's resolve may run meanwhile (one tier mutator at a time)
            wait([f for f in (self.ahead and self.ahead.resolving(),
                              self._predicted and self._predicted[1]) if f])
            self.fetcher.forget(res)
        return res, exc

    def _wait(self, parts: list[LayerPart]) -> tuple[float, BaseException | None]:
        """Wait for every fill of `parts`: (seconds waited, the first error or None)."""
        t0 = time.perf_counter()
        errors = [e for p in parts if p.filled is not None and (e := self._settle(p))]
        return time.perf_counter() - t0, (errors[0] if errors else None)

    def _run_sfc(self, stages, dense_idx, sparse_idx, protect_keys, mb):
        resolver, fetcher = self.threads()
        self._resolver_free = time.perf_counter()
        protect = [protect_keys]
        parts: list[LayerPart] = []

        def submit(idx, sel, keys: torch.Tensor) -> bool:     # False: its resolve failed
            part = LayerPart(idx, sel, keys)
            parts.append(part)
            if sel is not None:             # this and every earlier micro-batch stay resident
                protect.append(keys)
                part.reused = stages.reused(keys)
            if self.resolve_thread:
                res = resolver.submit(self._resolve_job, stages, keys, torch.cat(protect))
            else:                           # on the engine thread, right after selection
                try:
                    res = self._resolve_job(stages, keys, torch.cat(protect), reads=False)
                except Exception as exc:   # noqa: BLE001 - raised by finish, after the layer's jobs end
                    part.filled = filled(None, exc)
                    return False
                part.resolved(res)
                if res.misses == 0:         # every page resident: nothing to hand over
                    return True
                if res.disk_keys.numel() + res.input_keys.numel():   # reads: the resolve thread
                    res = resolver.submit(self._start_reads_job, stages, res)
            part.filled = fetcher.submit(self.fill_job, stages, res)
            return True

        # dense parts (every page known up front: all stay resident) compute while the next fetch
        dense = [dense_idx[c:c + mb] for c in range(0, len(dense_idx), mb)]
        protect.extend(dense_keys := [stages.dense_keys(idx) for idx in dense])
        if not all(submit(idx, None, keys) for idx, keys in zip(dense, dense_keys)):
            return parts
        for c in range(0, len(sparse_idx), mb):
            idx = sparse_idx[c:c + mb]
            sel, keys = stages.select_keys(idx)
            if not submit(idx, sel, keys):
                break
        return parts

    def _start_reads_job(self, stages, res: Resolution) -> Resolution:
        t0 = time.perf_counter()
        stages.start_reads(res)
        # NOTE: busy time of the micro-batch's resolve stage (observed once, by the resolve)
        self.stats.add_busy("resolve", time.perf_counter() - t0)
        return res

    def _resolve_job(self, stages, keys, protect, reads: bool = True) -> Resolution:
        t0 = time.perf_counter()
        stall = max(0.0, t0 - self._resolver_free) if self.resolve_thread else 0.0
        try:
            res = stages.resolve(keys, protect)
            if reads:
                stages.start_reads(res)     # the disk works while the next one is selected
            return res
        finally:
            t1 = time.perf_counter()
            self._resolver_free = t1
            self.stats.observe_stage("resolve", t1 - t0, stall)

    def fill_job(self, stages, res: Resolution | Future):
        """Fill one micro-batch (its resolution, or the job resolving it) -> (resolution or
        None, error or None); the engine thread handles errors once the layer's jobs end."""
        t0 = time.perf_counter()
        if isinstance(res, Future):
            try:
                res = res.result()
            except Exception as exc:   # noqa: BLE001 - the resolve failed: nothing to fill
                return None, exc
        t1 = time.perf_counter()
        try:
            stages.fill(res)
            return res, None
        except Exception as exc:   # noqa: BLE001
            return res, exc
        finally:
            self.stats.observe_stage("fetch", time.perf_counter() - t1, t1 - t0)

    # ------------------------------------------------------------------ overlapped work
    def prefetch(self, stages: LayerStages, q_pred: torch.Tensor, sparse_idx: list[int],
                 protect: torch.Tensor) -> None:
        """Layer-ahead: select layer `stages.layer`'s pages with predicted queries, resolve and
        fetch them on the stage threads (the caller's layer computes meanwhile; `protect`
        holds its pages); `drain` collects them."""
        self._predicted = (stages.layer,
                           prefetch_predicted(self, stages, q_pred, sparse_idx, protect))

    def overlap(self, job) -> None:
        """Bookkeeping `job` of a layer: inline when sequential, else on the resolve thread
        (overlapping the layer's rest; `drain` collects it)."""
        if self.mode == "sequential":
            job()
        else:
            self._pending.append(self.threads()[0].submit(job))
