"""Linear-layer weights in the formats a CPU runs fastest, and their matmuls.

A weight [N out, K in] is held in one of these formats:
  fp32, bf16   dense; `F.linear`
  int8         one int8 code per weight and one scale per output row (w = scale[n] * q);
               torch's packed CPU kernel `_weight_int8pack_mm`
  int4         4-bit codes in groups of 32 along K, a scale and a zero point per group
               (w = scale * (q - 8) + zero: GGUF's Q4_0 and Q4_1 blocks map onto it with no
               new rounding of the codes); torch's packed CPU kernel
               `_weight_int4pack_mm_for_cpu`
  q4, q8       the same 4-bit groups (w = scale * q + zero), or signed 8-bit codes per group of
               32 (w = scale * q: GGUF's Q8_0), through our own kernel (kernels/_qmatmul.c):
               float32 activations rounded to 16-bit integers per group of 32, integer dot
               products (AVX2 where the CPU has it); float16 scales and zeros
The torch packed kernels take bf16 activations (their float32 path runs 20-40x slower, measured on
an AMD EPYC with AVX2: 1536 x 576, 8 rows, 22 ms against 0.37 ms) and bf16 scales, so a packed
matmul rounds its input to bf16 and returns float32 accumulations rounded to bf16, then to the
caller's dtype.

`GroupQuant` is a quantized tensor as a file stores it (GGUF's blocks, or our own quantization
of a dense weight at load): integer codes, and per group of 32 a scale and a zero point.

Leaf module: imports only torch and its own C kernel.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    from kernels import _qmatmul
except ImportError:                     # not built: torch's packed kernels only
    _qmatmul = None

FORMATS = ("fp32", "bf16", "int8", "int4", "q8", "q4")
BITS = {"int4": 4, "q4": 4, "int8": 8, "q8": 8}
OURS = ("q4", "q8")
# a file's codes at their own width, in our kernel's formats or torch's
NATIVE = {"native": {4: "q4", 8: "q8"}, "native-torch": {4: "int4", 8: "int8"}}
DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16}
GROUP = 32
_INT4_TILE_N = 16           # int4pack tiles N by 16 on the CPU
_INT8_K = 16                # torch's int8pack CPU kernel reads K in 16s (torch 2.13 crashes
                            # on K = 40 or 56)
_OUR_TILE = 8               # kernels/_qmatmul.c's tiles of output rows
QMM_SIMD = 2                # our kernel's path: 2 the best the CPU has (AVX-512 VNNI, AVX2),
                            # 1 AVX2 at most, 0 portable (A/B and tests)


@dataclass(frozen=True)
class GroupQuant:
    """Codes [N, K] (int16: Q4 codes in 0..15, Q8 codes in -128..127) with w = scale * q +
    zero per group of GROUP along K; scale and zero [N, K / GROUP] float32. `values`: the
    file's own float32 values [N, K] where the groups round them (GGUF's Q6_K, whose
    sub-blocks of 16 our groups of 32 approximate), else None."""
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    values: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in float32, as llama.cpp computes it (scale * q + zero in float;
        the file's values where the groups round them)."""
        if self.values is not None:
            return self.values
        n, k = self.codes.shape
        q = self.codes.view(n, k // GROUP, GROUP).float()
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def groups_only(self) -> "GroupQuant":
        """The groups without the file's values (what a packed form needs)."""
        return GroupQuant(self.codes, self.scale, self.zero, self.bits)

    @staticmethod
    def cat(parts: list["GroupQuant"]) -> "GroupQuant":
        """Rows of several tensors stacked (fused projections such as q|k|v). Parts of
        different widths stack as 8-bit groups (a 4-bit group is one, its codes as they are:
        Q4_K_M files hold q and k in 4 bits and some v in Q6_K)."""
        values = None if all(p.values is None for p in parts) else \
            torch.cat([p.dequantize() for p in parts])
        return GroupQuant(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), max(p.bits for p in parts), values)

    def rows(self, index) -> "GroupQuant":
        """Rows `index` (a slice or an order) of the tensor."""
        return GroupQuant(self.codes[index], self.scale[index], self.zero[index], self.bits,
                          None if self.values is None else self.values[index])


def quantize_int4(w: torch.Tensor) -> GroupQuant:
    """Asymmetric 4-bit codes per group of 32 (min and step per group, as Q4_1 does)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15)
    return GroupQuant(q.view(n, k).to(torch.int16), scale, lo, 4)


class PackedWeight:
    """One weight [N, K] in one format, with its matmul `mm(x) -> x @ w.T`."""

    def __init__(self, fmt: str, shape: tuple[int, int], data: tuple[torch.Tensor, ...]):
        self.fmt, self.shape, self._data = fmt, shape, data
        self.xbits = 16         # q4 / q8: x rounded to 16-bit integers, or 8-bit (llama.cpp's)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float -> [M, N] in x's dtype."""
        # NOTE: dtype checks before each conversion: a no-op `.to` still costs a dispatch,
        # and a decode step makes ~120 of these calls
        if self.fmt in DENSE:
            w, = self._data
            if x.dtype == w.dtype:
                return F.linear(x, w)
            return F.linear(x.to(w.dtype), w).to(x.dtype)
        if self.fmt in OURS:
            return self._qmm(x)
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if self.fmt == "int8":
            codes, scale = self._data
            y = torch.ops.aten._weight_int8pack_mm(xb, codes, scale)
        else:
            packed, scale_zero = self._data
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, scale_zero)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    def native_args(self) -> list[int] | None:
        """Our kernel's view of this weight (kernels/_layer.c calls it by address): codes,
        scale and zero addresses (0: none), bits, x bits; None for other formats."""
        if self.fmt not in OURS:
            return None
        codes, scale, zero = self._data
        return [codes.data_ptr(), scale.data_ptr(), 0 if zero is None else zero.data_ptr(),
                BITS[self.fmt], self.xbits]

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """This weight's values in `out` (contiguous, float32 or bf16, N x K elements), from
        our kernel's formats (q4 / q8): scale * q + zero in one rounding; returns out [N, K]."""
        if self.fmt not in OURS:
            raise ValueError(f"dequantize_into reads q4 / q8, not {self.fmt}")
        codes, scale, zero = self._data
        (n, k), bf16 = self.shape, out.dtype == torch.bfloat16
        if out.numel() != n * k or not out.is_contiguous() or not (bf16 or out.dtype ==
                                                                    torch.float32):
            raise ValueError(f"out must be {n} x {k} contiguous float32 or bf16")
        _qmatmul.dequant(codes.data_ptr(), scale.data_ptr(),
                         0 if zero is None else zero.data_ptr(), n, k, BITS[self.fmt],
                         out.data_ptr(), bf16, QMM_SIMD, torch.get_num_threads())
        return out.view(n, k)

    def _qmm(self, x: torch.Tensor) -> torch.Tensor:
        codes, scale, zero = self._data
        xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        m, (n, k) = xf.shape[0], self.shape
        out = torch.empty(m, n)
        _qmatmul.qmm(xf.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(),
                     0 if zero is None else zero.data_ptr(), n, BITS[self.fmt], out.data_ptr(),
                     QMM_SIMD, torch.get_num_threads(), self.xbits)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def supports(cls, fmt: str, shape: tuple[int, int]) -> bool:
        """Can a weight of this shape take this format? (int4 tiles N by 16, K by 32; int8
        reads K in 16s)"""
        n, k = shape
        if fmt == "int4":
            return n % _INT4_TILE_N == 0 and k % GROUP == 0
        if fmt == "int8":
            return k % _INT8_K == 0
        if fmt in OURS:
            return _qmatmul is not None and k % GROUP == 0
        return fmt in FORMATS

    @classmethod
    def from_dense(cls, w: torch.Tensor, fmt: str) -> "PackedWeight":
        """Pack a dense weight, quantizing it for int8 (per row, symmetric), q8 (per group,
        symmetric), int4 and q4."""
        shape = tuple(w.shape)
        if fmt in DENSE:
            return cls(fmt, shape, (w.to(DENSE[fmt]).contiguous(),))
        if fmt == "int8":
            if not cls.supports(fmt, shape):
                raise ValueError(f"int8 needs K % {_INT8_K} == 0, got {shape[0]} x {shape[1]}")
            wf = w.float()
            scale = wf.abs().amax(1).clamp_min(1e-12) / 127
            codes = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            return cls(fmt, shape, (codes.contiguous(), scale.to(torch.bfloat16)))
        if fmt in ("int4", "q4"):
            return cls.from_quant(quantize_int4(w), fmt)
        if fmt == "q8":
            return cls.from_quant(quantize_int8(w), fmt)
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")

    @classmethod
    def from_quant(cls, q: GroupQuant, fmt: str = "int4") -> "PackedWeight":
        """A file's groups in a packed format of their width, with their codes as they are;
        8-bit groups asked for as torch's int8 are re-expressed per row (its kernel has one
        scale per row), and 4-bit ones as int4 need N % 16 == 0."""
        n, k = q.shape
        if fmt in OURS:
            if not cls.supports(fmt, (n, k)) or BITS[fmt] != q.bits:
                raise ValueError(f"{fmt} takes {BITS[fmt]}-bit groups with K % {GROUP} == 0 "
                                 f"(and kernels/_qmatmul built), got {q.bits}-bit {n} x {k}")
            return cls(fmt, (n, k), _our_layout(q))
        if q.bits != 4:
            return cls.from_dense(q.dequantize(), "int8")
        if not cls.supports("int4", (n, k)):
            raise ValueError(f"int4 needs N % {_INT4_TILE_N} == 0 and K % {GROUP} == 0, "
                             f"got {n} x {k}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.codes.to(torch.int32).contiguous(), 1)
        zero = q.zero + 8 * q.scale
        scale_zero = torch.stack([q.scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
        return cls("int4", (n, k), (packed, scale_zero))


class StagedWeight:
    """A dense form made each time it runs, for a model that keeps no dense copy (too big
    for the memory beside its packed weights): `mm` dequantizes the packed weight (q4 / q8)
    into this thread's workspace, then runs the dense GEMM. On a prefill chunk of a few
    hundred rows that GEMM runs about twice as fast as our integer kernel, for one pass over
    the weight (kernels/_qmatmul_dequant.h); the plan times where it pays
    (engine/weight_plan.py). A thread's workspace is as big as the largest matmul it staged,
    and kept (the engine's thread; the KV fetch thread's where a recompute stages)."""

    _local = threading.local()

    def __init__(self, packed: PackedWeight, dtype: str):
        if packed.fmt not in OURS or dtype not in DENSE:
            raise ValueError(f"a staged form reads q4 / q8 into {tuple(DENSE)}, not "
                             f"{packed.fmt} into {dtype}")
        self.packed, self.fmt, self.shape = packed, dtype, packed.shape

    def dense(self) -> torch.Tensor:
        """The weight [N, K] in this thread's workspace (valid until its next use)."""
        dtype, (n, k) = DENSE[self.fmt], self.shape
        spaces = self._local.__dict__.setdefault("spaces", {})
        space = spaces.get(dtype)
        if space is None or space.numel() < n * k:
            spaces[dtype] = space = None            # (the old one goes first)
            spaces[dtype] = space = torch.empty(n * k, dtype=dtype)
        return self.packed.dequantize_into(space[:n * k])

    @classmethod
    def release_workspace(cls) -> None:
        """Let this thread's workspace go (a thread that stages no more: the plan's probes)."""
        cls._local.__dict__.pop("spaces", None)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dense()
        if x.dtype == w.dtype:
            return F.linear(x, w)
        return F.linear(x.to(w.dtype), w).to(x.dtype)


def quantize_int8(w: torch.Tensor) -> GroupQuant:
    """Symmetric 8-bit codes per group of 32 (one step per group, as Q8_0 does)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    scale = g.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(g / safe[..., None]).clamp_(-127, 127)
    return GroupQuant(q.view(n, k).to(torch.int16), scale, torch.zeros_like(scale), 8)


def _our_layout(q: GroupQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """kernels/_qmatmul.c's buffers, in its tiles of 8 output rows (its header lays them out;
    N padded with zero rows): codes (4-bit: two a byte; written by `pack_codes` in one pass),
    float16 scale and zero (None where every zero is 0)."""
    n, k = q.shape
    groups, tiles = k // GROUP, -(-n // _OUR_TILE)

    def rows(t: torch.Tensor) -> torch.Tensor:          # [tiles * 8, ...], padded with zeros
        return F.pad(t, (0, 0, 0, tiles * _OUR_TILE - n))

    codes = torch.empty(tiles * groups * _OUR_TILE * GROUP * q.bits // 8, dtype=torch.uint8)
    src = q.codes if q.codes.dtype == torch.int16 and q.codes.is_contiguous() else \
        q.codes.to(torch.int16).contiguous()
    _qmatmul.pack_codes(src.data_ptr(), n, k, q.bits, codes.data_ptr(),
                        torch.get_num_threads())

    def per_tile(v: torch.Tensor) -> torch.Tensor:      # [N, groups] -> [tiles, groups, 8]
        return rows(v).view(tiles, _OUR_TILE, groups).permute(0, 2, 1).half().contiguous()

    zero = None if not q.zero.any() else per_tile(q.zero)
    return codes, per_tile(q.scale), zero


class Linear:
    """y = x @ w.T + bias, with the weight in a `decode` form for steps of few rows and,
    optionally, a dense `prefill` form for steps of `prefill_rows` rows or more (a prefill
    chunk is bound by compute, where a CPU's float32 GEMM can beat its packed kernels; a
    decode step is bound by the bytes of the weights)."""

    def __init__(self, decode: PackedWeight, bias: torch.Tensor | None = None,
                 prefill: PackedWeight | None = None, prefill_rows: int = 0):
        self.decode, self.prefill, self.bias = decode, prefill, bias
        self.prefill_rows = prefill_rows

    def weight_for(self, rows: int) -> PackedWeight:
        if self.prefill is not None and rows >= self.prefill_rows:
            return self.prefill
        return self.decode

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight_for(x.shape[0]).mm(x)
        return y if self.bias is None else y + self.bias


def expert_table(pairs: list[tuple[Linear, Linear]]) -> torch.Tensor | None:
    """int64 [experts, 8] of an MoE layer's (gate|up, down) matmuls for `moe_rows`: each
    one's codes, scale and zero addresses and bits, where every decode form is in our
    kernel's formats (q4 / q8) with one x rounding; else None."""
    rows, xbits = [], set()
    for pair in pairs:
        args = [lin.decode.native_args() for lin in pair]
        if _qmatmul is None or None in args:
            return None
        xbits.update(a[4] for a in args)
        rows.append([v for a in args for v in a[:4]])
    if len(xbits) != 1:
        return None
    table = torch.tensor(rows, dtype=torch.int64)
    table.xbits = xbits.pop()           # (the x rounding moe_rows passes on)
    return table


def moe_rows(x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             inter: int) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) for e = ids[t, j], each
    row in one call of kernels/_qmatmul.c's `moe_row` (float32, the experts in ascending id
    order: a row's result does not depend on its batch) -> [T, N] in x's dtype."""
    order = ids.argsort(dim=-1)
    ids, w = ids.gather(-1, order), weights.float().gather(-1, order).contiguous()
    tables = table[ids].contiguous()                            # [T, k, 8]
    xf = x.float().contiguous()
    t, k = xf.shape
    out = torch.zeros(t, k)
    threads = torch.get_num_threads()
    for i in range(t):
        _qmatmul.moe_row(xf[i].data_ptr(), k, tables[i].data_ptr(), w[i].data_ptr(),
                         ids.shape[1], inter, k, out[i].data_ptr(), QMM_SIMD, threads,
                         table.xbits)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
