"""StepKV: one engine step's view of the KV store; the model calls `attend` once per layer.

Per layer: write the new K/V into device slots and fold them into the page summaries;
select (every page for dense sequences; top pages by the selector for sparse decodes);
fetch the selected pages missing from the device tier (host or disk -> device slots);
compute attention over device slots; write pages that became full through to the backing tier.
Everything per layer is batched over the step's sequences (no per-page Python loops).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.page_summary import summarize_pages
from kernels.layer_ops import summarize_slots, write_kv
from kernels.page_table import PageTable
from kernels.window_attention import FULL, first_window_page
from kvstore.config import KVStoreConfig
from kvstore.fetcher import Fetcher
from kvstore.requests import RequestTable
from kvstore.resident import ResidentDecode
from kvstore.selection import PageSelection
from kvstore.stages import LayerPart, LayerStages, weak_slots
from kvstore.step_attention import attend_dense, attend_sparse, attend_window, dense_batch
from kvstore.stats import KVStats
from kvstore.tierset import TierSet
from kvstore.write_back import write_back

_I64 = dict(dtype=torch.int64)


@dataclass(frozen=True)
class SeqKV:
    """One sequence of the step (plain data built by the engine)."""
    request_id: str
    page_ids: tuple[int, ...]    # covers [0, start_pos + q_len)
    start_pos: int
    q_len: int
    observe: bool = False        # the chunk ends the prefill: rank pages by its last queries
    drafts: int = 0              # a decode's pending token and this many drafts after it
                                 # (scheduler/speculative.py): each token's row attends to the
                                 # positions up to its own, as a decode would

    @property
    def decodes(self) -> bool:
        """A decode (one token, or one and its drafts), not a prompt chunk."""
        return self.q_len == 1 + self.drafts

    @property
    def kv_len(self) -> int:
        return self.start_pos + self.q_len


@dataclass(frozen=True)
class StepParts:
    """The KV store's parts a step works with (wired once by kvstore/store.py)."""
    cfg: KVStoreConfig
    tiers: TierSet
    fetcher: Fetcher
    requests: RequestTable
    selection: PageSelection
    pipeline: object                  # kvstore.pipeline.Pipeline
    stats: KVStats
    dense_attention: object           # kernels.attention backend
    sparse_attention: object          # kernels.sparse_attention decode
    windows: tuple[int | None, ...] = ()    # each layer's sliding window (None: full context)
    softcap: float | None = None            # the attention scores' cap (Gemma 2): every layer
                                            # attends as `cut`, in window_attention


class StepKV:
    def __init__(self, parts: StepParts, seqs: list[SeqKV]):
        self.parts = parts
        self.tiers = parts.tiers
        self.cfg = cfg = parts.cfg
        self.stats = parts.stats
        self.selection = parts.selection
        ps = cfg.page_size
        self.seqs = seqs
        self.fetcher = parts.fetcher
        self.now = self.tiers.begin_step()
        self.qo = [0]
        tok_t, tok_off = [], []
        # touched pages (being written this step), per sequence a contiguous run of page indices
        self.t_runs: list[tuple[int, int, int]] = []      # (seq, first page index, count)
        # each run's full pages, which lead it: the ones `summarize` summarizes (a partial
        # page is its sequence's last, which selection always keeps: KVStoreConfig.local_pages
        # >= 1)
        self.s_counts: list[int] = []
        t_pid, t_valid, t_full, t_new = [], [], [], []
        for i, s in enumerate(seqs):
            self.qo.append(self.qo[-1] + s.q_len)
            pos = range(s.start_pos, s.kv_len)
            j0, j1 = s.start_pos // ps, (s.kv_len - 1) // ps
            tok_t.extend(len(t_pid) + p // ps - j0 for p in pos)
            tok_off.extend(p % ps for p in pos)
            self.t_runs.append((i, j0, j1 - j0 + 1))
            for j in range(j0, j1 + 1):
                t_pid.append(s.page_ids[j])
                valid = min(ps, s.kv_len - j * ps)
                t_valid.append(valid)
                t_full.append(valid == ps and s.start_pos - j * ps < ps)   # filled in this step
                t_new.append(j * ps >= s.start_pos)                         # opened in this step
            self.s_counts.append(sum(t_full[len(t_full) - (j1 - j0 + 1):]))   # full, leading
        # each token's page, as an index into the touched pages (t_pid)
        self.tok_t = torch.tensor(tok_t, **_I64)
        self.tok_off = torch.tensor(tok_off, **_I64)
        self.t_pid = torch.tensor(t_pid, **_I64)
        self.t_valid = torch.tensor(t_valid, **_I64)
        self.t_full = torch.tensor(t_full, dtype=torch.bool)
        self.t_new = torch.tensor(t_new, dtype=torch.bool)
        # the owner of each page that became full, in t_full order (for per-request write-back)
        self.t_full_rids = [seqs[i].request_id for (i, _, n) in self.t_runs for _ in range(n)]
        self.t_full_rids = [rid for rid, f in zip(self.t_full_rids, t_full) if f]
        self.n_pages = [-(-s.kv_len // ps) for s in seqs]
        self.last_len = [s.kv_len - (n - 1) * ps for s, n in zip(seqs, self.n_pages)]
        self.last_lens = torch.tensor(self.last_len, dtype=torch.int32)   # per layer's tables
        self.page_tensors = [torch.tensor(s.page_ids[:n], **_I64)
                             for s, n in zip(seqs, self.n_pages)]
        # [seqs, max pages] page ids, padded with 0 (for vectorized lookups of selected pages)
        self.page_mat = torch.nn.utils.rnn.pad_sequence(self.page_tensors, batch_first=True) \
            if seqs else torch.empty(0, 0, **_I64)
        # (a soft-capped model attends every layer in window_attention: never sparse)
        sparse = [cfg.sparse_budget > 0 and parts.softcap is None and s.q_len == 1
                  and n > cfg.sparse_from_pages for s, n in zip(seqs, self.n_pages)]
        self.sparse_idx = [i for i, sp in enumerate(sparse) if sp]
        self.dense_idx = [i for i, sp in enumerate(sparse) if not sp]
        # prefills ending this step whose observation window ranks their pages (SnapKV)
        self.observe_idx = [i for i, s in enumerate(seqs) if s.observe and s.q_len > 1] \
            if cfg.sparse_budget > 0 and cfg.obs_window > 0 else []
        # layers whose sliding window cuts some sequence's context this step: every sequence
        # attends there over the pages from its window on (kernels/window_attention.py)
        longest = max((s.kv_len for s in seqs), default=0)
        self.cut = {layer: w for layer, w in enumerate(parts.windows)
                    if w is not None and longest > w}
        if parts.softcap is not None:     # and every layer of a soft-capped model, always
            self.cut = {layer: self.cut.get(layer, FULL)
                        for layer in range(self.tiers.num_layers)}
        self._first_pages: dict[int, list[int]] = {}      # `first_pages`, by window
        self.pipe = parts.pipeline
        self.pipe.begin_step(len(self.sparse_idx), all(s.q_len == 1 for s in seqs))
        self._q_pred: dict[int, torch.Tensor] = {}
        self._sparse_pages: torch.Tensor | None = None
        self._rows: dict[tuple[int, ...], torch.Tensor | slice] = {}
        # dense_head_table's by sequences, row_head_table's under "rows"
        self._head_tables: dict[tuple[int, ...] | str, PageTable] = {}
        self.selected: list[torch.Tensor] = []     # keys the sparse decodes selected
        if cfg.sparse_budget > 0:
            st, L = self.stats, self.tiers.num_layers
            st.dense_fallbacks["prefill"] += L * sum(not s.decodes for s in seqs)
            st.dense_fallbacks["fits_budget"] += L * sum(
                s.decodes and not sp for s, sp in zip(seqs, sparse))
            st.dense_fallbacks["dense_layer"] += min(cfg.dense_layers, L) * len(self.sparse_idx)
        # None: the general path below (which alone attends within windows)
        self.resident = None if self.cut else ResidentDecode.plan(self)

    def summarize(self, layer: int, t_slots: torch.Tensor) -> None:
        """The pages being written (in device slots t_slots [U]) into their requests' page
        summaries of `layer` (selection's input; prompts also into its index)."""
        # NOTE: recomputed from the page contents, so a retried step cannot double count
        # K halves [U, KVH, ps, D] -> [U, KVH, 3, D]
        # NOTE: only full pages (t_full, s_counts): a decode step fills one page in 16
        pool, full = self.tiers.pool, self.t_full
        if self.t_full_rids:            # some page filled
            t_slots, valid = t_slots[full], self.t_valid[full]
            summ = None if self.selection.projected else summarize_slots(pool, t_slots, valid)
            if summ is None:
                summ = summarize_pages(self.selection.summary_keys(layer, pool[t_slots, 0]),
                                       valid)
        u, prompts = 0, []
        for (i, j0, _), n in zip(self.t_runs, self.s_counts):
            rkv = self.parts.requests[self.seqs[i].request_id]
            if n:
                rkv.summaries[layer, j0:j0 + n] = summ[u:u + n]
            u += n
            if not self.seqs[i].decodes:
                prompts.append((rkv, self.n_pages[i]))
        self.selection.index_prompts(layer, prompts)

    def end(self) -> None:
        """After the forward (stage threads drained): the resident path's deferred work."""
        if self.resident is not None:
            self.resident.end()

    # ------------------------------------------------------------------------------------
    @property
    def lookahead_rows(self) -> torch.Tensor | slice | None:
        """Query rows of the sparse decodes when layer-ahead prefetch is on (the model then
        calls `lookahead(layer + 1, predicted q)` before each layer), else None."""
        if self.pipe.mode != "layer-ahead" or not self.sparse_idx:
            return None
        return self.query_rows(self.sparse_idx)

    def sparse_keys(self, layer: int) -> torch.Tensor:
        """Keys of every page of the sparse decodes in `layer`."""
        if self._sparse_pages is None:
            self._sparse_pages = torch.cat([self.page_tensors[i] for i in self.sparse_idx]) \
                if self.sparse_idx else torch.empty(0, **_I64)
        return layer * self.tiers.max_pages + self._sparse_pages

    def lookahead(self, layer: int, q_pred: torch.Tensor) -> None:
        """The model's guess of layer `layer`'s queries [B_sparse, H, D] (layer `layer`'s
        q projection applied to the previous layer's input): prefetched while the previous
        layer computes."""
        if self.cfg.dense_layers <= layer < self.tiers.num_layers and layer not in self.cut:
            self._q_pred[layer] = q_pred

    def layer_table(self, group: int):
        """The step's KV for layers run as C calls (kernels/decode_layer.KVTable), or None:
        the resident path's, where it takes the step."""
        return None if self.resident is None else self.resident.layer_table(group)

    @property
    def keeps_inputs(self) -> bool:
        """Whether `attend` wants the layer's inputs (KV recompute stores them with the K/V)."""
        return self.tiers.recompute is not None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] of this step's tokens -> attention output [T, H, D];
        inputs [T, hidden]: the normed layer inputs they were computed from (`keeps_inputs`)."""
        if self.resident is not None:
            return self.resident.attend(layer, q, k, v, scale)
        tiers, pipe, cfg = self.tiers, self.pipe, self.cfg
        P = tiers.max_pages
        pool = tiers.pool                                    # [S, 2, KVH, ps, D]
        # the previous layer's bookkeeping and this layer's prefetch run on the stage threads
        predicted = pipe.drain(keep_ahead=True)
        now = tiers.at_layer(self.now, layer)
        # 1. write: pages being written get device slots (new pages need no fill)
        t_keys = layer * P + self.t_pid
        protect = pipe.protected(t_keys)        # and the pages fetched ahead
        t_slots = self.fetcher.ensure(t_keys, protect=protect, fill=False).long()
        tok_slots = t_slots[self.tok_t]
        if not write_kv(pool, k, v, tok_slots, self.tok_off):   # torch's where C's cannot
            pool[tok_slots, 0, :, self.tok_off] = k.to(pool.dtype)   # indexed view: [T, KVH, D]
            pool[tok_slots, 1, :, self.tok_off] = v.to(pool.dtype)
        if inputs is not None:          # only given when `keeps_inputs`
            tiers.recompute.keep(tok_slots, self.tok_off, inputs)
        if cfg.sparse_budget > 0:      # summaries only serve selection
            self.summarize(layer, t_slots)

        # 2-3. select, resolve, fetch: dense sequences need every page, sparse decodes their
        # top pages; micro-batched and overlapped unless the pipeline is sequential
        sparse = layer >= cfg.dense_layers and layer not in self.cut
        dense_idx = self.dense_idx if sparse else list(range(len(self.seqs)))
        sparse_idx = self.sparse_idx if sparse else []
        stages = LayerStages(self, layer, q)
        parts = pipe.run(stages, dense_idx, sparse_idx, protect)
        if layer + 1 in self._q_pred:          # layer-ahead: overlaps with this layer's compute
            pipe.prefetch(LayerStages(self, layer + 1, None), self._q_pred.pop(layer + 1),
                          self.sparse_idx, torch.cat([p.keys for p in parts] + [t_keys]))

        # 4. compute over device slots, part by part as the pipeline hands them over
        out = torch.empty_like(q)
        slots_all, sel = pipe.finish(
            parts, lambda p: self.compute(layer, q, out, p, scale),
            lambda p: self.compute(layer, q, out, p, scale, early=True))
        if predicted is not None and sel is not None:
            self._observe_lookahead(layer, sel, predicted)

        # 5. bookkeeping (overlaps with the rest of the layer when pipelined): recency, and
        # pages that became full go to the backing tier (once)
        touched = torch.cat([slots_all, t_slots.int()])
        full = (t_keys[self.t_full], t_slots[self.t_full]) if self.t_full_rids else None
        weak = weak_slots(parts)

        def bookkeeping():
            tiers.touch(touched, now, weak)
            if full is not None:
                write_back(tiers, full[0], full[1], self.t_full_rids)

        pipe.overlap(bookkeeping)
        return out

    def compute(self, layer: int, q: torch.Tensor, out: torch.Tensor, part: LayerPart,
                scale: float, early: bool = False) -> None:
        """The attention of `part`'s sequences over its device slots into their rows of out
        (`early`: a sparse part's first half only, see step_attention.attend_sparse), timed."""
        t0 = time.perf_counter()
        if part.sel is None and layer in self.cut:
            attend_window(self, layer, q, out, part.idx, part.slots, scale)
        elif part.sel is None:
            attend_dense(self, layer, q, out, part.idx, part.slots,
                         layer >= self.cfg.dense_layers, scale)
        else:
            attend_sparse(self, q, out, part, scale, early)
        self.stats.observe_stage("compute", time.perf_counter() - t0)

    def _observe_lookahead(self, layer: int, sel, predicted) -> None:
        """Recall of the layer-ahead prediction: exact union pages it had fetched."""
        p_layer, p_keys = predicted
        if p_layer != layer:
            return
        exact = LayerStages(self, layer, None).union_keys(self.sparse_idx, sel)
        hit = int(torch.isin(exact, p_keys).sum())
        self.stats.observe_lookahead(hit, exact.numel())

    # ------------------------------------------------------------------------------------
    def attended_pages(self, layer: int, i: int) -> torch.Tensor:
        """The page ids of sequence i a dense attention of `layer` reads: every page, or from
        the page of its window's first key on where the layer's window cuts the step."""
        window = self.cut.get(layer)
        if window is None:
            return self.page_tensors[i]
        return self.page_tensors[i][self.first_pages(window)[i]:]

    def first_pages(self, window: int) -> list[int]:
        """Each sequence's page holding the first key its first query attends to."""
        first = self._first_pages.get(window)
        if first is None:
            first = self._first_pages[window] = [
                first_window_page(s.start_pos, window, self.cfg.page_size) for s in self.seqs]
        return first

    def query_rows(self, idx: list[int]) -> torch.Tensor | slice:
        """The rows of q (and of the attention output) of the sequences idx: a slice where
        they are consecutive (decode micro-batches), else an index tensor (cached per idx)."""
        key = tuple(idx)
        rows = self._rows.get(key)
        if rows is None:
            a, b = self.qo[idx[0]], self.qo[idx[-1] + 1]
            if b - a == sum(self.seqs[i].q_len for i in idx):
                rows = slice(a, b)
            else:
                rows = torch.cat([torch.arange(self.qo[i], self.qo[i + 1]) for i in idx])
            self._rows[key] = rows
        return rows

    def dense_head_table(self, idx: list[int], slots: torch.Tensor) -> PageTable:
        """The dense decodes' per-(sequence, KV head) table over device slots (slots in page
        order): its shape is the same in every layer of the step, built once; a layer only
        maps its slots through it."""
        return self._head_table(tuple(idx), slots, lambda: dense_batch(
            self, idx, torch.arange(sum(self.n_pages[i] for i in idx))).page_table)

    def row_head_table(self, slots: torch.Tensor) -> PageTable:
        """`dense_head_table` of every sequence with a row per token: a decode's drafts each
        attend to the pages up to their own position (the step's K/V written first)."""
        def rows() -> PageTable:
            ps, indptr, entries, last, base = self.cfg.page_size, [0], [], [], 0
            for s, n in zip(self.seqs, self.n_pages):
                for kv in range(s.start_pos + 1, s.kv_len + 1):
                    pages = -(-kv // ps)
                    entries.extend(range(base, base + pages))
                    indptr.append(len(entries))
                    last.append(kv - (pages - 1) * ps)
                base += n
            return PageTable(torch.tensor(indptr, dtype=torch.int32),
                             torch.tensor(entries, dtype=torch.int32),
                             torch.tensor(last, dtype=torch.int32), ps)
        return self._head_table("rows", slots, rows)

    def _head_table(self, key, slots: torch.Tensor, build) -> PageTable:
        """The table `build()` gives, once per KV head, made once a step under `key`; each
        call maps its entries (positions in page order) through `slots`."""
        plan = self._head_tables.get(key)
        if plan is None:
            heads = build().per_head(self.tiers.page_shape.num_kv_heads)
            plan = self._head_tables[key] = PageTable(heads.indptr, heads.indices.long(),
                                                      heads.last_page_len, heads.page_size)
        return PageTable(plan.indptr, slots[plan.indices].to(torch.int32), plan.last_page_len,
                         plan.page_size)

    def select(self, layer: int, qd: torch.Tensor, idx: list[int], observe: bool = True):
        """Top pages of layer `layer` for the step's sequences `idx`, queries qd [B, H, D]."""
        reqs = [self.parts.requests[self.seqs[i].request_id] for i in idx]
        # NOTE: the summaries are in host memory (RequestKV): on a GPU the queries come down,
        # one small copy a micro-batch and layer (selection on the GPU: not built yet)
        if reqs:
            qd = qd.to(reqs[0].summaries.device)
        priors = None
        if self.cfg.prior_pages > 0:        # per layer and request: only when they are used
            priors = [None if r.prior is None else r.prior[layer] for r in reqs]
        # pipelined modes select on stage threads while this thread's attention runs: the
        # C selection keeps off the attention's pool there
        return self.selection.select(layer, qd, [r.summaries[layer] for r in reqs],
                                     [self.n_pages[i] for i in idx],
                                     [self.last_len[i] for i in idx],
                                     self.tiers.page_shape.num_kv_heads, priors, observe,
                                     [r.centroids for r in reqs],
                                     pooled=self.pipe.mode == "sequential")

    def select_plan(self, idx: list[int], group: int):
        """`select` of the sequences idx prepared for every layer of the step
        (PageSelection.plan; no observation), or None where it does not serve them."""
        reqs = [self.parts.requests[self.seqs[i].request_id] for i in idx]
        priors = [r.prior for r in reqs] if self.cfg.prior_pages > 0 else None
        return self.selection.plan([r.summaries for r in reqs], [self.n_pages[i] for i in idx],
                                   priors, self.tiers.page_shape.num_kv_heads, group,
                                   pooled=self.pipe.mode == "sequential")

    def reused(self, keys: torch.Tensor) -> torch.Tensor:
        """Which of a selection's `keys` the last completed step selected too (bool [n]);
        records this step's (the store's end_step stamps them once the step completes, so a
        step run again after a failure splits as it did the first time)."""
        self.selected.append(keys)
        return self.selection.reused(keys)
