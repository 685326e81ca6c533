"""The GPU-shaped fill path on its CPU stand-in (kvstore/tiers/transfers.py): fills gather pages
into staging buffers and copy them into a device pool on a copy stream; compute waits for each
micro-batch's copy event. The stand-in's copy stream is a worker thread that holds every copy
back, so a compute that reads a slot before its copy's event would read the wrong page."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.args import EngineArgs
from kvstore.fetcher import Fetcher
from kvstore.tiers.base import PageShape
from kvstore.tiers.transfers import ThreadCopies, make_copies
from tests.engine_helpers import assert_same_greedy, run_scored
from tests.test_pipeline import STEPS, make_mode, prompts, run  # noqa: F401 - prompts: a fixture

SHAPE = PageShape(page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_a_staging_buffer_is_reused_only_once_its_copy_is_done(monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(ThreadCopies, "hold", gate)
    copies = ThreadCopies("cpu", SHAPE)
    pool = torch.zeros(8, *SHAPE.shape)
    buf = copies.staging.take(2)
    taken = copies.staging.take(1)          # handed out, no copy yet: never handed out again
    assert taken.data_ptr() != buf.data_ptr()
    copies.staging.release(taken, None)
    buf.fill_(7.0)
    ev = copies.to_device(pool, torch.tensor([1, 5]), buf, copies.mark())
    copies.staging.release(buf, ev)
    other = copies.staging.take(2)          # the copy still reads the first buffer
    assert other.data_ptr() != buf.data_ptr()
    assert not bool(pool.any())             # held back: nothing landed yet
    gate.set()
    copies.wait(ev)
    assert bool((pool[[1, 5]] == 7).all()) and not bool(pool[[0, 2, 3, 4, 6, 7]].any())
    copies.staging.release(other, None)
    assert copies.staging.take(2).data_ptr() in (buf.data_ptr(), other.data_ptr(),
                                                 taken.data_ptr())
    assert copies.staging.count == 2          # the second take reused the free one
    copies.close()


def test_copies_run_in_order_and_an_event_covers_the_copies_before_it(monkeypatch):
    monkeypatch.setattr(ThreadCopies, "delay", 0.01)
    copies = ThreadCopies("cpu", SHAPE)
    pool = torch.zeros(4, *SHAPE.shape)
    events = []
    for value in range(1, 6):               # the same slot, five times
        buf = torch.full((1, *SHAPE.shape), float(value))
        events.append(copies.to_device(pool, torch.tensor([2]), buf))
    copies.wait(events[-1])
    assert all(e.done() for e in events)
    assert bool((pool[2] == 5).all())
    copies.close()


def test_pages_copied_down_are_in_before_the_work_that_reads_them_starts(monkeypatch):
    monkeypatch.setattr(ThreadCopies, "delay", 0.05)
    copies = ThreadCopies("cpu", SHAPE)
    pool = torch.randn(6, *SHAPE.shape)
    pages, ev = copies.to_host(pool, torch.tensor([4, 1]), copies.mark())
    seen = copies.then(ev, lambda: _done(pages.clone()))
    assert torch.equal(seen.result(), pool[[4, 1]])
    failed = copies.then(ev, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    copies.close()


def _done(value):
    from concurrent.futures import Future
    f = Future()
    f.set_result(value)
    return f


def test_a_cpu_pool_fills_in_place_and_the_stand_in_is_asked_for():
    assert make_copies(torch.device("cpu"), SHAPE) is None
    stand_in = make_copies(torch.device("cpu"), SHAPE, "thread")
    assert isinstance(stand_in, ThreadCopies)
    stand_in.close()
    with pytest.raises(ValueError, match="copy stream"):
        make_copies(torch.device("cpu"), SHAPE, "dma")


# ---------------------------------------------------------------------------- the engine

def stand_in(monkeypatch, delay: float) -> None:
    """Engines built from here on fill their device pool through ThreadCopies."""
    monkeypatch.setattr(ThreadCopies, "delay", delay)
    config = EngineArgs.kv_store_config
    monkeypatch.setattr(EngineArgs, "kv_store_config",
                        lambda self: dataclasses.replace(config(self), copy_stream="thread"))


@pytest.fixture(scope="module")
def sequential(smollm2_dir, prompts, tmp_path_factory):  # noqa: F811 - the fixture
    engine = make_mode(smollm2_dir, tmp_path_factory.mktemp("seq"), "sequential", 0)
    got, errors = run(engine, prompts)
    assert not errors
    return got


@pytest.mark.slow
@pytest.mark.parametrize("mode,micro_batch", [("sequential", 0), ("sfc", 2), ("sfc-whole", 2),
                                              ("layer-ahead", 0)])
def test_fills_through_a_copy_stream_give_the_same_output(smollm2_dir, prompts,  # noqa: F811
                                                          sequential, tmp_path, monkeypatch,
                                                          mode, micro_batch):
    want = sequential
    stand_in(monkeypatch, 0.001)
    engine = make_mode(smollm2_dir, tmp_path, mode, micro_batch)
    copies = engine.store.tiers.copies
    assert isinstance(copies, ThreadCopies)
    got, errors = run(engine, prompts)
    assert not errors
    assert got == want
    st = engine.store.stats.snapshot()
    assert st.transfer_bytes.get(("host", "device"), 0) > 0
    assert st.transfer_bytes.get(("disk", "device"), 0) > 0
    assert copies.copies > 0 and copies.staging.busy == 0     # every buffer given back
    store = engine.store
    assert not bool(store.tiers.host_pinned.any()) and not bool(store.tiers.device_pinned.any())
    assert store.num_used_pages == 0


@pytest.mark.slow
def test_compute_that_does_not_wait_for_its_copies_reads_other_pages(
        smollm2_dir, prompts, sequential, tmp_path, monkeypatch):  # noqa: F811
    # the check above can fail: without the wait for each fill's copy event, attention runs
    # over slots whose pages are still on the copy stream
    want = sequential
    stand_in(monkeypatch, 0.005)
    monkeypatch.setattr(Fetcher, "arrived", lambda self, res: None)
    engine = make_mode(smollm2_dir, tmp_path, "sfc", 2)
    got, _ = run(engine, prompts)
    assert got != want


@pytest.fixture(scope="module")
def torch_kernels(smollm2_dir, prompts, tmp_path_factory):  # noqa: F811 - the fixture
    """The sequential mode's output with the torch attention kernels (not the C ones, whose
    float sums round otherwise)."""
    from kernels.attention import TorchPagedAttention
    from kernels.sparse_attention import TorchSparseDecode
    from kvstore import store

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store, "make_attention_backend", lambda device: TorchPagedAttention())
        mp.setattr(store, "make_sparse_decode", lambda device: TorchSparseDecode())
        engine = make_mode(smollm2_dir, tmp_path_factory.mktemp("torch"), "sequential", 0)
        return run_scored(engine, prompts, STEPS)       # (tokens, margins)


@pytest.mark.slow
def test_the_flashinfer_backends_over_a_copy_stream_give_the_same_output(
        smollm2_dir, prompts, torch_kernels, tmp_path, monkeypatch):  # noqa: F811
    # the GPU path's data flow on a CPU: FlashInfer's wrappers (a stand-in computing with the
    # float32 reference, tests/fake_flashinfer.py) for prefill, dense and sparse decode, fed
    # the per-(sequence, KV head) tables and per-head pool views, over a pool filled through
    # the copy stream
    from kernels.flashinfer_attention import FlashInferPagedAttention
    from kernels.flashinfer_sparse_attention import FlashInferSparseDecode
    from kvstore import store
    from tests import fake_flashinfer

    fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(store, "make_attention_backend", FlashInferPagedAttention)
    monkeypatch.setattr(store, "make_sparse_decode", FlashInferSparseDecode)
    stand_in(monkeypatch, 0.001)
    engine = make_mode(smollm2_dir, tmp_path, "sfc", 2)
    assert isinstance(engine.store.sparse_attention, FlashInferSparseDecode)
    got, _ = run_scored(engine, prompts, STEPS)
    assert fake_flashinfer._Wrapper.plans > 0
    # the stand-in attends in float32 where the torch kernels upcast bf16: the same tokens
    # but where two were within rounding of each other
    assert_same_greedy(got, *torch_kernels)
