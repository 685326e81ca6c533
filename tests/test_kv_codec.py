"""The KV tier codec (kvstore/tiers/codec.py, _kvcodec.c): the C kernels against the torch
reference on every SIMD path, its error bound, and the disk tier storing codes: fewer bytes,
checksums over the codes, the scales across a restart."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.tiers.base import PageShape
from kvstore.tiers.codec import PageCodec, best_simd
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.errors import PageCorrupted

SHAPE = PageShape(16, 3, 64, torch.bfloat16)


def pages(n: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Keys-like values: per-channel magnitudes (outlier channels), an offset, edge cases."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE.shape, generator=g) * (torch.rand(64, generator=g) * 6 + 0.1)
    x += torch.randn(n, 2, 3, 1, 1, generator=g)
    x[0, 0, 0, 0] = 1.5                         # a constant group: scale 0
    x[1, 1, 2] *= 1e-4                          # a tiny range (float16 subnormal scales)
    x[2, 0, 1, 3, 5] = 9e4                      # beyond float16: clamped to 65504
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64])
def test_c_kernels_match_the_torch_reference_on_every_path(dtype, bits, group):
    codec = PageCodec(PageShape(16, 3, 64, dtype), bits, group)
    x = pages(24, dtype)
    codes, meta = codec.encode_pages(x)
    ref_codes, ref_meta = codec.encode_ref(x)
    assert codes.shape == (24, codec.code_bytes) and meta.shape == (24, codec.meta_values)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(meta.view(torch.int16), ref_meta.view(torch.int16))
    ref = codec.decode_ref(codes, meta)
    for simd in range(best_simd() + 1):     # every path this CPU runs
        out = codec.decode_pages(codes, meta, simd=simd)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8)), simd


@pytest.mark.parametrize("bits", [8, 4])
def test_error_is_within_half_a_step_of_each_group(bits):
    codec = PageCodec(SHAPE, bits, 64)
    x = pages(32)[3:].float()                     # the ordinary pages
    y = codec.round_trip(x.to(torch.bfloat16)).float()
    g = x.reshape(x.shape[0], -1, 64)
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / (2 ** bits - 1)
    err = (y.reshape_as(g) - g).abs()
    # half a step, the float16 rounding of min and scale, and bf16's rounding of the result
    bound = step * (0.5 + 2 ** -9 * 2 ** bits) + g.abs().amax(-1, keepdim=True) * 2 ** -8
    assert bool((err <= bound).all())
    rel = float((err / step.clamp_min(1e-6)).mean())
    assert rel < 0.3                              # uniform rounding error: ~0.25 of a step


def test_format_sizes_for_the_bundled_model():
    for bits, code_bytes in ((8, 6144), (4, 3072)):
        codec = PageCodec(SHAPE, bits, 64)
        assert codec.code_bytes == code_bytes and codec.stride == code_bytes
        assert codec.meta_bytes == 96 * 4          # (scale, min) float16 per row of 64
    with pytest.raises(ValueError):
        PageCodec(SHAPE, 2, 64)
    with pytest.raises(ValueError):
        PageCodec(PageShape(16, 3, 48, torch.bfloat16), 8, 32)   # 32 does not divide 48


def make_disk(path, codec, layers=2, max_pages=64) -> DiskTier:
    return DiskTier(SHAPE, 1 << 28, path, layers * max_pages, layers, max_pages, codec=codec,
                    namespace=b"n" * 16)


@pytest.mark.parametrize("bits", [8, 4])
def test_disk_tier_stores_codes_and_returns_the_decoded_pages(tmp_path, bits):
    codec = PageCodec(SHAPE, bits, 64)
    disk = make_disk(tmp_path / "kv", codec)
    plain = make_disk(tmp_path / "plain", None)
    try:
        for t in (disk, plain):
            t.register_request(0, 32)
            t.bind(torch.arange(24), 0, 0)
        keys = torch.cat([torch.arange(24), 64 + torch.arange(24)])
        x = pages(48, seed=bits)
        disk.put(keys, x)
        plain.put(keys, x)
        assert disk.bytes_written * (16 // bits) == plain.bytes_written
        out = torch.zeros_like(x)
        disk.get(keys, out)
        assert torch.equal(out, codec.round_trip(x))
        pool = torch.zeros(64, *SHAPE.shape, dtype=SHAPE.dtype)
        slots = torch.randperm(64)[:48]
        disk.get_into(keys, pool, slots).result()
        assert torch.equal(pool[slots], out)
        assert disk.page_bytes == codec.code_bytes
        assert disk.capacity_pages // (16 // bits) == plain.capacity_pages
    finally:
        disk.close()
        plain.close()


def test_a_flipped_code_byte_is_caught_by_the_checksum(tmp_path):
    codec = PageCodec(SHAPE, 8, 64)
    disk = make_disk(tmp_path / "kv", codec)
    try:
        disk.register_request(0, 8)
        disk.bind(torch.arange(4), 0, 0)
        disk.put(torch.arange(4), pages(4))
        path = disk.layout.file_path(0)
        data = bytearray(path.read_bytes())
        data[2 * codec.stride + 100] ^= 0x10        # page index 2 of layer 0
        path.write_bytes(bytes(data))
        with pytest.raises(PageCorrupted) as exc:
            disk.get(torch.arange(4), torch.zeros(4, *SHAPE.shape, dtype=SHAPE.dtype))
        assert list(np.asarray(exc.value.keys)) == [2]
    finally:
        disk.close()


def test_the_scales_survive_a_restart_in_the_index_log(tmp_path):
    codec = PageCodec(SHAPE, 4, 32)
    x = pages(6, seed=5)
    disk = make_disk(tmp_path / "kv", codec)
    disk.register_request(7, 8)
    disk.bind(torch.arange(3), 7, 0)
    disk.put(torch.cat([torch.arange(3), 64 + torch.arange(3)]), x)
    keys = [bytes([i]) * 16 for i in range(3)]
    assert disk.record(torch.arange(3), keys, [None] * 3).all()
    disk.release_request(7)
    disk.close()

    again = make_disk(tmp_path / "kv", codec)
    try:
        (seg,) = again.restore()
        assert seg.handle == 7 and list(seg.indices) == [0, 1, 2]
        again.adopt(seg.handle, [10, 11, 12], seg.indices, seg.crcs, seg.meta)
        want = torch.cat([torch.tensor([10, 11, 12]), 64 + torch.tensor([10, 11, 12])])
        out = torch.zeros(6, *SHAPE.shape, dtype=SHAPE.dtype)
        again.get(want, out)
        assert torch.equal(out, codec.round_trip(x))
    finally:
        again.close()


@pytest.mark.slow
def test_the_engine_decodes_from_a_compressed_disk_tier(smollm2_dir, tmp_path):
    """Every page evicted to the disk after each step, read back as codes: int8 keeps the
    greedy tokens of the exact KV (here all of them), int4 most of them; a disk page moves
    2x / 4x fewer bytes."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from server.tokenizer import Tokenizer
    from tests import engine_helpers
    tok = Tokenizer.from_folder(smollm2_dir)
    text = ("The lighthouse keeper wrote in his log every night. " * 12
            + "The secret code is 4921. Remember it. " + "Waves hit the rocks. " * 10)
    prompts = [tok.encode_chat([{"role": "user", "content": text + " What is the code?"}])]

    def run(**kw):
        engine = LLMEngine(EngineArgs(model=str(smollm2_dir), page_size=16, kv_device_gb=0.1,
                                      prefix_cache="off", sparse_budget=4096, **kw))
        got, errors = engine_helpers.run(engine, prompts, 32)
        assert not errors
        return engine, got["r0"]

    _, exact = run()
    per_page = {}
    for codec in ("none", "int8", "int4"):
        engine, got = run(kv_disk_gb=0.2, kv_disk_path=tmp_path / codec, kv_force_tier="disk",
                          kv_tier_codec=codec)
        st = engine.store.stats.snapshot()
        assert st.hits.get("disk", 0) > 0
        per_page[codec] = st.transfer_bytes[("disk", "device")] / st.hits["disk"]
        same = next((i for i, (a, b) in enumerate(zip(got, exact)) if a != b), len(exact))
        if codec != "int4":
            assert same == len(exact), (codec, got, exact)
        else:
            assert same >= 8, (got, exact)
    assert per_page == {"none": 12288, "int8": 6144, "int4": 3072}


def test_staging_buffers_are_reused_smallest_fit_first():
    from kvstore.tiers.staging import StagingBuffers
    pool = StagingBuffers()
    a, b = pool.take(3 << 20), pool.take(1 << 20)
    assert a.shape[0] >= 3 << 20 and b.shape[0] >= 1 << 20 and a.ctypes.data % 4096 == 0
    pool.give(a)
    pool.give(b)
    assert pool.take(100).ctypes.data == b.ctypes.data      # the smallest that fits
    assert pool.take(2 << 20).ctypes.data == a.ctypes.data
