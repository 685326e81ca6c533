"""A decode step's decoder layers as one C call each (kernels/_layer.c).

engine/llama.py's DecoderLayer runs ~15 torch and C calls a layer, each with Python around
it; at one decode row a call's own work is a few microseconds, so on a slow core the Python
was most of the step (~10 of 24 ms at 1K tokens, AMD EPYC without AVX-512). Where a step
allows it, the model runs each layer as one call instead: the same C ops (our 4/8-bit
matmul, the C norm, RoPE and K/V write, the C table attention), so the same bits but for
SiLU (a polynomial exp, within a few float32 ulp of torch's).

It serves a step when: the model's activations are float32, every layer's matmuls have our
4- or 8-bit decode form and no bias, the layer ops are on, and the KV store offers a dense
table for every layer (`KVTable`: the resident decode path, kvstore/resident.py). Else the
model's layers run as before.

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.decode_plan import TablePlan
from kernels.layer_ops import LayerOps

try:
    from kernels import _layer
except ImportError:         # a checkout whose extensions are not built (then layers as before)
    _layer = None


class FusedLayers:
    enabled = True      # False: the model's layers op by op (the reference, A/B)


@dataclass
class KVTable:
    """The KV side of a step's layers: the pool [S, 2, KVH, ps, D], the slot and offset of
    each row's new token (tok_slots int64 [L, B], tok_off int64 [B]) and the attention's
    table over every layer (`plan`: its indptr, last page lengths, per-layer slots)."""
    pool: torch.Tensor
    tok_slots: torch.Tensor
    tok_off: torch.Tensor
    plan: TablePlan


def layer_words(layers) -> tuple[torch.Tensor, int] | None:
    """(int64 [L, LAYER_WORDS] the layers' norm weights and decode matmuls (addresses, bits),
    the fewest rows a step multiplies by the dense weights instead), or None where a layer
    has a weight this path does not run (a bias, a form other than our 4/8-bit one, norms
    not float32)."""
    if _layer is None:
        return None
    rows, limit = [], 1 << 62
    for layer in layers:
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        words = [w.data_ptr() for w in norms]
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
                 kv: KVTable, dims: tuple[int, int, int, int, int]):
        hidden, heads, kv_heads, head_dim, inter = dims
        b, plan = x.shape[0], kv.plan
        self.x, self.words = x, words
        self.cos, self.sin = (r.reshape(b, head_dim).contiguous() for r in rope)
        self.h = torch.empty(b, hidden)
        nq = heads * head_dim
        attn = (nq + 2 * kv_heads * head_dim) + 2 * nq + heads
        self.scratch = torch.empty(b * (hidden + max(attn, 3 * inter + hidden)))
        self.kv = kv
        pool = kv.pool
        step = [b, hidden, heads, kv_heads, head_dim, inter, pool.shape[3],
                int(pool.dtype == torch.bfloat16), pool.shape[0], plan.simd,
                torch.get_num_threads(), x.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
                pool.data_ptr(), kv.tok_off.data_ptr(), plan.indptr.data_ptr(),
                plan.last.data_ptr(), self.scratch.data_ptr(), 1, words.shape[0],
                plan.slots.shape[1], kv.tok_slots.data_ptr(), plan.slots.data_ptr(),
                plan.threads]
        self.step = torch.tensor(step, dtype=torch.int64)
        self.args = (self.step.data_ptr(), words.data_ptr(), self.h.data_ptr())

    @classmethod
    def build(cls, words: tuple[torch.Tensor, int] | None, x: torch.Tensor, rope,
              kv: KVTable | None, dims: tuple[int, int, int, int, int]) -> DecodeLayers | None:
        """The step's layers in C (words: `layer_words`), or None where it does not serve
        them (then op by op)."""
        if not FusedLayers.enabled or words is None or kv is None or not LayerOps.enabled \
                or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 \
                or x.shape[0] >= words[1] or any(r.dtype != torch.float32 for r in rope):
            return None
        words, (b, plan) = words[0], (x.shape[0], kv.plan)
        if plan.b != b or plan.h != dims[1] or plan.kvh != dims[2] or plan.d != dims[3] \
                or kv.tok_slots.shape != (words.shape[0], b) or kv.tok_off.shape != (b,) \
                or plan.slots.shape[0] != words.shape[0] \
                or any(t.dtype != torch.int64 or not t.is_contiguous()
                       for t in (kv.tok_slots, kv.tok_off)):
            return None
        return cls(words, x, rope, kv, dims)

    def run(self, layer: int, eps: float, scale: float) -> float:
        """Layer `layer` over the rows: x updated in place. Returns the attention's seconds."""
        return _layer.decode_layer(*self.args, layer, eps, scale)
