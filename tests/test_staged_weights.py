"""A packed weight dequantized when it runs (kernels/_qmatmul_dequant.h, StagedWeight): the
prefill form of a model that keeps no dense copy. Its values are the packed form's own
(float16 scale and zero per group of 32), bit for bit on every path, in float32 and bf16."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from kernels import packed_linear
from kernels.packed_linear import (GroupQuant, Linear, PackedWeight, StagedWeight, quantize_int4,
                                   quantize_int8)

pytest.importorskip("kernels._qmatmul")
from kernels import _qmatmul  # noqa: E402


def _held(q: GroupQuant) -> torch.Tensor:
    """The weight as the packed form holds it: float16 scale and zero, float32 values."""
    n, k = q.shape
    g = q.codes.view(n, k // 32, 32).float()
    return (g * q.scale.half().float()[..., None] + q.zero.half().float()[..., None]).view(n, k)


def _quant(bits: int, n: int, k: int, seed: int) -> GroupQuant:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q = quantize_int4(w) if bits == 4 else quantize_int8(w)
    if bits == 8:                   # the extreme code a Q8_0 file holds
        q.codes[0, :5] = -128
    return q


@pytest.mark.parametrize("simd", [2, 1, 0])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(13, 64), (70, 96), (576, 576)])
def test_dequantized_values_are_the_packed_forms_own(simd, bits, dtype, n, k, monkeypatch):
    monkeypatch.setattr(packed_linear, "QMM_SIMD", simd)
    q = _quant(bits, n, k, n + k + bits)
    packed = PackedWeight.from_quant(q, f"q{bits}")
    out = torch.full((n * k,), float("nan"), dtype=dtype)
    got = packed.dequantize_into(out)
    assert got.shape == (n, k) and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, _held(q).to(dtype))         # (bf16: nearest even, as torch rounds)


@pytest.mark.parametrize("simd", [1, 0])
def test_the_threads_split_the_rows_and_agree_and_padding_rows_are_not_written(simd):
    q = _quant(4, 300, 128, 1)                  # 300 rows: the last tile of 8 has 4
    codes, scale, zero = PackedWeight.from_quant(q, "q4")._data
    outs = []
    for threads in (1, 4):
        out = torch.full((304, 128), float("nan"))
        _qmatmul.dequant(codes.data_ptr(), scale.data_ptr(), zero.data_ptr(), 300, 128, 4,
                         out.data_ptr(), False, simd, threads)
        assert out[300:].isnan().all()
        outs.append(out[:300])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], _held(q))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_staged_matmul_is_the_dense_gemm_over_those_values(dtype):
    """A big weight, a small one, the big one again: each staged on the thread's one
    workspace, each the GEMM of its own values (a stale or short workspace would show)."""
    gen = torch.Generator().manual_seed(3)
    big, small = _quant(4, 200, 128, 4), _quant(8, 40, 64, 5)
    torch_dtype = packed_linear.DENSE[dtype]
    for q in (big, small, big):
        staged = StagedWeight(PackedWeight.from_quant(q, f"q{q.bits}"), dtype)
        x = torch.randn(33, q.shape[1], generator=gen)
        want = F.linear(x.to(torch_dtype), _held(q).to(torch_dtype)).float()
        assert torch.equal(staged.mm(x), want)


def test_each_thread_stages_into_its_own_workspace():
    qs = [_quant(4, 256, 256, 10 + i) for i in range(2)]
    staged = [StagedWeight(PackedWeight.from_quant(q, "q4"), "fp32") for q in qs]
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(6))
    wants = [F.linear(x, _held(q)) for q in qs]
    bad, start = [], threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        for _ in range(30):
            if not torch.equal(staged[i].mm(x), wants[i]):
                bad.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_a_linear_stages_long_steps_and_runs_short_ones_packed():
    q = _quant(4, 32, 64, 7)
    packed = PackedWeight.from_quant(q, "q4")
    lin = Linear(packed, None, prefill=StagedWeight(packed, "fp32"), prefill_rows=16)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(8))
    assert torch.equal(lin(x), F.linear(x, _held(q)))
    assert torch.equal(lin(x[:4]), packed.mm(x[:4]))


def test_refuses_forms_it_cannot_read():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="q4 / q8"):
        StagedWeight(PackedWeight.from_dense(w, "int8"), "bf16")
    with pytest.raises(ValueError, match="q4 / q8"):
        StagedWeight(PackedWeight.from_dense(w, "q4"), "int8")
    packed = PackedWeight.from_dense(w, "q8")
    with pytest.raises(ValueError, match="contiguous float32 or bf16"):
        packed.dequantize_into(torch.empty(32 * 63))
    with pytest.raises(ValueError, match="4 or 8"):
        _qmatmul.dequant(0, 0, 0, 8, 32, 5, 0, False)


@pytest.mark.slow
def test_an_engine_prefilling_staged_decodes_as_one_with_the_dense_copy(smollm2_dir):
    """--prefill-weights staged on the bundled GGUF (Q4_1 and Q8_0 blocks: float16 steps, so
    the staged values are the dense copy's own): no copy kept, and a ~700-token prompt (one
    chunk, past any crossover) gives the dense copy's greedy tokens."""
    from engine.args import EngineArgs
    from engine.gguf_convert import bundled_gguf_path
    from engine.llm_engine import LLMEngine
    from tests.engine_helpers import code_prompt, run

    prompt, got = code_prompt(smollm2_dir), {}
    for mode in ("dense", "staged"):
        engine = LLMEngine(EngineArgs(model=str(bundled_gguf_path()), kv_device_gb=0.1,
                                      prefix_cache="off", prefill_weights=mode))
        assert engine.weight_plan.keep_dense == (mode == "dense")
        tokens, errors = run(engine, [prompt], 24)
        assert not errors
        got[mode] = tokens["r0"]
    assert got["staged"] == got["dense"]
