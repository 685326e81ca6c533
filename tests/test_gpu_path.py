"""The CUDA path on a GPU (marked `gpu`; skipped without CUDA; run with `make test-gpu`): the
copy stream's fills, tier round trips device <-> pinned host <-> disk, the engine on
`--device cuda` against the CPU path, and a spilling server on `--device cuda`. The same
logic runs on CPU stand-ins in the default suite (tests/test_copy_stream.py)."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from kvstore.tiers.base import PageShape
from tests.engine_helpers import run
from tests.server_helpers import openai_client, running_server

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = PageShape(page_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)


def test_copies_land_after_their_mark_and_compute_waits_for_them():
    from kvstore.tiers.transfers import CudaCopies
    copies = CudaCopies(torch.device("cuda"), SHAPE)
    pool = torch.zeros(64, *SHAPE.shape, dtype=SHAPE.dtype, device="cuda")
    pages = torch.randn(8, *SHAPE.shape).to(SHAPE.dtype)
    slots = torch.randperm(64)[:8]
    idx = slots.cuda()
    torch.cuda.synchronize()
    # the compute stream sleeps, then reads the slots: the copy must land after that read
    torch.cuda._sleep(200_000_000)
    before = pool[idx].clone()
    buf = copies.staging.take(8)
    buf.copy_(pages)
    ev = copies.to_device(pool, slots, buf, copies.mark())
    copies.staging.release(buf, ev)
    assert not ev.query()                       # held back behind the compute stream
    copies.wait(ev)
    after = pool[idx].clone()                   # the compute stream waited for the copy
    assert torch.equal(before.cpu(), torch.zeros_like(pages))
    assert torch.equal(after.cpu(), pages)
    assert buf.is_pinned()
    copies.close()


def test_pages_copied_down_land_in_pinned_memory_before_their_writer_runs():
    from concurrent.futures import Future

    from kvstore.tiers.transfers import CudaCopies
    copies = CudaCopies(torch.device("cuda"), SHAPE)
    pool = torch.randn(16, *SHAPE.shape, device="cuda").to(SHAPE.dtype)
    slots = torch.tensor([3, 9, 0])

    def read():
        f = Future()
        f.set_result(pages.clone())
        return f
    pages, ev = copies.to_host(pool, slots, copies.mark())
    assert pages.is_pinned()
    assert torch.equal(copies.then(ev, read).result(), pool[slots.cuda()].cpu())
    copies.close()


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_host_tier_takes_pages_straight_from_gpu_memory(codec):
    from kvstore.tiers.codec import PageCodec
    from kvstore.tiers.host import HostTier
    c = PageCodec.from_name(codec, SHAPE)
    host = HostTier(SHAPE, 16 * SHAPE.nbytes, 64, codec=c)
    pages = torch.randn(4, *SHAPE.shape, device="cuda").to(SHAPE.dtype)
    host.put(torch.tensor([1, 5, 9, 2]), pages)         # no wait by the caller
    out = torch.empty(4, *SHAPE.shape, dtype=SHAPE.dtype)
    host.get(torch.tensor([1, 5, 9, 2]), out)
    want = pages.cpu() if c is None else c.round_trip(pages.cpu())
    assert torch.equal(out, want)


def test_tier_round_trip_device_pinned_host_disk(tmp_path):
    from kvstore.tiers.device import DeviceTier
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.host import HostTier
    nb = SHAPE.nbytes
    dev = DeviceTier(SHAPE, 32 * nb, 256, "cuda")
    host = HostTier(SHAPE, 32 * nb, 256)
    disk = DiskTier(SHAPE, 64 * nb, tmp_path / "kv", 256, 1, 256)
    assert host.pool.is_pinned()
    keys = torch.arange(20, dtype=torch.int64) * 3
    disk.register_request(1, 64)
    disk.bind(keys.tolist(), 1, 0)
    pages = torch.randn(20, *SHAPE.shape).to(SHAPE.dtype)
    dev.put(keys, pages.cuda())
    up = torch.empty_like(pages)
    dev.get(keys, up)
    host.put(keys, up)
    down = torch.empty_like(pages)
    host.get(keys, down)
    disk.put_async(keys, down).result()
    back = torch.empty_like(pages)
    disk.get(keys, back)                       # checksums checked on the way back
    dev.delete(keys)
    dev.put(keys, back)
    again = torch.empty(pages.shape, dtype=SHAPE.dtype, device="cuda")
    dev.get(keys, again)
    assert torch.equal(again.cpu(), pages)
    disk.close()


def _prompts(folder):
    from server.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    text = "The lighthouse keeper wrote in his log every night. " * 40
    return [tok.encode_chat([{"role": "user", "content": text + f" Question {i}: why?"}])
            for i in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequential", "sfc"])
def test_greedy_on_cuda_with_spilling_tiers_equals_all_in_gpu_memory(smollm2_dir, tmp_path,
                                                                     mode):
    from engine.llm_engine import LLMEngine
    prompts = _prompts(smollm2_dir)
    common = dict(model=str(smollm2_dir), device="cuda", dtype="bf16", weights="bf16",
                  page_size=16, sparse_budget=256, prefix_cache="off")
    resident = LLMEngine(EngineArgs(kv_device_gb=0.5, pipeline="sequential", **common))
    want, errors = run(resident, prompts, 32)
    assert not errors
    gpu = LLMEngine(EngineArgs(kv_device_gb=0.01, kv_host_gb=0.01, kv_host_pool="separate",
                               kv_disk_gb=0.5, kv_disk_path=str(tmp_path / "kv"),
                               pipeline=mode, **common))
    assert gpu.store.tiers.copies is not None and gpu.store.tiers.pool.is_cuda
    got, errors = run(gpu, prompts, 32)
    assert not errors
    st = gpu.store.stats.snapshot()
    assert st.transfer_bytes.get(("disk", "device"), 0) > 0
    assert st.transfer_bytes.get(("host", "device"), 0) > 0
    assert got == want                  # the same pages attended, wherever they came from
    # and the CPU path's greedy tokens start alike (bf16 rounds otherwise on each device)
    cpu = LLMEngine(EngineArgs(**{**common, "device": "cpu"}, kv_device_gb=0.5))
    on_cpu, _ = run(cpu, prompts, 32)
    assert all(got[r][:2] == on_cpu[r][:2] for r in want)


@pytest.mark.slow
def test_a_spilling_server_on_cuda_answers_the_openai_client(tmp_path):
    with running_server("--device", "cuda", "--kv-device-gb", "0.01", "--kv-host-gb", "0.01",
                        "--kv-host-pool", "separate", "--kv-disk-gb", "0.5",
                        "--kv-disk-path", str(tmp_path / "kv"), "--sparse-budget", "256",
                        "--pipeline", "sfc") as server:
        client = openai_client(server.url)
        text = "The lighthouse keeper wrote in his log every night. " * 60
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": text + " What did he write?"}])
        assert reply.choices[0].message.content
        assert server.metric("strata_kv_transfer_bytes_total",
                             'dst="device",src="disk"') > 0
