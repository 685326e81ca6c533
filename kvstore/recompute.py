"""KV recompute (KVPR): read a share of a fill's disk pages as the layer inputs their K/V were
computed from, and recompute those K/V while the rest are read as K/V.

A page's layer inputs are [page_size, hidden] values (the hidden states after the layer's
input norm); its K/V are [2, kv_heads, page_size, head_dim]. When the inputs are the smaller
(multi-head attention: hidden = kv_heads x head_dim, half the K/V), reading s of a fill's n
pages as inputs moves fewer bytes, at the price of recomputing their K/V (x W_k, x W_v, RoPE at
the pages' positions). KVPR's cost model (Eq. 10), per fill:

    t(s) = a s + max(c s, d (n - s))

a, d: seconds to read one page's inputs, one page's K/V (the inputs are read first); c:
seconds to recompute one page. While c s < d (n - s) more recompute shortens the step; the
best s is the crossover n d / (c + d), rounded to whichever neighbour is faster, and 0 when
a >= d (the inputs are no smaller: every GQA model with hidden >= 2 kv_heads head_dim, the
bundled SmolLM2 among them). a and d come from a read probe of the disk folder at start-up, c
from timing the model's own K/V projection then; afterwards all three follow what the fills
measure (reads from issue to completion, the recompute itself): the start-up probe is not the
fills' I/O (io_uring, 64 extents in flight), nor the decode step's threads the start-up's. A
split predicted to save under MIN_GAIN of the fill is not taken.

`--kv-recompute auto` plans every fill so; a number in [0, 1] recomputes that share of every
fill (A/B runs, tests); `off` stores no inputs.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kvstore.tiers.base import PageShape, round_up
from kvstore.tiers.errors import TierError
from kvstore.tiers.direct_io import read_seconds_per_byte

logger = logging.getLogger(__name__)

# (layer, inputs [N, hidden], positions [N]) -> (k, v) [N, kv_heads, head_dim]
KVFromInputs = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
PROBE_PAGES = 32          # pages recomputed per timing at start-up
PLAN_PAGES = 64           # the fill size whose split decides whether recompute is on at all
# a split predicted to save less than this share of a fill is not taken: below it the
# estimates' error (and the recompute's fixed costs) can turn the gain into a loss
MIN_GAIN = 0.05


@dataclass(frozen=True)
class RecomputeCost:
    """Seconds per page of a fill: reading its inputs (a), its K/V (d), recomputing it (c)."""
    input_page_s: float
    kv_page_s: float
    compute_page_s: float

    def seconds(self, n: int, s: int) -> float:
        """Predicted fill time of n disk pages, s of them recomputed (KVPR's Eq. 10)."""
        return self.input_page_s * s + max(self.compute_page_s * s, self.kv_page_s * (n - s))

    def split(self, n: int, min_gain: float = 0.0) -> int:
        """The s in [0, n] with the least predicted time (the smaller s on a tie); 0 unless
        it saves at least `min_gain` of the all-K/V time."""
        if n <= 0 or self.input_page_s >= self.kv_page_s:
            return 0
        x = n * self.kv_page_s / (self.compute_page_s + self.kv_page_s)
        cands = sorted({0, min(n, math.floor(x)), min(n, math.floor(x) + 1)})
        s = min(cands, key=lambda s: self.seconds(n, s))
        return s if self.seconds(n, s) <= (1 - min_gain) * self.seconds(n, 0) else 0


@dataclass(frozen=True)
class RecomputePlan:
    cost: RecomputeCost
    share: float | None           # a fixed share of every fill (None: the cost model's split)
    input_stride: int             # bytes of a page of inputs on disk (512-aligned)
    kv_stride: int                # bytes of a page of K/V on disk (the codec's codes with one)
    hidden: int                   # values of a token's inputs
    fn: KVFromInputs              # the model's K/V projection

    def input_bytes(self, disk_bytes: int) -> int:
        """The inputs' part of a disk budget: in proportion to their pages' bytes."""
        return -(-disk_bytes * self.input_stride // (self.kv_stride + self.input_stride))


def measure_compute(fn: KVFromInputs, page_size: int, hidden: int, dtype: torch.dtype) -> float:
    """Seconds to recompute one page's K/V: the best of 5 timings over PROBE_PAGES pages."""
    x = torch.randn(PROBE_PAGES * page_size, hidden).to(dtype)
    pos = torch.arange(PROBE_PAGES * page_size) % page_size     # within any model's positions
    for _ in range(2):                              # warm (first-call allocations, kernels)
        fn(0, x, pos)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn(0, x, pos)
        best = min(best, time.perf_counter() - t0)
    return best / PROBE_PAGES


def plan_recompute(mode: str, page_shape: PageShape, kv_page_bytes: int, hidden: int,
                   fn: KVFromInputs | None, disk_root, on_cpu: bool) -> RecomputePlan | None:
    """Whether fills recompute, decided once at start-up and logged with its reason. mode:
    "off", "auto" or a share; kv_page_bytes: a K/V page on disk (the codec's codes with one)."""
    if mode == "off":
        return None
    why = None
    if disk_root is None:
        why = "no disk tier (nothing is fetched from disk)"
    elif fn is None or hidden <= 0 or hidden % 2:
        why = "the model gives no K/V projection to recompute with"
    elif not on_cpu:
        why = "the GPU path does not recompute yet"
    if why:
        logger.info("KV recompute (KVPR) off: %s", why)
        return None
    input_bytes = page_shape.page_size * hidden * page_shape.dtype.itemsize
    stride = round_up(input_bytes, 512)
    share = None if mode == "auto" else float(mode)
    if share is None and stride >= kv_page_bytes:
        logger.info("KV recompute (KVPR) off, split 0: a page's layer inputs (%d bytes on disk, "
                    "%d values a token) are no smaller than its K/V (%d bytes), so reading "
                    "them instead would move more bytes, not fewer", stride, hidden,
                    kv_page_bytes)
        return None
    spb = read_seconds_per_byte(disk_root)
    comp = measure_compute(fn, page_shape.page_size, hidden, page_shape.dtype)
    cost = RecomputeCost(stride * spb, kv_page_bytes * spb, comp)
    s = cost.split(PLAN_PAGES, MIN_GAIN)
    logger.info("KV recompute (KVPR): disk %.2f GB/s, a page's inputs %d bytes (%.1f us), its "
                "K/V %d bytes (%.1f us), recomputing it %.1f us: of %d pages a fill recomputes "
                "%d (predicted %.0f%% of the all-K/V read time)%s", 1e-9 / spb, stride,
                cost.input_page_s * 1e6, kv_page_bytes, cost.kv_page_s * 1e6, comp * 1e6,
                PLAN_PAGES, s, 100 * cost.seconds(PLAN_PAGES, s) / cost.seconds(PLAN_PAGES, 0),
                "" if share is None else f"; fixed share {share:g} asked")
    if share is None and s == 0:
        logger.info("KV recompute (KVPR) off: recomputing is slower than reading on this "
                    "machine")
        return None
    return RecomputePlan(cost, share, stride, kv_page_bytes, hidden, fn)


def joined(a: Future, b: Future) -> Future:
    """A future done when both are, with a's outcome (b's error is b's own business: a page
    whose inputs failed to write is absent from the sidecar, and is read as K/V)."""
    out: Future = Future()
    lock = threading.Lock()

    def check(_: Future) -> None:
        with lock:          # both may complete at once, on two I/O threads
            if not (a.done() and b.done()) or out.done():
                return
            if a.exception() is not None:
                out.set_exception(a.exception())
            else:
                out.set_result(None)
    a.add_done_callback(check)
    b.add_done_callback(check)
    return out


class Recompute:
    """Partial recompute wired to the tiers: holds the layer inputs of pages being written
    (by device slot, until they are written beside the K/V), plans each fill's split, reads
    the chosen pages' inputs and rebuilds their K/V in their device slots."""

    def __init__(self, plan: RecomputePlan, page_size: int, slots: int, max_pages: int,
                 inputs):
        """inputs: the disk tier's sidecar of inputs (kvstore/tiers/disk_inputs.py)."""
        self.plan, self.cost = plan, plan.cost
        self._fn = plan.fn
        self.page_size, self.hidden = page_size, plan.hidden
        self.max_pages = max_pages
        self.inputs = inputs
        self.shape = inputs.page_shape
        # [slots] pages in the sidecar's geometry; `_rows` views them as [slots, ps, hidden]
        self.pool = torch.zeros(slots, *self.shape.shape, dtype=self.shape.dtype)
        self._rows = self.pool.view(slots, self.page_size, self.hidden)
        self.page_bytes = plan.input_stride
        # keys whose stored inputs failed to read back: read as K/V from then on
        self._bad = np.zeros(inputs.max_keys, dtype=bool)
        logger.info("KV recompute: layer inputs of pages being written %.0f MiB (beside the "
                    "device tier)", self.pool.numel() * self.pool.element_size() / 2**20)

    def keep(self, slots: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
        """This step's inputs x [T, hidden] of tokens at (device slot, offset) [T]."""
        self._rows[slots, offsets] = x.to(self._rows.dtype)

    def write_beside(self, keys: torch.Tensor, slots: torch.Tensor, written: Future
                     ) -> tuple[Future, torch.Tensor | None]:
        """Start writing the inputs of full pages (keys, in device slots) whose K/V write is
        `written`; returns the future of both (the K/V write's outcome: pages whose inputs
        fail to write are read as K/V) and the inputs written from (keep them alive until
        it is done; None when the inputs' write could not start)."""
        try:
            pages = self.pool[slots.long()]
            return joined(written, self.inputs.put_async(keys, pages)), pages
        except Exception:   # noqa: BLE001 - without inputs the pages are read as K/V
            logger.exception("KV recompute: writing layer inputs failed")
            return written, None

    def choose(self, keys: torch.Tensor) -> torch.Tensor:
        """bool [n]: which of a fill's disk pages to recompute (only pages whose inputs are
        stored: pages restored after a restart have none)."""
        n = keys.numel()
        avail = self.inputs.contains(keys) & ~torch.from_numpy(self._bad[keys.numpy()])
        s = self.cost.split(n, MIN_GAIN) if self.plan.share is None \
            else round(self.plan.share * n)
        s = min(s, int(avail.sum()))
        pick = torch.zeros(n, dtype=torch.bool)
        if s > 0:
            pick[avail.nonzero().squeeze(1)[:s]] = True
        return pick

    def read(self, keys: torch.Tensor) -> tuple[Future, torch.Tensor]:
        """Start reading the inputs of pages keys; returns (future, the buffer they land in)."""
        buf = torch.empty(keys.numel(), *self.shape.shape, dtype=self.shape.dtype)
        fut = self.inputs.get_async(keys, buf)
        self._time(fut, "input_page_s", keys.numel())
        return fut, buf

    def time_reads(self, fut: Future, pages: int) -> None:
        """A fill's K/V reads, issued now: their time steers kv_page_s."""
        self._time(fut, "kv_page_s", pages)

    def _time(self, fut: Future, field: str, pages: int) -> None:
        t0 = time.perf_counter()

        def done(f: Future) -> None:
            if f.exception() is None:
                self.observe(field, pages, time.perf_counter() - t0)
        fut.add_done_callback(done)

    def rebuild(self, keys: torch.Tensor, reading: tuple[Future, torch.Tensor],
                pool: torch.Tensor, slots: torch.Tensor, kv_disk) -> bool:
        """Wait for the inputs of pages keys (one layer) and write their recomputed K/V into
        pool[slots] ([S, 2, kv_heads, ps, head_dim]); the cost model's c follows the time.
        Inputs that cannot be read (an I/O error, a checksum) are no loss: those pages are
        read as K/V from `kv_disk` instead, now and from then on (returns False)."""
        fut, buf = reading
        try:
            fut.result()
        except TierError as exc:
            logger.warning("KV recompute: %d pages' layer inputs unreadable (%s); reading "
                           "their K/V instead", keys.numel(), exc)
            self._bad[keys.numpy()] = True
            kv_disk.get_into(keys, pool, slots).result()
            return False
        t0 = time.perf_counter()
        n, ps = keys.numel(), self.page_size
        layers = keys // self.max_pages
        layer = int(layers[0])
        if bool((layers != layer).any()):
            raise ValueError("recompute: a fill's pages span several layers")
        index = self.inputs.page_indices(np.asarray(keys % self.max_pages))
        pos = (torch.from_numpy(index)[:, None] * ps + torch.arange(ps)).reshape(-1)
        k, v = self._fn(layer, buf.view(n * ps, self.hidden), pos)
        dst = slots.long()
        pool[dst, 0] = k.view(n, ps, *k.shape[1:]).transpose(1, 2).to(pool.dtype)
        pool[dst, 1] = v.view(n, ps, *v.shape[1:]).transpose(1, 2).to(pool.dtype)
        self.observe("compute_page_s", n, time.perf_counter() - t0)
        return True

    def observe(self, field: str, pages: int, seconds: float) -> None:
        """A measured time of `pages` pages' reading (input_page_s, kv_page_s: issue to
        completion) or recompute: the cost model's estimate moves towards it, weighted by
        pages (a fill of a few pages times too coarsely to steer by alone)."""
        if pages <= 0:
            return
        w = min(0.5, 0.02 * pages)
        old = getattr(self.cost, field)
        self.cost = dataclasses.replace(self.cost, **{field: (1 - w) * old + w * seconds / pages})
