"""The resident decode step: decodes whose every page of every layer is already in a device slot.

That is the steady state of decode whenever the device tier holds the context: nothing to
resolve, fetch or evict, yet the general path (kvstore/step.py) pays for each of those stages
in every layer, ~60 us of Python and small torch ops a layer against ~80 us of attention at 1K
tokens. Here the slots of every layer are looked up once at the step's start, in one batch;
each layer then writes its tokens' K/V and runs the C decode kernel over a head table made at
the start, or, for sparse decodes in sparse layers, selects their pages (the general path's
selection) and runs the C kernel over them in one call that maps them through those slots and
splits them as the general path does (`NativeSparseDecode.forward_selected`: the table
kvstore/step_attention.py builds in ~25 small torch ops a layer, made in C); the selection
statistics, lookup counts, recency (one clock per layer, as the general path stamps them, and
the weak marks of pages the step before did not select) and the write-back of pages that
filled happen once, at the step's end, for all layers at once; the C calls' checks and
arguments are made once a step too (kernels/select_plan.py, kernels/decode_plan.py). A page
the step opens gets its device slots in every layer at the start (where the device tier has
them free). A step with any other page outside the device tier (demoted or spilled), a prefill
or KV recompute takes the general path, as do sparse decodes under a pipelined mode (whose
stage threads overlap selection with attention) or --sparse-head-pages union; its results
equal this one's bit for bit (the same kernels over the same slots in the same order).
"""
from __future__ import annotations

import time

import torch

from kernels.decode_layer import KVTable, SparseWords
from kernels.decode_plan import selected_plan, table_plan
from kernels.layer_ops import write_kv
from kernels.page_table import PageTable
from kernels.sparse_attention import NativeSparseDecode
from kernels.page_topk import SelectedPages
from kvstore.stages import LayerPart
from kvstore.write_back import write_back


class ResidentDecode:
    """One step's per-layer slots and tables (built by `plan`, used by StepKV.attend)."""

    enabled = True      # False: every step takes the general path (the reference, A/B)

    def __init__(self, step, kernel: NativeSparseDecode, head: PageTable,
                 head_slots: torch.Tensor, t_slots: torch.Tensor, tok_slots: torch.Tensor,
                 full: tuple[torch.Tensor, torch.Tensor, list[str]] | None,
                 used_slots: torch.Tensor):
        self.step = step                    # the StepKV (its page summaries: `summarize`)
        self.tiers, self.stats, self.kernel, self.now = step.tiers, step.stats, kernel, step.now
        self.summaries = step.cfg.sparse_budget > 0     # selection reads them later
        self.t_slots = t_slots              # [L, U] int64: the slots of the pages written
        self.tok_off = step.tok_off         # [T] int64: each new token's offset in its page
        self.head = head                    # the head table's shape (indptr, last page lengths)
        self.head_slots = head_slots        # [L, entries] int64: each layer's slots for it
        self.tok_slots = tok_slots          # [L, T] int64: the slot each new token goes to
        self.full = full                    # (keys, slots, owners) of pages that filled
        self.used_slots = used_slots        # [L, n] int64: the slot of every page, in order
        # the attention over the head table in every layer, its arguments made at the first
        # layer (False: the kernel's forward, layer by layer)
        self._dense_plan = None
        # sparse layers: their selections (settled at the step's end)
        self.selected: dict[int, SelectedPages] = {}
        self.dense_pos = None
        self._fused: SparseWords | None = None      # sparse layers selecting in C
        if step.sparse_idx:     # each sequence's first page in used_slots
            idx = step.sparse_idx
            starts = torch.tensor([0] + step.n_pages[:-1], dtype=torch.int64).cumsum(0)
            self.sparse_starts = starts[idx]
            if step.dense_idx:
                self.dense_pos = torch.cat([torch.arange(starts[i], starts[i] + step.n_pages[i])
                                            for i in step.dense_idx])
            self.sparse_pages = step.page_mat[idx]      # [sparse, pages] their page ids
            self.sparse_last = [step.last_len[i] for i in idx]
            self.sparse_last_t = torch.tensor(self.sparse_last, dtype=torch.int32)
            self.marks = step.selection.marks()
            # the selection and attention of every sparse layer, prepared at the first
            # (None: that layer by layer)
            self._plans: tuple | None = None

    @classmethod
    def plan(cls, step) -> ResidentDecode | None:
        """The plan of StepKV `step` if all its sequences are plain decodes (no KV recompute,
        the CPU's C kernel; sparse ones in sequential mode with per-head pages) and every page
        of every layer is on the device tier, else None (the general path)."""
        tiers, kernel = step.tiers, step.parts.sparse_attention
        drafts = any(s.drafts for s in step.seqs)
        if not cls.enabled or not step.seqs or tiers.recompute is not None \
                or not all(s.decodes for s in step.seqs) or drafts and step.sparse_idx \
                or not isinstance(kernel, NativeSparseDecode):
            return None
        if step.sparse_idx and (step.pipe.mode != "sequential"
                                or step.cfg.head_pages == "union"):
            return None
        shape = tiers.page_shape       # the C kernel serves this pool (the general path's too)
        if not kernel.supports(torch.empty(0, shape.num_kv_heads, shape.head_dim), tiers.pool,
                               1):
            return None
        slots = cls._device_slots(step)
        if slots is None:
            return None
        L, dev = tiers.num_layers, tiers.device_tier
        t_keys = tiers.keys_of(step.t_pid).view(L, -1)
        t_slots = dev.slots(t_keys.reshape(-1)).view(L, -1).long()
        full = None
        if step.t_full_rids:
            full = (t_keys[:, step.t_full].reshape(-1), t_slots[:, step.t_full].reshape(-1),
                    step.t_full_rids * L)
        # the head table over the pages in order (entries: positions in their concatenation;
        # a layer maps them to its slots)
        # (with drafts: a row per token, each over the pages up to its position)
        entries = torch.arange(sum(step.n_pages))
        head = step.row_head_table(entries) if drafts else \
            step.dense_head_table(list(range(len(step.seqs))), entries)
        return cls(step, kernel, head, slots[:, head.indices.long()].contiguous(), t_slots,
                   t_slots[:, step.tok_t].contiguous(), full, slots)

    @staticmethod
    def _device_slots(step) -> torch.Tensor | None:
        """int64 [L, pages] the device slot of every page of the step's sequences in every
        layer (in their order), or None where any is off the device. A page this step opens
        (its first token: no slot yet) gets its slots in every layer here, as the general path
        gives them layer by layer, where the device tier has them free (else None: making
        room is the general path's eviction)."""
        tiers = step.tiers
        L, dev = tiers.num_layers, tiers.device_tier
        pages = torch.cat(step.page_tensors)
        if pages.numel() == 0:
            return None

        def off_device(missing: torch.Tensor) -> bool:
            """Whether a page missing from the device (bool per page, or [L, pages]) is not
            one this step opens (its one token written now)."""
            new = torch.isin(pages, step.t_pid[step.t_new])
            return bool((missing & ~new).any())

        # one layer first: a context the device tier does not hold (tiered sparse decode)
        # fails here, at a 30th of the lookup
        last = dev.slots(tiers.keys_of(pages, range(L - 1, L))) < 0
        if bool(last.any()) and off_device(last):
            return None
        keys = tiers.keys_of(pages).view(L, -1)
        slots = dev.slots(keys.reshape(-1)).view(L, -1)
        missing = slots < 0                 # -1: not on the device
        if bool(missing.any()):
            if off_device(missing):
                return None
            need = keys[missing]            # layer-major, as the general path reserves them
            if need.numel() > dev.num_free:
                return None
            step.fetcher.ensure(need, protect=need[:0], fill=False)    # (no eviction)
            slots = dev.slots(keys.reshape(-1)).view(L, -1)
        return slots.long()

    def layer_table(self, group: int) -> KVTable:
        """This step's KV for layers run in C (kernels/decode_layer.py), which write the K/V
        themselves: the head table of every layer, its sparse layers selecting in their call
        (`_sparse_words`), then `after_layer` follows each; else (dense and sparse rows
        mixed, or a plan the C calls do not serve) `attend_written` is their attention."""
        step, sparse = self.step, None
        if step.sparse_idx:         # the sparse layers' selection in C too, where it serves
            sparse = self._sparse_words(group)
        plan = None if step.sparse_idx and sparse is None else self._table_plan(group)
        return KVTable(self.tiers.pool, self.tok_slots, self.tok_off, plan, self.after_layer,
                       self.attend_written, sparse if plan is not None else None)

    def _sparse_words(self, group: int) -> SparseWords | None:
        """The sparse layers' selection and attention for layers run in C, where every row
        decodes sparsely. A page this step fills is summarized after its layer's call
        (`after_layer`), not between the K/V write and the selection as `attend_written`
        does: the same pages, since a decode fills only its last page, which the selection
        always keeps (KVStoreConfig.local_pages >= 1) whatever its score."""
        step = self.step
        if not SparseWords.enabled or step.dense_idx:
            return None
        select, decode = self._sparse_plans(group)
        if select is None or decode is None:
            return None
        dense = step.cfg.dense_layers
        self._fused = SparseWords(select, decode,
                                  [layer >= dense for layer in range(self.tiers.num_layers)])
        return self._fused

    def after_layer(self, layer: int, attention_s: float) -> None:
        """What `attend_written` does around the attention, for a layer that attended in C:
        the summaries of the pages it filled, the stages' times, a sparse layer's selection
        (settled at the step's end)."""
        if self.summaries:
            self.step.summarize(layer, self.t_slots[layer])
        if self._fused is not None and self._fused.sparse[layer]:
            self.selected[layer], select_s, attention_s = self._fused.result(layer)
            self.stats.observe_stage("select", select_s)
        self.stats.observe_stage("compute", attention_s)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [B, H, D], k/v [B, KVH, D] of one decode token a sequence -> [B, H, D]."""
        pool = self.tiers.pool
        tok = self.tok_slots[layer]
        if not write_kv(pool, k, v, tok, self.tok_off):
            pool[tok, 0, :, self.tok_off] = k.to(pool.dtype)
            pool[tok, 1, :, self.tok_off] = v.to(pool.dtype)
        return self.attend_written(layer, q, scale)

    def attend_written(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend` once the layer's K/V are in the pool."""
        if self.summaries:
            self.step.summarize(layer, self.t_slots[layer])
        if self.step.sparse_idx and layer >= self.step.cfg.dense_layers:
            return self._attend_sparse_layer(layer, q, scale)
        t0 = time.perf_counter()
        pool = self.tiers.pool
        group = q.shape[1] // pool.shape[2]
        plan = self._table_plan(group)
        if plan is not None:
            out = plan(layer, q, scale)
        else:
            h = self.head
            table = PageTable(h.indptr, self.head_slots[layer], h.last_page_len, h.page_size)
            out = self.kernel.forward(q, pool, table, group, scale)   # (torch's if unsupported)
        self.stats.observe_stage("compute", time.perf_counter() - t0)
        return out

    def _table_plan(self, group: int):
        """The C attention over the head table in every layer (kernels/decode_plan.TablePlan),
        made at its first use; None where the C kernel does not serve the pool."""
        if self._dense_plan is None:
            self._dense_plan = table_plan(self.kernel, self.tiers.pool, group, self.head,
                                          self.head_slots) or False
        return self._dense_plan or None

    def _sparse_plans(self, group: int) -> tuple:
        """(the selection's SelectPlan, the attention's SelectedPlan) of the sparse decodes
        in every layer, made at their first use (None each where the C call does not serve
        them: then layer by layer)."""
        if self._plans is None:
            step = self.step
            self._plans = (step.select_plan(step.sparse_idx, group), selected_plan(
                self.kernel, self.tiers.pool, group, self.used_slots, self.sparse_starts,
                self.sparse_last_t, self.marks, self.tiers.max_pages, self.sparse_pages))
        return self._plans

    def _attend_sparse_layer(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """A sparse layer: the dense rows over all their pages, the sparse decodes over the
        pages they select (the general path's selection; its table and split attention made
        in C from the selection, the same bits). What the selection touched is settled at the
        step's end, all layers at once (`_settle`)."""
        step, slots, pool = self.step, self.used_slots[layer], self.tiers.pool
        out = None
        if step.dense_idx:
            out = torch.empty_like(q)
            dense = slots[self.dense_pos]
            step.compute(layer, q, out, LayerPart(step.dense_idx, None, dense, dense), scale)
        idx = step.sparse_idx
        t0 = time.perf_counter()
        rows = step.query_rows(idx)
        qs = q[rows]
        group = q.shape[1] // pool.shape[2]
        select, decode = self._sparse_plans(group)
        if select is not None and decode is not None:
            qf = qs.to(torch.float32).contiguous()
            sel = select.select(layer, qf)
            t1 = time.perf_counter()
            res = decode(layer, qf, sel, scale).to(q.dtype)
        else:
            sel = step.select(layer, qs, idx, observe=False)
            t1 = time.perf_counter()
            res = self.kernel.forward_selected(
                qs, pool, sel, group, scale, slots, self.sparse_starts, self.sparse_last_t,
                self.marks, layer * self.tiers.max_pages, self.sparse_pages)
        self.stats.observe_stage("select", t1 - t0)
        if out is not None:
            out[rows] = res
        self.stats.observe_stage("compute", time.perf_counter() - t1)
        self.selected[layer] = sel
        return res if out is None else out

    def _settle(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sparse layers' selections at once: their statistics, and the keys they select
        (recorded for the step's end, StepKV.reused). Returns (slots, layers) of each page
        any head of a sequence selected in a layer, and the weak ones among those slots (the
        step before did not select their page)."""
        step, sels = self.step, list(self.selected.values())
        kvh = self.tiers.page_shape.num_kv_heads
        step.selection.observe(sels, self.sparse_last, kvh)
        counts = torch.stack([s.union_indptr for s in sels]).diff(dim=1)    # [layers, seqs]
        pages = torch.cat([s.union_indices for s in sels])
        seq = torch.arange(counts.shape[1]).repeat(len(sels)).repeat_interleave(
            counts.reshape(-1))
        layer = torch.tensor(list(self.selected), dtype=torch.int64).repeat_interleave(
            counts.sum(dim=1))
        slots = self.used_slots[layer, self.sparse_starts[seq] + pages]
        reused = step.reused(layer * self.tiers.max_pages + self.sparse_pages[seq, pages])
        return slots, layer, slots[~reused]

    def end(self) -> None:
        """After the last layer: the step's lookups, recency stamps and write-backs."""
        tiers = self.tiers
        L, per_layer = tiers.num_layers, self.used_slots.shape[1]
        weak = None
        if not self.selected:
            used = self.used_slots.reshape(-1)
            used_layer = torch.arange(L).repeat_interleave(per_layer)
        else:       # each layer its own slots (slots are per layer: no two layers share one)
            union, union_layer, weak = self._settle()
            sparse = list(self.selected)
            dense = [layer for layer in range(L) if layer not in self.selected]
            parts = [(self.used_slots[dense].reshape(-1),
                      torch.tensor(dense, dtype=torch.int64).repeat_interleave(per_layer)),
                     (union, union_layer)]
            if self.dense_pos is not None:      # the dense rows of the sparse layers
                rows = self.used_slots[sparse][:, self.dense_pos]
                parts.append((rows.reshape(-1), torch.tensor(sparse, dtype=torch.int64)
                              .repeat_interleave(rows.shape[1])))
            used = torch.cat([s for s, _ in parts])
            used_layer = torch.cat([lay for _, lay in parts])
        n = used.numel()
        self.stats.count("lookups", "device", n)
        self.stats.count("hits", "device", n)
        tok_layer = torch.arange(L).repeat_interleave(self.tok_slots.shape[1])
        tiers.touch(torch.cat([used, self.tok_slots.reshape(-1)]),
                    self.now * L + torch.cat([used_layer, tok_layer]), weak)
        tiers.at_layer(self.now, L - 1)
        if self.full is not None:
            write_back(tiers, *self.full)
