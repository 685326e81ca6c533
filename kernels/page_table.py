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

    def per_head(self, heads: int) -> "PageTable":
        """Every row's pages once per KV head: row b * heads + h of the result lists row b's
        pages (a decode over every page, as the sparse kernel's per-head rows)."""
        counts = (self.indptr[1:] - self.indptr[:-1]).long().repeat_interleave(heads)
        indptr = torch.zeros(counts.numel() + 1, dtype=self.indptr.dtype,
                             device=self.indptr.device)
        indptr[1:] = torch.cumsum(counts, 0)
        # entry j of row b * heads + h is entry indptr[b] + j - new indptr[b * heads + h]
        shift = self.indptr[:-1].long().repeat_interleave(heads) - indptr[:-1].long()
        src = torch.arange(int(indptr[-1]), device=counts.device) \
            + torch.repeat_interleave(shift, counts)
        return PageTable(indptr, self.indices[src], self.last_page_len.repeat_interleave(heads),
                         self.page_size)

    def split(self, first: torch.Tensor) -> tuple["PageTable", "PageTable"]:
        """The entries where `first` [nnz] bool is True, and the others: two tables over the
        same rows, in the same order. A row's last_page_len goes with its last entry; in the
        other table that row ends with a full page (page_size)."""
        counts = (self.indptr[1:] - self.indptr[:-1]).long()
        seen = torch.zeros(first.numel() + 1, dtype=torch.int64, device=first.device)
        torch.cumsum(first, 0, out=seen[1:])                    # `first` entries before each
        n_first = seen[self.indptr[1:].long()] - seen[self.indptr[:-1].long()]
        last_first = first[(self.indptr[1:].long() - 1).clamp(min=0)] & (counts > 0)
        full = torch.full_like(self.last_page_len, self.page_size)

        def table(n: torch.Tensor, keep: torch.Tensor, last: torch.Tensor) -> PageTable:
            indptr = torch.zeros_like(self.indptr)
            torch.cumsum(n, 0, out=indptr[1:])
            return PageTable(indptr, self.indices[keep], last, self.page_size)

        return (table(n_first, first, torch.where(last_first, self.last_page_len, full)),
                table(counts - n_first, ~first, torch.where(last_first, full, self.last_page_len)))


def build_page_table(page_ids: Sequence[Sequence[int]], kv_lens: Sequence[int], page_size: int,
                     device: torch.device | str = "cpu") -> PageTable:
    """Page table for sequences with `kv_lens[i]` tokens stored in `page_ids[i]` (extra pages
    ignored).

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


def build_head_page_table(indptr: torch.Tensor, page_indices: torch.Tensor,
                          slot_table: torch.Tensor, kv_lens: torch.Tensor | Sequence[int],
                          page_size: int) -> PageTable:
    """Page table with one row per (sequence, KV head), for sparse decode (vectorised).

    indptr       [R + 1] int: R = B * KVH rows, row r = b * KVH + h belongs to sequence b
    page_indices [nnz] int:   per row, ascending positions in the sequence's page list
    slot_table   [B, max_pages] int: cache slot of each page of each sequence
    kv_lens      [B]: tokens of each sequence
    Row r lists slot_table[b, page_indices of r]. Its last_page_len is the sequence's own
    last_page_len when the row ends with the sequence's last (possibly partial) page, and
    page_size otherwise: every page but the sequence's last is full. An empty row gets 0.
    """
    dev = slot_table.device
    b_size = slot_table.shape[0]
    indptr = indptr.to(dev, torch.int64)
    page_indices = page_indices.to(dev, torch.int64)
    rows = indptr.shape[0] - 1
    if b_size == 0 or rows % b_size:
        raise ValueError(f"{rows} rows is not a multiple of {b_size} sequences")
    kvh = rows // b_size
    kv_lens = torch.as_tensor(kv_lens, dtype=torch.int64, device=dev)
    n_pages = (kv_lens + page_size - 1) // page_size                # [B]
    counts = indptr[1:] - indptr[:-1]                               # [R]
    seq_of_entry = torch.repeat_interleave(
        torch.arange(rows, device=dev) // kvh, counts, output_size=page_indices.shape[0])
    if page_indices.numel() and bool((page_indices >= n_pages[seq_of_entry]).any()):
        raise ValueError("a page index is past its sequence's last page")
    slots = slot_table[seq_of_entry, page_indices]
    seq_of_row = torch.arange(rows, device=dev) // kvh
    last_idx = page_indices[(indptr[1:] - 1).clamp(min=0)] if page_indices.numel() \
        else torch.zeros(rows, dtype=torch.int64, device=dev)
    seq_last = kv_lens - (n_pages - 1) * page_size                  # [B], 1..page_size
    ends_seq = last_idx == n_pages[seq_of_row] - 1
    last = torch.where(ends_seq, seq_last[seq_of_row], page_size)
    last = torch.where(counts > 0, last, 0)
    as_i32 = lambda x: x.to(torch.int32)  # noqa: E731
    return PageTable(as_i32(indptr), as_i32(slots), as_i32(last), page_size)


def selected_head_table(sel, union_slots: torch.Tensor, last_len: torch.Tensor,
                        page_size: int) -> tuple[PageTable, torch.Tensor]:
    """A sparse decode's rows over device slots: row b * KVH + h lists the slots of the pages
    head h of sequence b selected (kernels/page_topk.py's SelectedPages `sel`: ascending,
    the partial last page last), union_slots [nnz_union] the slots of sel's union pages,
    last_len [B] int32 each sequence's last page length. Returns (the table, each entry's
    position among the union's pages)."""
    kvh, b_size = sel.num_kv_heads, sel.batch_size
    pos = sel.union_pos
    if pos is None:             # not listed by the selection: found among the union's
        span = int(sel.union_indices.max()) + 1 if sel.union_indices.numel() else 1
        b_of_union = torch.repeat_interleave(torch.arange(b_size), sel.union_indptr.diff())
        rows_per_b = sel.indptr.diff().view(b_size, kvh).sum(1)
        b_of_entry = torch.repeat_interleave(torch.arange(b_size), rows_per_b)
        pos = torch.searchsorted(b_of_union * span + sel.union_indices,      # ascending
                                 b_of_entry * span + sel.page_indices)
    return PageTable(sel.indptr.to(torch.int32), union_slots[pos].to(torch.int32),
                     last_len.repeat_interleave(kvh), page_size), pos
