"""The C decode attention of one step's sequences in every layer, its arguments made once a step.

A resident decode step (kvstore/resident.py) calls the attention of the same sequences over
the same table shape in each of its ~30 layers; only the layer's slots (a row of a [L, N]
tensor) and its queries change. NativeSparseDecode.forward / forward_selected check and
convert their inputs per call (~15-20 us of Python a layer against the kernel's ~50 at 1K
tokens). A plan does that once a step; a layer's call is the kernel call alone, the same bits:

- `table_plan`: forward over a fixed head table (dense decode: every page of each row);
- `selected_plan`: forward_selected over a layer's page selection (sparse decode).

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

import torch

from kernels.page_table import PageTable
from kernels.sparse_attention import NativeSparseDecode

try:
    from kernels import _decode
except ImportError:         # a checkout whose extensions are not built (then no plan serves)
    _decode = None


def _int64s(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.int64 and t.is_contiguous() for t in tensors)


def _served(kernel: NativeSparseDecode, kv_pool: torch.Tensor, group: int) -> bool:
    """Whether the C kernel serves the pool (NativeSparseDecode.supports, any queries)."""
    return kernel.supports(torch.empty(1, kv_pool.shape[2] * group, kv_pool.shape[4]),
                           kv_pool, group)


class _Plan:
    """What every call shares: the pool, the shapes, the kernel's settings."""

    def __init__(self, kernel: NativeSparseDecode, kv_pool: torch.Tensor, group: int,
                 batch: int, slots: torch.Tensor):
        self.b, self.kvh, self.group = batch, kv_pool.shape[2], group
        self.h, self.d, self.slots = self.kvh * group, kv_pool.shape[4], slots
        self.pool = kv_pool                 # read by address
        self.pool_args = (kv_pool.data_ptr(), int(kv_pool.dtype == torch.bfloat16), self.kvh,
                          kv_pool.shape[3], self.d, group)
        self.simd, self.threads = int(kernel.simd), kernel.threads or torch.get_num_threads()

    def _check(self, layer: int, qf: torch.Tensor) -> None:
        if qf.dtype != torch.float32 or not qf.is_contiguous() or not qf.is_cpu \
                or qf.shape != (self.b, self.h, self.d) or not 0 <= layer < self.slots.shape[0]:
            raise ValueError(f"{type(self).__name__}: float32 contiguous queries "
                             f"[{self.b}, {self.h}, {self.d}] and one of its "
                             f"{self.slots.shape[0]} layers, got {qf.dtype} "
                             f"{tuple(qf.shape)}, layer {layer}")

    def _out(self) -> tuple[torch.Tensor, int, int]:
        """A float32 output [B, H, D] and its log-sum-exp after it: (out, address, lse's)."""
        n = self.b * self.h * self.d
        buf = torch.empty(n + self.b * self.h, dtype=torch.float32)
        return buf[:n].view(self.b, self.h, self.d), buf.data_ptr(), buf.data_ptr() + 4 * n

    def _layer_slots(self, layer: int) -> int:
        return self.slots.data_ptr() + layer * self.slots.shape[1] * 8


def table_plan(kernel: NativeSparseDecode, kv_pool: torch.Tensor, group: int,
               table: PageTable, slots: torch.Tensor) -> TablePlan | None:
    """forward(q, kv_pool, PageTable(table.indptr, slots[l], table.last_page_len), group,
    scale) of layer l, for slots int64 [L, entries]; None where the C kernel does not
    serve the pool (then forward, layer by layer)."""
    rows = table.indptr.numel() - 1
    if not _served(kernel, kv_pool, group) or slots.dim() != 2 or not _int64s(slots) \
            or table.page_size != kv_pool.shape[3] or rows % kv_pool.shape[2] \
            or slots.shape[1] != table.indices.numel():
        return None
    return TablePlan(kernel, kv_pool, group, table, slots)


class TablePlan(_Plan):
    def __init__(self, kernel: NativeSparseDecode, kv_pool: torch.Tensor, group: int,
                 table: PageTable, slots: torch.Tensor):
        super().__init__(kernel, kv_pool, group, (table.indptr.numel() - 1) // kv_pool.shape[2],
                         slots)
        self.indptr = table.indptr.to(torch.int64).contiguous()
        self.last = table.last_page_len.to(torch.int32).contiguous()

    def __call__(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Layer `layer`'s attention of q [B, H, D]: [B, H, D] in q's dtype."""
        qf = q.to(torch.float32).contiguous()
        self._check(layer, qf)
        out, o, lse = self._out()
        _decode.sparse_decode(qf.data_ptr(), *self.pool_args, self.indptr.data_ptr(),
                              self._layer_slots(layer), self.last.data_ptr(),
                              self.b * self.kvh, scale, o, lse, False, self.pool.shape[0],
                              self.simd, self.threads, 0)
        return out.to(q.dtype)


def selected_plan(kernel: NativeSparseDecode, kv_pool: torch.Tensor, group: int,
                  slots: torch.Tensor, starts: torch.Tensor, last_len: torch.Tensor,
                  marks: tuple[torch.Tensor, int], key_stride: int,
                  page_ids: torch.Tensor) -> SelectedPlan | None:
    """forward_selected for the same sequences in every layer of a step: slots int64 [L, N]
    (row l: forward_selected's layer_slots of layer l), layer l's key_base = l * key_stride;
    the rest as forward_selected's. None where the C kernel does not serve the pool (then
    forward_selected, layer by layer)."""
    if not _served(kernel, kv_pool, group) or slots.dim() != 2 \
            or not _int64s(slots, starts, marks[0], page_ids) \
            or last_len.dtype != torch.int32 or not last_len.is_contiguous() \
            or page_ids.dim() != 2 or page_ids.shape[0] != starts.numel() \
            or last_len.numel() != starts.numel():
        return None
    return SelectedPlan(kernel, kv_pool, group, slots, starts, last_len, marks, key_stride,
                        page_ids)


class SelectedPlan(_Plan):
    def __init__(self, kernel: NativeSparseDecode, kv_pool: torch.Tensor, group: int,
                 slots: torch.Tensor, starts: torch.Tensor, last_len: torch.Tensor,
                 marks: tuple[torch.Tensor, int], key_stride: int, page_ids: torch.Tensor):
        super().__init__(kernel, kv_pool, group, starts.numel(), slots)
        self.key_stride = key_stride
        self._keep = (starts, last_len, marks[0], page_ids)     # read by address
        self.seq_args = (starts.data_ptr(), last_len.data_ptr(), marks[0].data_ptr(),
                         marks[0].numel(), marks[1])
        self.ids = (page_ids.data_ptr(), page_ids.shape[1])

    def __call__(self, layer: int, qf: torch.Tensor, sel, scale: float) -> torch.Tensor:
        """Layer `layer`'s attention of qf [B, H, D] (float32, contiguous) to the pages of
        `sel` (kernels/page_topk.py's SelectedPages of these sequences): [B, H, D]
        float32."""
        self._check(layer, qf)
        if sel.indptr.numel() != self.b * self.kvh + 1 or not _int64s(sel.indptr,
                                                                      sel.page_indices):
            raise ValueError(f"SelectedPlan: a selection of {self.b} sequences' {self.kvh} "
                             f"rows in contiguous int64 tensors, got "
                             f"{sel.indptr.numel() - 1} rows")
        out, o, lse = self._out()
        _decode.sparse_decode_selected(
            qf.data_ptr(), *self.pool_args, self.b, sel.indptr.data_ptr(),
            sel.page_indices.data_ptr(), self._layer_slots(layer), self.slots.shape[1],
            *self.seq_args, layer * self.key_stride, *self.ids, scale, o, lse,
            self.pool.shape[0], self.simd, self.threads)
        return out

    def native_words(self) -> tuple[list[int], list[list[int]]]:
        """What kernels/_layer.c's sparse layers read to run this plan in C: (the step's words:
        slots a layer, starts, last lengths, marks, their count, the completed step, page
        ids, their stride, simd, threads; a row a layer: its slots' address, key base)."""
        head = [self.slots.shape[1], *self.seq_args, *self.ids, self.simd, self.threads]
        return head, [[self._layer_slots(lay), lay * self.key_stride]
                      for lay in range(self.slots.shape[0])]
