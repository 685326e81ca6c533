"""GGUF quantized blocks as GroupQuant: integer codes and, per group of 32, a scale and a zero.

`decode(kind, raw)` turns one tensor's blocks (the file's bytes, [N, K / block * block bytes]
uint8) into the groups our packed kernels run (kernels/packed_linear.py), or None for a type
kept out (dequantized by the `gguf` package instead):

  type   ggml's weight                     our groups of 32
  Q4_0   d (q - 8)        q 4-bit          4-bit, scale d, zero -8 d           exact
  Q4_1   d q + m                           4-bit, scale d, zero m              exact
  Q4_K   d sc q - dmin m  (sub-blocks 32)  4-bit, scale d sc, zero -dmin m     exact
  Q8_0   d q              q 8-bit          8-bit, scale d                      exact
  Q5_0   d (q - 16)       q 5-bit          8-bit codes q - 16, scale d         exact
  Q5_1   d q + m                           8-bit codes q, scale d, zero m      exact
  Q5_K   d sc q - dmin m  (sub-blocks 32)  8-bit, scale d sc, zero -dmin m     exact
  Q6_K   d sc q, q 6-bit  (sub-blocks 16)  8-bit, one scale for two sub-blocks (below)
  Q3_K   d sc q, q 3-bit, sc 6-bit (16s)   8-bit codes sc q, scale d (or -d)   exact
  IQ4_NL d kv[q], kv a 4-bit codebook      8-bit codes kv[q], scale d          exact
  IQ4_XS d sc kv[q]       (sub-blocks 32)  8-bit codes kv[q], scale d sc       exact

"exact": the group's dequantization equals the `gguf` package's bit for bit (tests/
test_weights.py); our kernel then holds scales and zeros as float16. Q6_K's sub-blocks of 16
have a scale each, and our groups of 32 one: a group whose codes q sc / g fit a byte (g the
two scales' greatest common divisor) is exact; any other is expressed in a quarter of its
larger sub-block's step (codes 4 q there, exact), the other sub-block rounded to that unit
(at most 1/8 of the larger sub-block's step off: a quarter of the file's own rounding bound
in that sub-block); the dense form keeps the file's values (`GroupQuant.values`). Q4_K_M and
Q5_K_M files store their output head and some attn_v / ffn_down tensors as Q6_K.

Leaf module: numpy, torch and kernels/packed_linear.py.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.packed_linear import GROUP, GroupQuant

# bytes per block: of 32 weights (Q4_0 .. Q8_0, IQ4_NL), of 256 (the K types, IQ4_XS)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "IQ4_NL": 18,
               "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
BLOCK_WEIGHTS = {k: 256 if k.endswith(("_K", "_XS")) else 32 for k in BLOCK_BYTES}
# the width each type's codes take in our kernels
BITS = {k: 4 if k in ("Q4_0", "Q4_1", "Q4_K") else 8 for k in BLOCK_BYTES}
# IQ4_NL / IQ4_XS's codebook (ggml's kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                      np.int16)


def decode(kind: str, raw: np.ndarray) -> GroupQuant | None:
    """One tensor's blocks, raw uint8 [N, ...] -> GroupQuant [N, K]; None for other types."""
    if kind not in BLOCK_BYTES:
        return None
    n = raw.shape[0]
    b = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[kind])
    return _DECODERS[kind](b)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [N, blocks]."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _quant(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int
           ) -> GroupQuant:
    n = codes.shape[0]
    s = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, -1))
    z = torch.zeros_like(s) if zero is None else torch.from_numpy(
        np.ascontiguousarray(zero, dtype=np.float32).reshape(n, -1))
    return GroupQuant(torch.from_numpy(codes.astype(np.int16).reshape(n, -1)), s, z, bits)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-block's 16 bytes -> its 32 low bits: byte j holds weight j (low nibble) and
    weight j + 16 (high nibble)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes of fifth bits (a little-endian uint32: bit j is weight j's)."""
    word = qh.copy().view("<u4")                                # [N, blocks, 1]
    return ((word >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> GroupQuant:
    d = _f16(b, 0)
    return _quant(_nibbles(b[..., 2:18]), d, -8 * d, 4)


def _q4_1(b: np.ndarray) -> GroupQuant:
    return _quant(_nibbles(b[..., 4:20]), _f16(b, 0), _f16(b, 2), 4)


def _q8_0(b: np.ndarray) -> GroupQuant:
    return _quant(b[..., 2:].copy().view(np.int8), _f16(b, 0), None, 8)


def _q5_0(b: np.ndarray) -> GroupQuant:
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4)
    return _quant(q.astype(np.int16) - 16, _f16(b, 0), None, 8)


def _q5_1(b: np.ndarray) -> GroupQuant:
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4)
    return _quant(q, _f16(b, 0), _f16(b, 2), 8)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 6-bit scales and mins of a super-block's eight sub-blocks, packed in
    its 12 bytes from byte 4 (ggml's `get_scale_min_k4`): [N, blocks, 8] each."""
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), m.astype(np.float32)


def _q4_k(b: np.ndarray) -> GroupQuant:
    """Q4_K: 4-bit codes, 32 bytes for sub-blocks 2i (low nibbles) and 2i + 1 (high)."""
    n = b.shape[0]
    sc, m = _k_scales(b)
    q = b[..., 16:144].reshape(n, -1, 4, 1, 32)
    codes = np.concatenate([q & 0x0F, q >> 4], axis=3)
    return _quant(codes, _f16(b, 0)[..., None] * sc, -(_f16(b, 2)[..., None] * m), 4)


def _q5_k(b: np.ndarray) -> GroupQuant:
    """Q5_K: Q4_K's low nibbles (from byte 48) and a fifth bit, bit j of the 32 bytes from
    byte 16 for sub-block j."""
    n = b.shape[0]
    sc, m = _k_scales(b)
    q = b[..., 48:176].reshape(n, -1, 4, 1, 32)
    low = np.concatenate([q & 0x0F, q >> 4], axis=3).reshape(n, -1, 8, 32)
    high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1      # [N, blocks, 32, 8]
    codes = low | (high.transpose(0, 1, 3, 2) << 4)
    return _quant(codes, _f16(b, 0)[..., None] * sc, -(_f16(b, 2)[..., None] * m), 8)


def _q6_k_codes(b: np.ndarray) -> np.ndarray:
    """Q6_K's signed 6-bit codes [N, blocks, 16 sub-blocks, 16]: low 4 bits in 128 bytes (two
    halves of 64: low nibbles then high nibbles), high 2 bits in 64 (two halves of 32: bit
    pairs 0, 2, 4, 6), minus 32."""
    n = b.shape[0]
    ql = b[..., 0:128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (ql & 0x0F).reshape(n, -1, 8, 32)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    qh = (qh & 0x03).reshape(n, -1, 8, 32)
    return ((ql | (qh << 4)).astype(np.int16) - 32).reshape(n, -1, 16, 16)


def _q6_k(b: np.ndarray) -> GroupQuant:
    """Q6_K: the file's values, and groups of 32 that round them: a group is two sub-blocks
    of 16 with int8 scales sa, sb. Its step is d u: u = gcd(sa, sb) where every code q s / u
    fits a byte (exact), else a quarter of the larger scale, signed: codes 4 q in its
    sub-block (exact), rounded in the other (which is also exact where the scales' ratio
    makes them whole: every ratio of 4 that overflows the first choice). Each sub-block's
    codes are q f, f = s / u (whole where exact), in float32 (torch: the big tensors' passes
    on every core)."""
    q = torch.from_numpy(_q6_k_codes(b)).float()                # [N, blocks, 16, 16]
    n, blocks = q.shape[:2]
    sc = torch.from_numpy(b[..., 192:208].copy().view(np.int8)).int().view(n, blocks, 8, 2)
    g = torch.gcd(sc[..., 0], sc[..., 1]).clamp_min(1)[..., None]  # (0: an all-zero group)
    whole = torch.div(sc, g, rounding_mode="floor").view(n, blocks, 16, 1).float()
    lo, hi = torch.aminmax(q, dim=-1, keepdim=True)
    ends = torch.cat([lo * whole, hi * whole], -1).view(n, blocks, 8, 4)
    fits = ((ends.amax(-1) <= 127) & (ends.amin(-1) >= -128))[..., None]
    big = torch.where(sc[..., :1].abs() >= sc[..., 1:].abs(), sc[..., :1], sc[..., 1:])
    unit = torch.where(fits, g.float(), big / 4)                       # [N, blocks, 8, 1]
    f = (sc / unit).view(n, blocks, 16, 1)
    d = torch.from_numpy(_f16(b, 208))[..., None]
    values = (d * sc.view(n, blocks, 16).float())[..., None] * q
    codes = q.mul_(f).round_().clamp_(-128, 127).to(torch.int16)      # (in place: q is done)
    return GroupQuant(codes.view(n, -1), (d * unit[..., 0]).view(n, -1),
                      torch.zeros(n, blocks * 8), 8, values.view(n, -1))


def _q3_k(b: np.ndarray) -> GroupQuant:
    """Q3_K: 2 low bits in 64 bytes (two halves of 32: bit pairs 0, 2, 4, 6), a high bit in 32
    (bits 0..7: q = low - 4 where it is clear), sixteen 6-bit scales sc - 32 packed in 12
    bytes (low nibbles in bytes 0-7, then 2 high bits from bytes 8-11), float16 d at 108.
    Codes sc q lie in -124..128; a group holding 128 takes step -d and negated codes."""
    n = b.shape[0]
    low = (b[..., 32:96].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None])
    high = b[..., 0:32].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    q = (low & 3).reshape(n, -1, 8, 32).astype(np.int16) - 4 * (1 - (high & 1))
    s = b[..., 96:108]
    lo = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], -1)
    hi = (s[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(n, -1, 16)
    sc = (lo | ((hi & 3) << 4)).astype(np.int16) - 32
    codes = (q.reshape(n, -1, 16, 16) * sc[..., None]).reshape(n, -1, 8, 32)
    sign = np.where((codes == 128).any(-1), -1, 1).astype(np.int16)
    return _quant(codes * sign[..., None], _f16(b, 108)[..., None] * sign, None, 8)


def _iq4_nl(b: np.ndarray) -> GroupQuant:
    return _quant(IQ4_VALUES[_nibbles(b[..., 2:18])], _f16(b, 0), None, 8)


def _iq4_xs(b: np.ndarray) -> GroupQuant:
    """IQ4_XS: float16 d, eight 6-bit scales sc - 32 (low nibbles in bytes 4-7, sub-blocks
    2i and 2i + 1 in byte i; 2 high bits each in the uint16 at byte 2), 16 bytes of
    codebook indices a sub-block of 32."""
    n = b.shape[0]
    lo = b[..., 4:8, None] >> np.array([0, 4], np.uint8)
    hi = b[..., 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)
    sc = ((lo.reshape(n, -1, 8) & 0x0F) | ((hi & 3).astype(np.uint8) << 4)).astype(np.int16)
    idx = _nibbles(b[..., 8:136].reshape(n, -1, 8, 16))
    return _quant(IQ4_VALUES[idx], _f16(b, 0)[..., None] * (sc - 32), None, 8)


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q3_K": _q3_k, "IQ4_NL": _iq4_nl,
             "IQ4_XS": _iq4_xs}
