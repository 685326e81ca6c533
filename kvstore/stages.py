"""One layer's stages as the pipeline schedules them (kvstore/pipeline.py): the stage
functions of a layer of a step (`LayerStages`: select, resolve, fill, bound to its StepKV), and
the parts a layer's fetch and compute are split into (`LayerPart`: the dense sequences, or a
micro-batch of sparse decodes)."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.page_topk import SelectedPages, cat_selected
from kvstore.resolution import Resolution

_I64 = dict(dtype=torch.int64)


class LayerStages:
    """The stage functions of one layer of one step (bound to its StepKV)."""

    def __init__(self, step, layer: int, q: torch.Tensor | None):
        """step: the kvstore.step.StepKV (not imported: step.py imports this module)."""
        self.step, self.layer, self.q = step, layer, q

    def select(self, idx: list[int], qd: torch.Tensor | None = None,
               observe: bool = True) -> SelectedPages:
        st = self.step
        if qd is None:
            qd = self.q[st.query_rows(idx)]
        return st.select(self.layer, qd, idx, observe=observe)

    def select_keys(self, idx: list[int], qd: torch.Tensor | None = None,
                    observe: bool = True) -> tuple[SelectedPages, torch.Tensor]:
        """The select stage, timed: the selection for `idx` and the keys of its union pages."""
        t0 = time.perf_counter()
        sel = self.select(idx, qd, observe)
        keys = self.union_keys(idx, sel)
        self.step.stats.observe_stage("select", time.perf_counter() - t0)
        return sel, keys

    def reused(self, keys: torch.Tensor) -> torch.Tensor:
        """Which of a selection's `keys` the last completed step selected too (bool [n]).
        Split attention computes those pages first: a choice that depends on the selections
        alone, so every mode splits alike (and gives the same bits)."""
        return self.step.reused(keys)

    def dense_keys(self, idx: list[int]) -> torch.Tensor:
        """Keys of the pages of the sequences `idx` a dense attention reads (every page,
        unless the layer's sliding window cuts them)."""
        st, base = self.step, self.layer * self.step.tiers.max_pages
        return torch.cat([base + st.attended_pages(self.layer, i) for i in idx]) if idx \
            else torch.empty(0, **_I64)

    def union_keys(self, idx: list[int], sel: SelectedPages) -> torch.Tensor:
        """Keys of the pages any head selected, sequence after sequence, ascending."""
        st, P = self.step, self.step.tiers.max_pages
        seq = torch.tensor(idx, **_I64).repeat_interleave(sel.union_indptr.diff())
        return self.layer * P + st.page_mat[seq, sel.union_indices]

    def resolve(self, keys: torch.Tensor, protect: torch.Tensor,
                count: bool = True) -> Resolution:
        return self.step.fetcher.resolve(keys, protect, count=count)

    def start_reads(self, res: Resolution) -> None:
        self.step.fetcher.start_reads(res)

    def fill(self, res: Resolution) -> None:
        self.step.fetcher.fill(res)


@dataclass
class LayerPart:
    """One unit of a layer's fetch and compute: the dense sequences `idx` (`sel` None: every
    page), or a micro-batch of sparse decodes. `slots` (device slots of `keys`) are set once
    the part is resolved (`misses`: how many of them it had to fetch); `filled`, the fetch
    thread's (resolution or None, error or None), until `Pipeline.finish` has settled it.
    Sparse decodes: `reused` (bool per key) marks the pages the last step selected too;
    `early`: those are in their slots once the layer's fetch ahead is in, so their half of the
    attention (`head`, once computed) need not wait for `filled`."""
    idx: list[int]
    sel: SelectedPages | None
    keys: torch.Tensor
    slots: torch.Tensor | None = None
    misses: int = 0
    filled: Future | None = None
    reused: torch.Tensor | None = None
    early: bool = False
    head: object = None

    def resolved(self, res: Resolution) -> None:
        """Its pages' slots; `early` unless a reused page is still to be fetched."""
        self.slots, self.misses = res.slots, res.misses
        if self.reused is not None and res.misses and bool(self.reused.any()):
            self.early = not bool(res.fills(res.slots[self.reused]).any())


def filled(res: Resolution | None, exc: BaseException | None) -> Future:
    """A fill job's result, (resolution, error), for a part that needs no fill job."""
    done = Future()
    done.set_result((res, exc))
    return done


# computes the attention of one part (its pages are in its slots); or, the early half
ComputeFn = Callable[[LayerPart], None]


def merge_sparse(parts: list[LayerPart]) -> list[LayerPart]:
    """The filled parts with the sparse micro-batches merged into one (KVDrive's whole-batch
    compute)."""
    sparse = [p for p in parts if p.sel is not None]
    if len(sparse) < 2:
        return parts
    return [p for p in parts if p.sel is None] + [LayerPart(
        [i for p in sparse for i in p.idx], cat_selected([p.sel for p in sparse]),
        torch.cat([p.keys for p in sparse]), torch.cat([p.slots for p in sparse]),
        reused=None if any(p.reused is None for p in sparse)
        else torch.cat([p.reused for p in sparse]))]


def weak_slots(parts) -> torch.Tensor | None:
    """Device slots of the pages a sparse decode selected that the step before did not (the
    residency policy's guess at pages it may not need next step)."""
    weak = [p.slots[~p.reused] for p in parts
            if p.reused is not None and p.slots is not None and p.reused.numel()]
    return torch.cat(weak) if weak else None
