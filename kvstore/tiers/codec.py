"""PageCodec: KV pages in 8- or 4-bit codes for the tiers below the device (LeoAM's transfer
codec, FlexGen's group-wise KV quantization).

A page [2, kvh, ps, hd] (base.py) is `rows = 2 * kvh * ps` rows of `hd` values; each row is cut
into groups of `group` channels (32 or 64), each group quantized asymmetrically with its own
float16 scale and min (so keys and values, heads and tokens each get their own range). A page
becomes two parts:
- its *codes*, `rows * hd * bits / 8` bytes, which the disk tier stores (a multiple of 512
  bytes for the usual shapes, so O_DIRECT reads them at their exact size);
- its *meta*, `rows * hd / group` (scale, min) float16 pairs, which stay in memory beside the
  page's checksum (3% of the bf16 page at group 64).
The format, rounding included, is in kvstore/tiers/_kvcodec.c (the C kernels, AVX-512, AVX2
and portable paths giving the same bits); `encode_ref` / `decode_ref` here are the torch
reference the tests hold them to.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstore.tiers import _kvcodec
from kvstore.tiers.base import PageShape, round_up

CODECS = ("none", "int8", "int4")
GROUPS = (32, 64)
F16_MAX = 65504.0


@dataclass(frozen=True)
class PageCodec:
    page_shape: PageShape
    bits: int               # 8 or 4
    group: int = 64         # channels per (scale, min) pair
    ALIGN = 512             # O_DIRECT alignment of codes on disk (a sector, not a 4 KB page)

    def __post_init__(self):
        ps = self.page_shape
        if self.bits not in (8, 4):
            raise ValueError(f"the KV tier codec takes 8 or 4 bits, got {self.bits}")
        if self.group not in GROUPS or ps.head_dim % self.group:
            raise ValueError(f"--kv-tier-codec-group must be one of {GROUPS} and divide the "
                             f"head size ({ps.head_dim}), got {self.group}")
        if ps.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the KV tier codec encodes bf16 or fp32 pages, not {ps.dtype}")

    @classmethod
    def from_name(cls, name: str, page_shape: PageShape, group: int = 0) -> PageCodec | None:
        """`none` -> None; `int8` / `int4` -> the codec (group 0: 64 for int8, 32 for int4:
        needle at ~4K, every page through the codec, 25 prompts: int4 at 64 68%, at 32 80%,
        uncompressed and int8 88%)."""
        if name not in CODECS:
            raise ValueError(f"--kv-tier-codec must be one of {CODECS}, got {name!r}")
        bits = int(name[3:]) if name != "none" else 0
        return None if name == "none" else cls(page_shape, bits, group or (64 if bits == 8 else 32))

    @property
    def name(self) -> str:
        return f"int{self.bits}-g{self.group}"

    @property
    def rows(self) -> int:
        ps = self.page_shape
        return 2 * ps.num_kv_heads * ps.page_size

    @property
    def code_bytes(self) -> int:
        """Bytes of one page's codes."""
        return self.rows * self.page_shape.head_dim * self.bits // 8

    @property
    def stride(self) -> int:
        """Bytes a page's codes take on disk: rounded up to ALIGN (the usual shapes need no
        rounding: 16 tokens x 64 channels make 1024 values a head)."""
        return round_up(self.code_bytes, self.ALIGN)

    @property
    def meta_values(self) -> int:
        """float16 values of one page's meta: (scale, min) per group."""
        return 2 * self.rows * (self.page_shape.head_dim // self.group)

    @property
    def meta_bytes(self) -> int:
        return 2 * self.meta_values

    @property
    def _bf16(self) -> int:
        return int(self.page_shape.dtype == torch.bfloat16)

    # -- C kernels over page addresses -------------------------------------------------------

    def encode(self, src: np.ndarray, codes: np.ndarray, meta: np.ndarray) -> None:
        """Pages at the addresses src (uint64 [n]) to codes at codes[j] and meta at meta[j]."""
        _kvcodec.encode(src, codes, meta, self.rows, self.page_shape.head_dim, self.group,
                        self.bits, self._bf16)

    def decode(self, codes: np.ndarray, meta: np.ndarray, dst: np.ndarray,
               simd: int = 2) -> None:
        """codes[j] and meta[j] (addresses, uint64 [n]) to the page at dst[j]."""
        _kvcodec.decode(codes, meta, dst, self.rows, self.page_shape.head_dim, self.group,
                        self.bits, self._bf16, simd)

    def io_transform(self, op: str, staging: np.ndarray, keys: np.ndarray, pages: np.ndarray,
                     rows: np.ndarray, meta: np.ndarray):
        """For the disk tier's I/O threads (extent_io.ExtentJob.transform): between
        pages[rows[j]] (uint8 [slots, page bytes]) and row j of a staging buffer of codes
        [n, code_bytes] cut from `staging`, with key j's scales at meta[keys[j]]: encode before
        a write ("write"), decode after a read. Returns (transform(s0, s1) over pages s0..s1-1,
        the staging rows)."""
        n, pitch = keys.shape[0], self.code_bytes
        stage = staging[:n * pitch].reshape(n, pitch)
        codes = np.uint64(stage.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(pitch)
        page = np.uint64(pages.ctypes.data) + rows.astype(np.uint64) * np.uint64(pages.strides[0])
        scales = np.uint64(meta.ctypes.data) + keys.astype(np.uint64) * np.uint64(self.meta_bytes)
        if op == "write":
            def transform(s0: int, s1: int) -> None:
                self.encode(page[s0:s1], codes[s0:s1], scales[s0:s1])
        else:
            def transform(s0: int, s1: int) -> None:
                self.decode(codes[s0:s1], scales[s0:s1], page[s0:s1])
        return transform, stage

    # -- tensors (tests, benches, the needle bench's worst case) -----------------------------

    def encode_pages(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pages [n, 2, kvh, ps, hd] (CPU) -> (codes uint8 [n, code_bytes], meta float16
        [n, meta_values]) by the C kernel."""
        pages = self._check(pages)
        n = pages.shape[0]
        codes = torch.empty(n, self.code_bytes, dtype=torch.uint8)
        meta = torch.empty(n, self.meta_values, dtype=torch.float16)
        self.encode(_addrs(pages), _addrs(codes), _addrs(meta))
        return codes, meta

    def decode_pages(self, codes: torch.Tensor, meta: torch.Tensor, simd: int = 2) -> torch.Tensor:
        n = codes.shape[0]
        out = torch.empty(n, *self.page_shape.shape, dtype=self.page_shape.dtype)
        self.decode(_addrs(codes.contiguous()), _addrs(meta.contiguous()), _addrs(out), simd)
        return out

    def round_trip(self, pages: torch.Tensor) -> torch.Tensor:
        """What pages come back as from a tier that stores them with this codec."""
        return self.decode_pages(*self.encode_pages(pages))

    def encode_ref(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference of `encode_pages` (same bits)."""
        x = self._check(pages).float().clamp(-F16_MAX, F16_MAX)
        n, levels = x.shape[0], float((1 << self.bits) - 1)
        g = x.reshape(n, self.rows, -1, self.group)
        mn = g.amin(-1, keepdim=True).to(torch.float16)
        mnf = mn.float()
        s = ((g.amax(-1, keepdim=True) - mnf) / levels).to(torch.float16)
        sf = s.float()
        c = torch.where(sf > 0, torch.round((g - mnf) / torch.where(sf > 0, sf, 1.0)), 0.0)
        c = c.clamp(0, levels).to(torch.uint8).reshape(n, -1)
        if self.bits == 4:
            c = c[:, 0::2] | (c[:, 1::2] << 4)
        meta = torch.cat([s, mn], -1).reshape(n, -1)
        return c, meta

    def decode_ref(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        c = codes
        if self.bits == 4:
            c = torch.stack([c & 15, c >> 4], -1).reshape(n, -1)
        c = c.float().reshape(n, self.rows, -1, self.group)
        m = meta.reshape(n, self.rows, -1, 2).float()
        y = c * m[..., :1] + m[..., 1:]
        return y.to(self.page_shape.dtype).reshape(n, *self.page_shape.shape)

    def _check(self, pages: torch.Tensor) -> torch.Tensor:
        want = (*self.page_shape.shape,)
        if pages.dim() != 5 or tuple(pages.shape[1:]) != want \
                or pages.dtype != self.page_shape.dtype or pages.device.type != "cpu":
            raise ValueError(f"codec: pages must be CPU {self.page_shape.dtype} [n, {want}], "
                             f"got {pages.dtype} {tuple(pages.shape)} on {pages.device}")
        return pages.contiguous()


def _addrs(t: torch.Tensor) -> np.ndarray:
    """uint64 [n]: the address of each row t[j] of a contiguous tensor."""
    n = t.shape[0]
    row = t[0].numel() * t.element_size() if n else 0
    return np.uint64(t.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(row)


def best_simd() -> int:
    """The decode path this CPU runs: 2 AVX-512, 1 AVX2, 0 portable."""
    return _kvcodec.best_simd()
