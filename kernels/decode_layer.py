"""A decode step's decoder layers as one C call each (kernels/_layer.c).

engine/llama.py's DecoderLayer runs ~15 torch and C calls a layer, each with Python around
it; at one decode row a call's own work is a few microseconds, so on a slow core the Python
was most of the step (~10 of 24 ms at 1K tokens, AMD EPYC without AVX-512). Where a step
allows it, the model runs each layer as one call instead: the same C ops (our 4/8-bit
matmul, the C norm, RoPE, K/V write and SiLU x up, the C table attention), so the same bits
in float32. (A bf16 model's rows run float32 here and bf16 where its layers run op by op: a
row's result then depends on the path its step takes.)

It serves a step when: the rows are float32 (a bf16 model, whose prefill runs bf16, hands
its decode rows over as float32 copies), every layer's matmuls have our 4- or 8-bit decode
form and no bias, the layer ops are on, and the KV store's resident decode
path (kvstore/resident.py) takes the step (`KVTable`). A layer is one call: over the step's
dense table, or in sparse layers selecting its pages and attending to them (`SparseWords`);
on steps the KV store does not lay out for that (dense and sparse rows mixed) sparse
layers are two calls, the KV store's selection and attention between them. Rows of LoRA
adapters' requests get their adapter's deltas in the same call (`LoraWords`).
Else the model's layers run as before.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import packed_linear
from kernels.decode_plan import TablePlan
from kernels.layer_ops import MAX_DIM, LayerOps

try:
    from kernels import _layer
except ImportError:         # a checkout whose extensions are not built (then layers as before)
    _layer = None


class FusedLayers:
    enabled = True      # False: the model's layers op by op (the reference, A/B)


class SparseWords:
    """A step's sparse layers for kernels/_layer.c: each selects its pages and attends to
    them in its layer's call (the KV store's SelectPlan and SelectedPlan, run in C, the same
    bits); `result(layer)` after it."""

    enabled = True      # False: sparse layers in two calls around the KV store's (A/B)

    def __init__(self, select, decode, sparse: list[bool]):
        """select: kernels/select_plan.SelectPlan, decode: kernels/decode_plan.SelectedPlan
        of the step's sequences (every row of the step, in order); sparse: per layer, whether
        it selects (else it attends to the step's table)."""
        (s_head, s_rows), (d_head, d_rows) = select.native_words(), decode.native_words()
        self.select, self.layers = select, len(sparse)
        self.results = torch.zeros(len(sparse), _layer.RESULT_WORDS, dtype=torch.int64)
        head = s_head + d_head + [self.results.data_ptr()]
        rows = [[int(sp)] + sr + dr for sp, sr, dr in zip(sparse, s_rows, d_rows)]
        if len(head) != _layer.SPARSE_HEADER or len(rows) != len(sparse) \
                or any(len(r) != _layer.SPARSE_ROW for r in rows):
            raise RuntimeError(f"SparseWords: {len(head)} header words and rows of "
                               f"{len(rows[0]) if rows else 0}, _layer.c reads "
                               f"{_layer.SPARSE_HEADER} and {_layer.SPARSE_ROW}")
        self.words = torch.tensor(head + [w for r in rows for w in r], dtype=torch.int64)
        self.shape = (select.b_size, select.kvh * select.group, select.kvh, select.d)
        if (decode.b, decode.h, decode.kvh, decode.d) != self.shape:
            raise ValueError(f"SparseWords: a selection of {self.shape} (rows, heads, KV "
                             f"heads, head dim), an attention of "
                             f"{(decode.b, decode.h, decode.kvh, decode.d)}")
        self.pool, self.sparse = decode.pool, sparse
        self._keep = decode                 # the C calls read it (and `select`) by address

    def result(self, layer: int):
        """(the SelectedPages layer `layer` selected, seconds selecting, seconds attending)."""
        nnz, unnz, select_ns, attend_ns = self.results[layer].tolist()
        return self.select.selected(layer, nnz, unnz), select_ns * 1e-9, attend_ns * 1e-9


LORA_MATMULS = ("qkv", "o", "gate_up", "down")     # _layer.c's order of a layer's matmuls


def lora_table(weights: dict, layers: int) -> torch.Tensor | None:
    """An adapter's table for _layer.c: int64 [layers, 4, LORA_ENTRY] (per layer and matmul:
    the addresses of A^T [in, r] and B^T [r, out], and r; 0 where not adapted), from
    engine/lora.py's weights ((layer, matmul) -> (A^T, B^T scaled), which the adapter keeps
    alive); None where _layer.c does not serve them (not contiguous float32 on the CPU, a
    rank over MAX_LORA_RANK)."""
    if _layer is None:
        return None
    table = torch.zeros(layers, len(LORA_MATMULS), _layer.LORA_ENTRY, dtype=torch.int64)
    for (layer, fused), (at, bt) in weights.items():
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
               for t in (at, bt)) or at.shape[1] > _layer.MAX_LORA_RANK:
            return None
        table[layer, LORA_MATMULS.index(fused)] = torch.tensor(
            [at.data_ptr(), bt.data_ptr(), at.shape[1]])
    return table


class LoraWords:
    """A step's LoRA rows for _layer.c (its S_LORA table): each row's adapter (-1: the base
    model) and the adapters' tables (`lora_table`, kept alive by their adapters)."""

    def __init__(self, row_adapter: list[int], tables: list[torch.Tensor]):
        if any(a >= len(tables) for a in row_adapter):
            raise ValueError(f"LoraWords: a row of adapter {max(row_adapter)}, "
                             f"{len(tables)} adapters")
        self.rows = len(row_adapter)
        self.layers = {t.shape[0] for t in tables}
        self.row_adapter = torch.tensor(row_adapter, dtype=torch.int64)
        self.tables = torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64)
        self.words = torch.tensor([len(tables), self.row_adapter.data_ptr(),
                                   self.tables.data_ptr()], dtype=torch.int64)
        if self.words.numel() != _layer.LORA_HEADER:
            raise RuntimeError(f"LoraWords: {self.words.numel()} header words, _layer.c "
                               f"reads {_layer.LORA_HEADER}")
        self._keep = tables


@dataclass
class KVTable:
    """The KV side of a step's layers: the pool [S, 2, KVH, ps, D], the slot and offset of
    each row's new token (tok_slots int64 [L, B], tok_off int64 [B]); `plan`, the attention's
    table over every layer (its indptr, last page lengths, per-layer slots), then `after(layer,
    attention seconds)` follows each layer (its sparse layers, `sparse`, select their pages in
    the call instead); or, plan None, `attend(layer, q, scale) -> out` ([B, H, D] each)
    attends to the K/V a layer's call wrote (sparse layers: their selection)."""
    pool: torch.Tensor
    tok_slots: torch.Tensor
    tok_off: torch.Tensor
    plan: TablePlan | None
    after: Callable[[int, float], None]
    attend: Callable[[int, torch.Tensor, float], torch.Tensor]
    sparse: SparseWords | None = None


def layer_words(layers) -> tuple[torch.Tensor, int] | None:
    """(int64 [L, LAYER_WORDS] the layers' norm weights and decode matmuls (addresses, bits),
    the fewest rows a step multiplies by the dense weights instead), or None where a layer
    has a weight this path does not run (a bias, a form other than our 4/8-bit one). The
    layers' `decode_norms()` give float32 norm weights (copies a bf16 model keeps alive)."""
    if _layer is None:
        return None
    rows, limit = [], 1 << 62
    for layer in layers:
        norms = layer.decode_norms()        # input, post-attention, Qwen3's q / k heads
        if any(w is not None and (w.dtype != torch.float32 or not w.is_contiguous())
               for w in norms):
            return None
        words = [0 if w is None else w.data_ptr() for w in norms] + [
            int(getattr(layer, "rope", True))]
        for name in ("qkv", "o", "gate_up", "down"):
            linear = getattr(layer, name)
            args = linear.decode.native_args()
            if args is None or linear.bias is not None:
                return None
            if linear.prefill is not None:
                limit = min(limit, linear.prefill_rows)
            words.extend(args)
        rows.append(words)
    table = torch.tensor(rows, dtype=torch.int64)
    return (table, limit) if table.shape[1] == _layer.LAYER_WORDS else None


class DecodeLayers:
    """One step's layers: `run(i)` is layer i over the step's hidden rows x, in place."""

    def __init__(self, words: torch.Tensor, x: torch.Tensor, rope: tuple[torch.Tensor, ...],
                 kv: KVTable, dims: tuple[int, int, int, int, int],
                 lora: LoraWords | None = None):
        hidden, heads, kv_heads, head_dim, inter = dims
        b, plan, pool = x.shape[0], kv.plan, kv.pool
        self.x, self.words, self.kv, self.lora = x, words, kv, lora
        self.cos, self.sin = (r.reshape(b, head_dim).contiguous() for r in rope)
        self.h = torch.empty(b, hidden)
        nq, nqkv = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        # _layer.c's scratch (its layout there, by `scratch_q`), and the queries a layer's
        # first part leaves in it for `kv.attend` (split layers)
        self.scratch = torch.empty(b * (hidden + max(nqkv + 2 * nq + heads, 3 * inter + hidden)))
        self.q = self.scratch[b * (hidden + nqkv):b * (hidden + nqkv + nq)].view(b, heads,
                                                                                 head_dim)
        table = (0, 0, 0, 0, 0, 0) if plan is None else (
            plan.indptr.data_ptr(), plan.last.data_ptr(), plan.slots.shape[1],
            plan.slots.data_ptr(), plan.simd, plan.threads)
        step = [b, hidden, heads, kv_heads, head_dim, inter, pool.shape[3],
                int(pool.dtype == torch.bfloat16), pool.shape[0], table[4],
                torch.get_num_threads(), x.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
                pool.data_ptr(), kv.tok_off.data_ptr(), table[0], table[1],
                self.scratch.data_ptr(), packed_linear.QMM_SIMD, words.shape[0], table[2],
                kv.tok_slots.data_ptr(),
                table[3], table[5], 0 if kv.sparse is None else kv.sparse.words.data_ptr(),
                0 if lora is None else lora.words.data_ptr()]
        if len(step) != _layer.STEP_WORDS:      # (_layer.c's S_* words, in their order)
            raise RuntimeError(f"DecodeLayers: {len(step)} step words, _layer.c reads "
                               f"{_layer.STEP_WORDS}")
        self.step = torch.tensor(step, dtype=torch.int64)
        self.args = (self.step.data_ptr(), words.data_ptr(), self.h.data_ptr())

    @classmethod
    def build(cls, words: tuple[torch.Tensor, int] | None, x: torch.Tensor, rope,
              kv: KVTable | None, dims: tuple[int, int, int, int, int],
              lora: LoraWords | None = None) -> DecodeLayers | None:
        """The step's layers in C (words: `layer_words`; lora: the step's adapter rows), or
        None where it does not serve them (then op by op)."""
        if not FusedLayers.enabled or words is None or kv is None or not LayerOps.enabled \
                or dims[0] > MAX_DIM or dims[3] > MAX_DIM \
                or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 \
                or x.shape[0] >= words[1] or any(r.dtype != torch.float32 for r in rope):
            return None
        words, (b, plan) = words[0], (x.shape[0], kv.plan)
        if plan is not None and (plan.b != b or plan.h != dims[1] or plan.kvh != dims[2]
                                 or plan.d != dims[3] or plan.slots.shape[0] != words.shape[0]):
            return None
        sp = kv.sparse
        if sp is not None and (plan is None or sp.layers != words.shape[0] or sp.pool is not
                               kv.pool or sp.shape != (b, dims[1], dims[2], dims[3])):
            return None
        if kv.tok_slots.shape != (words.shape[0], b) or kv.tok_off.shape != (b,) \
                or kv.pool.shape[2] != dims[2] or kv.pool.shape[4] != dims[3] \
                or kv.pool.dtype not in (torch.float32, torch.bfloat16) \
                or any(t.dtype != torch.int64 or not t.is_contiguous()
                       for t in (kv.tok_slots, kv.tok_off)):
            return None
        if lora is not None and (lora.rows != b or lora.layers - {words.shape[0]}):
            return None
        return cls(words, x, rope, kv, dims, lora)

    def run(self, layer: int, eps: float, scale: float) -> None:
        """Layer `layer` over the rows: x updated in place. With the KV's table, one call;
        without, two around `kv.attend`."""
        if self.kv.plan is not None:
            self.kv.after(layer, _layer.decode_layer(*self.args, layer, eps, scale))
            return
        _layer.decode_layer(*self.args, layer, eps, scale, 1)
        out = self.kv.attend(layer, self.q, scale)
        if out.shape != self.q.shape:       # (the C call reads [B, H * D] floats from it)
            raise ValueError(f"DecodeLayers: the attention gave {tuple(out.shape)}, not "
                             f"{tuple(self.q.shape)}")
        if out.dtype != torch.float32 or not out.is_contiguous():
            out = out.float().contiguous()
        _layer.decode_layer(*self.args, layer, eps, scale, 2, out.data_ptr())
