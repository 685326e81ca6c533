"""Copies into a device pool that is not host memory: a copy stream, its events, and the pinned
staging buffers the copies read from.

On a GPU (`CudaCopies`) fills go up on their own CUDA stream: a fill gathers its host pages
(host tier hits, disk reads) into a pinned staging buffer, enqueues one asynchronous
`index_copy_` into the device slots on the copy stream and records an event; the compute
stream waits on that event (`wait`) before the attention of the micro-batch that needs the
pages, not on the layer's other fills, and the host never waits. Two orders keep it exact:

- a copy into a slot runs after every kernel that read the slot's previous page: the copy
  stream first waits on `mark()`, an event the resolve that freed the slot recorded on the
  compute stream (every read of the evicted page was enqueued before the eviction, since the
  page was protected until its layer's attention was enqueued);
- a staging buffer is reused only once the copy that reads it is done (`release` with the
  copy's event; `take` skips busy buffers).

`ThreadCopies` is the CPU stand-in with the same contract (tests run the GPU-shaped fill path
on it): one worker thread is the copy stream (FIFO), the Future of a job is its event, and
the compute "stream" is the calling thread, so `wait` blocks and `mark` is already done.
`delay` (or `hold`) keeps every copy back, so a compute that does not wait for its copy's
event reads the slot's old contents and gives other outputs (the tests' check).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvstore.tiers.base import PageShape, page_rows

COPY_STREAMS = ("auto", "thread")
_MAX_BUFFERS = 16            # staging buffers kept; past it `take` waits for the oldest copy


class _Staging:
    """Reused host buffers of whole pages, each busy until the event of the copy reading it."""

    def __init__(self, page_shape: PageShape, pin: bool, done, sync):
        self.page_shape, self.pin = page_shape, pin
        self._done, self._sync = done, sync     # event -> bool (no wait); event -> None (wait)
        self._bufs: list[list] = []             # [buffer, event or None (free)]
        self._lock = threading.Lock()

    def take(self, n: int) -> torch.Tensor:
        """A buffer [n, 2, kvh, ps, hd] no pending copy reads."""
        with self._lock:
            for entry in self._bufs:
                buf, ev = entry
                if buf.shape[0] >= n and ev is not _BUSY and (ev is None or self._done(ev)):
                    entry[1] = _BUSY
                    return buf[:n]
            if len(self._bufs) >= _MAX_BUFFERS:     # drop a free one, or wait for the oldest
                entry = next((e for e in self._bufs if e[1] is None), None) or next(
                    (e for e in self._bufs if e[1] is not _BUSY), None)
                if entry is not None:
                    if entry[1] is not None:
                        self._sync(entry[1])
                    self._bufs.remove(entry)
            buf = torch.empty(max(n, 64), *self.page_shape.shape, dtype=self.page_shape.dtype,
                              pin_memory=self.pin)
            self._bufs.append([buf, _BUSY])
            return buf[:n]

    def release(self, view: torch.Tensor, event) -> None:
        """The buffer behind `view` is free once `event` is done (None: now)."""
        with self._lock:
            for entry in self._bufs:
                if entry[0].data_ptr() == view.data_ptr():
                    entry[1] = event
                    return

    @property
    def count(self) -> int:
        return len(self._bufs)

    @property
    def busy(self) -> int:
        """Buffers handed out whose copy was never enqueued nor the buffer given back."""
        with self._lock:
            return sum(e[1] is _BUSY for e in self._bufs)


_BUSY = object()      # a buffer handed out whose copy is not enqueued yet


class CudaCopies:
    """The copy stream of a CUDA device pool (module docstring)."""

    def __init__(self, device: torch.device, page_shape: PageShape):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        # NOTE: the engine runs its kernels on the device's default stream
        self.compute = torch.cuda.default_stream(self.device)
        self.staging = _Staging(page_shape, True, lambda ev: ev.query(),
                                lambda ev: ev.synchronize())
        # waits for copies down to the host before the work that reads them (`then`)
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="strata-copy-wait")

    def mark(self):
        """An event after every kernel enqueued on the compute stream so far."""
        ev = _event()
        ev.record(self.compute)
        return ev

    def to_device(self, pool: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor,
                  after=None):
        """pool[slots] = pages (pinned host [n, ...]) on the copy stream, after `after` (a
        `mark`); returns the copy's event. `pages` must not change until it is done."""
        with torch.cuda.stream(self.stream):
            # NOTE: the transfer goes up at once; only the write into the slots waits
            idx = slots.to(self.device, torch.int64, non_blocking=True)
            src = page_rows(pages).to(self.device, non_blocking=True)
            if after is not None:
                self.stream.wait_event(after)
            page_rows(pool).index_copy_(0, idx, src)
            ev = _event()
            ev.record(self.stream)
        return ev

    def to_host(self, pool: torch.Tensor, slots: torch.Tensor, after=None):
        """pool[slots] into a fresh pinned host tensor on the copy stream, after `after`:
        -> (the pages, the copy's event); they hold the pages once the event is done."""
        out = torch.empty(slots.numel(), *pool.shape[1:], dtype=pool.dtype, pin_memory=True)
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            idx = slots.to(self.device, torch.int64, non_blocking=True)
            out.copy_(pool.index_select(0, idx), non_blocking=True)
            ev = _event()
            ev.record(self.stream)
        return out, ev

    def then(self, event, start) -> Future:
        """`start()` (which returns a Future) once `event` is done, on the waiter thread: ->
        a Future of its result (the host waits there, not here)."""
        return _chain(self._waiter, lambda: event.synchronize(), start)

    def wait(self, event) -> None:
        """The compute stream waits for `event` (the host does not)."""
        if event is not None:
            self.compute.wait_event(event)

    def sync(self, event) -> None:
        """The host waits for `event`."""
        event.synchronize()

    def wait_all(self) -> None:
        """The compute stream waits for every copy enqueued so far."""
        self.compute.wait_stream(self.stream)

    def close(self) -> None:
        self._waiter.shutdown(wait=True)
        self.stream.synchronize()


class ThreadCopies:
    """The CPU stand-in of CudaCopies (module docstring): a worker thread is the copy stream."""

    delay = 0.0            # seconds each copy waits before it runs (tests)
    hold: threading.Event | None = None     # copies wait until it is set (tests)

    def __init__(self, device: torch.device, page_shape: PageShape):
        self.device = torch.device(device)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="strata-copy")
        self._last: Future | None = None
        self._lock = threading.Lock()           # the fetch and write-back threads submit
        self.staging = _Staging(page_shape, False, lambda ev: ev.done(),
                                lambda ev: ev.exception())
        self.copies = 0                         # copies enqueued (tests)

    def mark(self):
        return None          # the compute "stream" is the caller: everything it did is done

    def to_device(self, pool: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor,
                  after=None) -> Future:
        return self._copy(lambda: page_rows(pool).index_copy_(0, slots.to(torch.int64),
                                                              page_rows(pages)))

    def to_host(self, pool: torch.Tensor, slots: torch.Tensor, after=None):
        out = torch.empty(slots.numel(), *pool.shape[1:], dtype=pool.dtype)
        return out, self._copy(lambda: torch.index_select(pool, 0, slots.to(torch.int64),
                                                          out=out))

    def _copy(self, move) -> Future:
        """Run `move` on the worker (the copy stream), held back as the tests ask."""
        hold, delay = self.hold, self.delay

        @torch.inference_mode()
        def job():
            if hold is not None:
                hold.wait()
            if delay:
                time.sleep(delay)
            move()
        with self._lock:
            self.copies += 1
            self._last = self._worker.submit(job)
            return self._last

    def then(self, event: Future, start) -> Future:
        # NOTE: the worker runs in order: `event`, a copy it was given earlier, is done
        return _chain(self._worker, event.result, start)

    def wait(self, event: Future | None) -> None:
        if event is not None:
            event.result()

    def sync(self, event: Future) -> None:
        event.result()

    def wait_all(self) -> None:
        with self._lock:
            last = self._last
        self.wait(last)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _event():
    """A CUDA event whose `synchronize` yields the CPU rather than spinning on it."""
    return torch.cuda.Event(blocking=True)


def _chain(executor: ThreadPoolExecutor, wait, start) -> Future:
    """On `executor`: `wait()`, then `start()` (a Future): -> a Future of the latter's result."""
    out: Future = Future()

    def settle(inner: Future) -> None:
        exc = inner.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(inner.result())

    @torch.inference_mode()
    def run() -> None:
        try:
            wait()
            inner = start()
        except BaseException as exc:   # noqa: BLE001 - the caller's Future carries it
            out.set_exception(exc)
            return
        inner.add_done_callback(settle)
    executor.submit(run)
    return out


def make_copies(device: torch.device, page_shape: PageShape, kind: str = "auto"):
    """The device pool's copy stream: None where the pool is host memory that fills write in
    place (a CPU), CudaCopies on CUDA, ThreadCopies when asked for (`kind` "thread")."""
    if kind not in COPY_STREAMS:
        raise ValueError(f"copy stream must be one of {COPY_STREAMS}, got {kind!r}")
    if kind == "thread":
        return ThreadCopies(device, page_shape)
    if torch.device(device).type == "cuda":
        return CudaCopies(device, page_shape)
    return None
