"""StepKV: one engine step's view of the KV store; the model calls `attend` once per layer.

Per layer: write the new K/V into device slots and fold them into the page summaries;
select (every page for dense sequences; top pages by the selector for sparse decodes);
fetch the selected pages missing from the device tier (host or disk -> device slots);
compute attention over device slots; write pages that became full through to the backing tier.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionBatch
from kernels.page_summary import summarize_pages
from kernels.page_select import select_pages
from kernels.page_table import build_page_table
from kvstore.fetcher import Fetcher


@dataclass(frozen=True)
class SeqKV:
    """One sequence of the step (plain data built by the engine)."""
    request_id: str
    page_ids: tuple[int, ...]    # covers [0, start_pos + q_len)
    start_pos: int
    q_len: int

    @property
    def kv_len(self) -> int:
        return self.start_pos + self.q_len


class StepKV:
    def __init__(self, store, seqs: list[SeqKV]):
        self.store = store
        cfg = store.cfg
        ps = cfg.page_size
        self.seqs = seqs
        self.fetcher = Fetcher(store)
        store.step_counter += 1
        self.now = store.step_counter
        # token -> (page id, offset) for the K/V writes, in batch order
        tok_pid, tok_off, qo = [], [], [0]
        # touched pages: (seq index, page index, page id, valid tokens after the write)
        t_seq, t_idx, t_pid, t_valid = [], [], [], []
        for i, s in enumerate(seqs):
            for p in range(s.start_pos, s.kv_len):
                tok_pid.append(s.page_ids[p // ps])
                tok_off.append(p % ps)
            qo.append(qo[-1] + s.q_len)
            for j in range(s.start_pos // ps, (s.kv_len - 1) // ps + 1):
                t_seq.append(i)
                t_idx.append(j)
                t_pid.append(s.page_ids[j])
                t_valid.append(min(ps, s.kv_len - j * ps))
        i64 = dict(dtype=torch.int64)
        self.qo = qo
        self.tok_pid = torch.tensor(tok_pid, **i64)
        self.tok_off = torch.tensor(tok_off, **i64)
        self.t_seq, self.t_idx = t_seq, t_idx
        self.t_pid = torch.tensor(t_pid, **i64)
        self.t_valid = torch.tensor(t_valid, **i64)
        # pages that became full in this step go to the backing tier after each layer
        before = torch.tensor([seqs[i].start_pos - j * ps for i, j in zip(t_seq, t_idx)], **i64)
        self.t_full = (self.t_valid == ps) & (before < ps)
        self.n_pages = [len(range(0, s.kv_len, ps)) for s in seqs]
        self.page_tensors = [torch.tensor(s.page_ids[:n], **i64) for s, n in zip(seqs, self.n_pages)]
        budget = cfg.budget_pages
        self.sparse_seq = [cfg.sparse_budget > 0 and s.q_len == 1 and n > budget
                           for s, n in zip(seqs, self.n_pages)]
        self.any_sparse = any(self.sparse_seq)

    # ------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] of this step's tokens -> attention output [T, H, D]."""
        store = self.store
        P = store.max_pages
        pool = store.device_tier.pool                        # [S, 2, ps, KVH, D]
        # 1. write: pages being written get device slots (new pages: no fill needed)
        t_keys = layer * P + self.t_pid
        t_slots = self.fetcher.ensure(t_keys, protect=t_keys, fill=False).long()
        tok_slots = store.device_tier.slots(layer * P + self.tok_pid).long()
        pool[tok_slots, 0, self.tok_off] = k.to(pool.dtype)
        pool[tok_slots, 1, self.tok_off] = v.to(pool.dtype)
        summ = summarize_pages(pool[t_slots, 0], self.t_valid)   # [U, KVH, 3, D] in the KV dtype
        for u, (i, j) in enumerate(zip(self.t_seq, self.t_idx)):
            store.requests[self.seqs[i].request_id].summaries[layer, j] = summ[u]

        # 2. select: dense sequences need every page; sparse decodes their top pages
        sparse = self.any_sparse and layer >= store.cfg.dense_layers
        out = torch.empty_like(q)
        dense_idx = [i for i in range(len(self.seqs)) if not (sparse and self.sparse_seq[i])]
        sparse_idx = [i for i in range(len(self.seqs)) if sparse and self.sparse_seq[i]]
        self._count_fallbacks(layer, sparse)
        need = [layer * P + self.page_tensors[i] for i in dense_idx]
        sel = None
        if sparse_idx:
            sel = self._select(layer, q, sparse_idx)
            need += [layer * P + self.page_tensors[i][sel.union(b)] for b, i in enumerate(sparse_idx)]
        need_keys = torch.cat(need) if need else torch.empty(0, dtype=torch.int64)

        # 3. fetch what is missing on the device tier
        protect = torch.cat([need_keys, t_keys])
        slots_all = self.fetcher.ensure(need_keys, protect=protect, fill=True).long()

        # 4. compute over device slots
        off = 0
        if dense_idx:
            tables, kv_lens, q_rows = [], [], []
            for i in dense_idx:
                n = self.n_pages[i]
                tables.append(slots_all[off:off + n].tolist())
                off += n
                kv_lens.append(self.seqs[i].kv_len)
                q_rows.append(torch.arange(self.qo[i], self.qo[i + 1]))
            rows = torch.cat(q_rows)
            qo = torch.tensor([0] + [self.seqs[i].q_len for i in dense_idx]).cumsum(0).to(torch.int32)
            batch = AttentionBatch(qo, build_page_table(tables, kv_lens, store.cfg.page_size),
                                   torch.empty(0, dtype=torch.int64))
            out[rows] = store.dense_attention.forward(q[rows], pool, batch, scale)
        if sparse_idx:
            rows = torch.tensor([self.qo[i] for i in sparse_idx])
            out[rows] = self._sparse_compute(q[rows], pool, sparse_idx, sel, slots_all[off:], scale)
        store.residency.touch(torch.cat([slots_all, t_slots]), self.now)

        # 5. write pages that became full through to the backing tier
        if bool(self.t_full.any()):
            self.fetcher.write_back(t_keys[self.t_full], t_slots[self.t_full],
                                    [self.seqs[self.t_seq[u]].request_id
                                     for u in self.t_full.nonzero().squeeze(1).tolist()])
        return out

    # ------------------------------------------------------------------------------------
    def _count_fallbacks(self, layer: int, sparse: bool) -> None:
        st = self.store.stats
        if self.store.cfg.sparse_budget == 0:
            return
        for s, is_sparse in zip(self.seqs, self.sparse_seq):
            if s.q_len > 1:
                st.dense_fallbacks["prefill"] += 1
            elif not is_sparse:
                st.dense_fallbacks["fits_budget"] += 1
            elif not sparse:
                st.dense_fallbacks["dense_layer"] += 1

    def _select(self, layer: int, q: torch.Tensor, idx: list[int]):
        store, cfg = self.store, self.store.cfg
        kvh = store.page_shape.num_kv_heads
        n_pages = [self.n_pages[i] for i in idx]
        summaries = [store.requests[self.seqs[i].request_id].summaries[layer] for i in idx]
        qd = q[torch.tensor([self.qo[i] for i in idx])]                   # [B, H, D]
        scores = store.selector.score(qd, summaries, n_pages, q.shape[1] // kvh)  # [B, KVH, P]
        sel = select_pages(scores, n_pages, cfg.budget_pages, cfg.sink_pages, cfg.local_pages)
        tokens = []
        for b, i in enumerate(idx):
            partial = cfg.page_size - (self.seqs[i].kv_len - (n_pages[b] - 1) * cfg.page_size)
            tokens += [sel.row(b, h).numel() * cfg.page_size - partial for h in range(kvh)]
        store.stats.observe_selected(tokens)
        return sel

    def _sparse_compute(self, q, pool, idx, sel, union_slots, scale):
        """Per (sequence, KV head) page tables over device slots -> sparse decode attention."""
        cfg = self.store.cfg
        kvh = self.store.page_shape.num_kv_heads
        rows, kv_lens = [], []
        off = 0
        for b, i in enumerate(idx):
            u = sel.union(b)                                   # sorted page indices [n_u]
            slot_of = dict(zip(u.tolist(), union_slots[off:off + u.numel()].tolist()))
            off += u.numel()
            last_idx = self.n_pages[i] - 1
            last_len = self.seqs[i].kv_len - last_idx * cfg.page_size
            for h in range(kvh):
                pages = sel.row(b, h).tolist()
                rows.append([slot_of[p] for p in pages])
                # NOTE: the local window keeps the partial last page last in every row
                kv_lens.append((len(pages) - 1) * cfg.page_size + last_len)
        table = build_page_table(rows, kv_lens, cfg.page_size)
        return self.store.sparse_attention.forward(q, pool, table, q.shape[1] // kvh, scale)
