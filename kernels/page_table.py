"""Page tables in FlashInfer's convention, built once and consumed by every attention backend.

For a batch of B sequences over a paged KV cache:
  indptr        [B + 1] int32: sequence i owns indices[indptr[i]:indptr[i + 1]]
  indices       [nnz]   int32: page ids, in token order
  last_page_len [B]     int32: valid tokens in each sequence's last page (1..page_size)
This is exactly what `flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan` and
`BatchPrefillWithPagedKVCacheWrapper.plan` take as paged_kv_indptr / indices / last_page_len.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PageTable:
    indptr: torch.Tensor          # [B + 1] int32
    indices: torch.Tensor         # [nnz_pages] int32
    last_page_len: torch.Tensor   # [B] int32
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.last_page_len.shape[0]

    def kv_len(self, i: int) -> int:
        """Tokens of sequence i covered by the table."""
        n = int(self.indptr[i + 1] - self.indptr[i])
        return 0 if n == 0 else (n - 1) * self.page_size + int(self.last_page_len[i])

    def pages(self, i: int) -> torch.Tensor:
        return self.indices[int(self.indptr[i]):int(self.indptr[i + 1])]


def build_page_table(page_ids: Sequence[Sequence[int]], kv_lens: Sequence[int], page_size: int,
                     device: torch.device | str = "cpu") -> PageTable:
    """Page table for sequences with `kv_lens[i]` tokens stored in `page_ids[i]` (extra pages ignored).

    A sequence with kv_len 0 gets no pages and last_page_len 0.
    """
    if len(page_ids) != len(kv_lens):
        raise ValueError(f"{len(page_ids)} page lists for {len(kv_lens)} sequences")
    indptr = [0]
    indices: list[int] = []
    last = []
    for pages, n in zip(page_ids, kv_lens):
        need = -(-n // page_size)
        if need > len(pages):
            raise ValueError(f"kv_len {n} needs {need} pages of {page_size}, got {len(pages)}")
        indices.extend(pages[:need])
        indptr.append(len(indices))
        last.append(0 if n == 0 else n - (need - 1) * page_size)
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return PageTable(as_t(indptr), as_t(indices), as_t(last), page_size)
