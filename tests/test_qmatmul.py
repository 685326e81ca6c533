"""kernels/_qmatmul.c: matmuls of a few float32 rows by 4- and 8-bit group-quantized weights,
on its AVX-512 (VNNI), AVX2 and portable paths (simd 2, 1, 0; a CPU without AVX-512 runs 2
as 1), with x rounded to 16- or 8-bit integers, against the
dequantized weight in float64."""
from __future__ import annotations

import pytest
import torch

from kernels.packed_linear import GroupQuant, PackedWeight, quantize_int4, quantize_int8

pytest.importorskip("kernels._qmatmul")
from kernels import _qmatmul  # noqa: E402

SIMD = [2, 1, 0]


def _qmm(w: PackedWeight, x: torch.Tensor, simd: int, threads: int = 1,
         xbits: int = 16) -> torch.Tensor:
    codes, scale, zero = w._data
    (n, k), m = w.shape, x.shape[0]
    out = torch.full((m, n), float("nan"))
    _qmatmul.qmm(x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(),
                 0 if zero is None else zero.data_ptr(), n, 4 if w.fmt == "q4" else 8,
                 out.data_ptr(), simd, threads, xbits)
    return out


def _reference(q: GroupQuant, x: torch.Tensor) -> torch.Tensor:
    """x @ w.T in float64 over the weight as the kernel holds it (float16 scale and zero)."""
    n, k = q.shape
    g = q.codes.view(n, k // 32, 32).double()
    w = g * q.scale.half().double()[..., None] + q.zero.half().double()[..., None]
    return (x.double() @ w.view(n, k).T).float()


@pytest.mark.parametrize("xbits", [16, 8])
@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(48, 96), (70, 32), (33, 1536), (576, 576)])
def test_matches_the_dequantized_weight(xbits, simd, bits, n, k):
    gen = torch.Generator().manual_seed(n + k + bits)
    w = torch.randn(n, k, generator=gen) * 0.05
    q = quantize_int4(w) if bits == 4 else quantize_int8(w)
    packed = PackedWeight.from_quant(q, f"q{bits}")
    for rows in (1, 2, 3, 4, 5, 8, 17):
        x = torch.randn(rows, k, generator=gen)
        want, got = _reference(q, x), _qmm(packed, x, simd, xbits=xbits)
        # x's rounding (a step of max|x| / 127 or / 32767 per group of 32) bounds the error
        err = (got - want).abs().max() / want.abs().max()
        assert err < (2e-2 if xbits == 8 else 2e-4), (rows, float(err))


def test_both_paths_compute_the_same_integers():
    """Same integer dot products, same float scaling: the paths agree to float rounding."""
    gen = torch.Generator().manual_seed(5)
    for q in (quantize_int4(torch.randn(40, 192, generator=gen)),
              quantize_int8(torch.randn(40, 192, generator=gen))):
        packed = PackedWeight.from_quant(q, f"q{q.bits}")
        x = torch.randn(6, 192, generator=gen)
        for xbits, simd in ((16, 2), (16, 1), (8, 2), (8, 1)):
            assert torch.allclose(_qmm(packed, x, simd, xbits=xbits),
                                  _qmm(packed, x, 0, xbits=xbits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("simd", SIMD)
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(simd):
    gen = torch.Generator().manual_seed(2)
    packed = PackedWeight.from_dense(torch.randn(300, 128, generator=gen), "q4")
    x = torch.randn(9, 128, generator=gen)
    whole = _qmm(packed, x, simd)
    for i in range(9):
        assert torch.equal(_qmm(packed, x[i:i + 1].contiguous(), simd)[0], whole[i])
    assert torch.equal(_qmm(packed, x, simd, threads=4), whole)
    x8 = _qmm(packed, x, simd, xbits=8)
    assert torch.equal(_qmm(packed, x[3:4].contiguous(), simd, xbits=8)[0], x8[3])


@pytest.mark.parametrize("xbits", [16, 8])
@pytest.mark.parametrize("simd", SIMD)
def test_extreme_codes_and_zero_rows(simd, xbits):
    """Q8_0 codes reach -128 (|w| does not fit a signed byte); an all-zero row of x has no
    step (dx = 0) and gives exact zeros."""
    n, k = 16, 64
    codes = torch.full((n, k), -128, dtype=torch.int16)
    codes[::2] = 127
    scale = torch.full((n, k // 32), 0.5)
    q = GroupQuant(codes, scale, torch.zeros_like(scale), 8)
    packed = PackedWeight.from_quant(q, "q8")
    x = torch.zeros(3, k)
    x[1] = 1.0
    x[2] = -0.25
    got, want = _qmm(packed, x, simd, xbits=xbits), _reference(q, x)
    assert torch.equal(got[0], torch.zeros(n))
    assert torch.allclose(got, want, rtol=1e-3)


def test_rejects_shapes_it_cannot_run():
    x = torch.zeros(1, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        _qmatmul.qmm(x.data_ptr(), 1, 48, 0, 0, 0, 4, 4, 0, 1, 1)
    with pytest.raises(ValueError, match="4 or 8"):
        _qmatmul.qmm(x.data_ptr(), 1, 32, 0, 0, 0, 4, 5, 0, 1, 1)
    with pytest.raises(ValueError, match="8 or 16"):
        _qmatmul.qmm(x.data_ptr(), 1, 32, 0, 0, 0, 4, 4, 0, 1, 1, 12)


def test_a_forked_child_runs_the_threaded_kernel():
    """The kept thread pool does not survive fork(): the child starts its own (a child that
    waited on the parent's workers would hang)."""
    import os
    packed = PackedWeight.from_dense(torch.randn(640, 64), "q4")
    x = torch.randn(3, 64)
    before = _qmm(packed, x, 1, threads=4)
    pid = os.fork()
    if pid == 0:                                                 # the child: exit code only
        os._exit(0 if torch.equal(_qmm(packed, x, 1, threads=4), before) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
