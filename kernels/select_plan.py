"""native_select over the same sequences in every layer of a decode step, prepared once a step.

A resident sparse decode step (kvstore/resident.py) selects the pages of the same sequences in
each of its ~30 layers with the same counts, budgets and summary tensors; only the layer's
summaries (a fixed stride further on) and its queries change. `native_select` checks its
inputs, packs their addresses into a tensor and carves its output buffer per call: ~23 us of
Python a layer against the C call's ~30-50. `SelectPlan` does that once a step (every layer's
inputs in one tensor, one output buffer for all layers), and a layer's `select` is the C call
and the views of its outputs: the same SelectedPages, bit for bit.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch

from kernels import page_select
from kernels.page_select import (call_select, native_budget, native_select_serves,
                                 select_outputs, selected_pages)
from kernels.page_topk import SelectedPages, check_budget

try:
    from kernels import _select
except ImportError:         # a checkout whose extensions are not built (`make setup` builds them)
    _select = None


LayerBudget = tuple[int, int, "torch.Tensor | None"]


def layer_budgets(budgets: Sequence[tuple[int | torch.Tensor, int | torch.Tensor]],
                  num_kv_heads: int, sink_pages: int, local_pages: int) -> list[LayerBudget]:
    """Each layer's (budget pages, prior pages), one for all heads or one per KV head, as
    the C selection takes them (page_select.native_budget), checked."""
    for budget, _ in budgets:
        check_budget(budget, sink_pages, local_pages)
    return [native_budget(budget, prior, num_kv_heads) for budget, prior in budgets]


def _layered(tensors: Sequence[torch.Tensor | None], counts: list[int], layers: int,
             dims: int) -> bool:
    """Whether each tensor (None allowed but in the first) is contiguous [layers, >= its
    count, ...] with `dims` dims after the layer."""
    return tensors[0] is not None and all(
        t is None or (t.dim() == dims + 1 and t.shape[0] == layers and t.shape[1] >= n
                      and t.is_contiguous()) for t, n in zip(tensors, counts))


def _addresses(tensors: Sequence[torch.Tensor | None], layer: int) -> list[int]:
    """The address of each tensor's `layer` (t[layer]), 0 for None."""
    return [0 if t is None else t.data_ptr() + layer * t.stride(0) * t.element_size()
            for t in tensors]


class SelectPlan:
    """Every layer's native_select inputs and outputs of one step's sequences (`build`)."""

    def __init__(self, summaries: Sequence[torch.Tensor], counts: list[int], group: int,
                 quest: bool, budgets: Sequence[LayerBudget], sink_pages: int,
                 local_pages: int, priors: Sequence[torch.Tensor | None] | None,
                 threads: int):
        """See `build` (which checks that the C selection serves these inputs)."""
        b_size, layers = len(counts), len(budgets)
        kvh, d = summaries[0].shape[2], summaries[0].shape[4]
        self.kvh, self.group, self.d, self.quest, self.threads = kvh, group, d, quest, threads
        self.b_size, self.sink, self.local = b_size, sink_pages, local_pages
        self.bf16 = summaries[0].dtype == torch.bfloat16
        p_max = max(counts, default=0)
        # per layer: [summary addresses (B), counts (B), prior addresses (B, 0: none)]
        self.ins = torch.tensor([_addresses(summaries, lay) + list(counts) + (
            [] if priors is None else _addresses(priors, lay)) for lay in range(layers)],
            dtype=torch.int64)
        self.has_priors = priors is not None
        self._keep = (summaries, priors)    # the C call reads them by address
        self.layers = budgets           # (budget, prior pages, per-head plan) of each layer
        k = max((min(p_max, max(bud, sink_pages + local_pages)) for bud, _, _ in budgets),
                default=0)
        self.sizes = select_outputs(b_size, kvh, k, p_max)
        self.out = torch.empty(layers, sum(self.sizes), dtype=torch.int64)

    @classmethod
    def build(cls, summaries: Sequence[torch.Tensor], counts: list[int], group: int,
              quest: bool, budgets: Sequence[LayerBudget], sink_pages: int,
              local_pages: int, priors: Sequence[torch.Tensor | None] | None, threads: int
              ) -> SelectPlan | None:
        """The plan of sequences whose page summaries of every layer are `summaries` (B
        tensors [L, >= counts[b], KVH, 3, D]), with each layer's `budgets` (`layer_budgets`)
        and `priors` (B tensors [L, >= counts[b], KVH] float32 or None; None: no priors),
        or None where the C selection does not
        serve them (native_select_serves; then `native_select` or torch, layer by layer)."""
        if _select is None or not summaries or not counts or len(summaries) != len(counts) \
                or priors is not None and len(priors) != len(counts) \
                or not _layered(summaries, counts, len(budgets), 4) \
                or priors is not None and not _layered(priors, counts, len(budgets), 2):
            return None
        kvh, d = summaries[0].shape[2], summaries[0].shape[4]
        if summaries[0].shape[3] != 3 or any(s.shape[2:] != summaries[0].shape[2:]
                                             for s in summaries) or priors is not None and \
                any(p is not None and p.shape[2] != kvh for p in priors):
            return None
        # the per-layer check (the same for every layer of these tensors)
        if not native_select_serves(
                torch.empty(1, kvh * group, d), [s[0] for s in summaries],
                None if priors is None else [None if p is None else p[0] for p in priors]):
            return None
        return cls(summaries, counts, group, quest, budgets, sink_pages, local_pages, priors,
                   threads)

    def select(self, layer: int, qf: torch.Tensor) -> SelectedPages:
        """The pages of layer `layer` for queries qf [B, H, D] (float32, contiguous): what
        native_select returns for that layer's summaries, budgets and priors."""
        b = self.b_size
        if qf.dtype != torch.float32 or not qf.is_contiguous() or not qf.is_cpu \
                or qf.shape != (b, self.kvh * self.group, self.d) \
                or not 0 <= layer < len(self.layers):
            raise ValueError(f"SelectPlan.select wants one of its {len(self.layers)} layers "
                             f"and float32 contiguous queries [{b}, {self.kvh * self.group}, "
                             f"{self.d}], got layer {layer}, {qf.dtype} {tuple(qf.shape)}")
        return call_select(qf, self.ins.data_ptr() + layer * self.ins.stride(0) * 8,
                           self.has_priors, self.bf16, self.quest, self.kvh, self.group,
                           self.layers[layer], self.sink, self.local, self.out[layer],
                           self.sizes, 0, self.threads)

    def native_words(self) -> tuple[list[int], list[list[int]]]:
        """What kernels/_layer.c's sparse layers read to run `select` in C: (the step's words:
        priors, bf16 summaries, quest, sink, local, simd, threads, and the offsets of the
        output's parts after its indptr; a row a layer: its inputs' and output's addresses,
        budget pages, prior pages, per-head budgets' address or 0)."""
        offs = list(accumulate(self.sizes[:4]))
        head = [int(self.has_priors), int(self.bf16), int(self.quest), self.sink, self.local,
                int(page_select.NATIVE_SIMD), max(1, self.threads), *offs]
        rows = [[self.ins.data_ptr() + lay * self.ins.stride(0) * 8,
                 self.out.data_ptr() + lay * self.out.stride(0) * 8, budget, prior,
                 0 if heads is None else heads.data_ptr()]
                for lay, (budget, prior, heads) in enumerate(self.layers)]
        return head, rows

    def selected(self, layer: int, nnz: int, unnz: int) -> SelectedPages:
        """The pages a C call selected into layer `layer`'s output (nnz entries, unnz union
        entries): what `select` returns for it."""
        return selected_pages(self.out[layer], self.sizes, self.kvh, nnz, unnz)
