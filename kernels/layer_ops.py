"""A decoder layer's small ops as one C call each (kernels/_layerops.c): RMSNorm with the
residual add before it, RoPE in place, the scatter of new K/V into the KV pool, SiLU(gate) *
up in float32, and the summaries of the pages written (kernels/page_summary.py's, read in
place). torch runs each as 3 to 8 ops with their dispatch and temporaries, which at one decode
row is most of their cost. Same arithmetic as torch and transformers (float32 statistics, bf16
results rounded where torch's ops round them); CPU tensors in bfloat16 or float32 only:
`supports` says when the model may call them (else it runs torch's ops).

Leaf module: imports only torch and kernels.*.
"""
from __future__ import annotations

import torch

try:
    from kernels import _layerops
except ImportError:         # a checkout whose extensions are not built (`make setup` builds them)
    _layerops = None

_DTYPES = (torch.bfloat16, torch.float32)


class LayerOps:
    enabled = True      # False: the model runs torch's ops (the reference, A/B)


MAX_DIM = 16384         # the C ops' longest row (_layerops.c)
MAX_HEAD = 256          # summarize's longest head (_layerops.c)


def supports(x: torch.Tensor) -> bool:
    """Whether the C ops serve activations like x [T, hidden]."""
    return LayerOps.enabled and _layerops is not None and x.is_cpu and x.dtype in _DTYPES \
        and x.shape[-1] <= MAX_DIM


def _rows(x: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Row stride of a 2-d CPU tensor of rows of contiguous values (in `dtype`, when given:
    the C op reads every operand as the first's dtype)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_cpu or x.dtype not in _DTYPES \
            or (dtype is not None and x.dtype != dtype):
        raise ValueError(f"expected a CPU bf16 / float32 tensor of rows of contiguous values, "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}")
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, dim] -> RMSNorm(x) [T, dim] (new tensor). With `residual` [T, dim], first
    x += residual in place (the layer's residual stream), then the norm of the sum."""
    t, dim = x.shape
    x_stride = _rows(x)
    if dim > MAX_DIM:
        raise ValueError(f"rms_norm: rows of {dim} values (at most {MAX_DIM})")
    if weight.dtype != x.dtype or weight.shape != (dim,) or not weight.is_contiguous() \
            or not weight.is_cpu:
        raise ValueError("rms_norm: weight must be x's dtype, [dim], contiguous, on the CPU")
    out = torch.empty(t, dim, dtype=x.dtype)
    res, res_stride = 0, 0
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError("rms_norm: residual must match x")
        res, res_stride = residual.data_ptr(), _rows(residual, x.dtype)
    _layerops.rms_norm(x.data_ptr(), x_stride, res, res_stride, weight.data_ptr(),
                       out.data_ptr(), t, dim, eps, x.dtype == torch.bfloat16)
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of head_dim values of each row of x [T, >= heads *
    head_dim] in place; cos/sin [T, 1, head_dim] (or [T, head_dim]) in x's dtype."""
    t, x_stride = x.shape[0], _rows(x)
    if x.shape[1] < heads * head_dim:
        raise ValueError(f"rope_: rows of {x.shape[1]} values hold no {heads} heads")
    cos, sin = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
    _rows(cos, x.dtype), _rows(sin, x.dtype)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_: cos/sin must be contiguous")
    _layerops.rope(x.data_ptr(), x_stride, cos.data_ptr(), sin.data_ptr(), t, heads,
                   head_dim, x.dtype == torch.bfloat16)


def _serves_pool(pool: torch.Tensor, slots: torch.Tensor, per_slot: torch.Tensor) -> bool:
    """Whether a C op may address pool [S, 2, KVH, page_size, D] (CPU, bf16 / float32,
    contiguous) through slots and a second int64 index of as many entries."""
    return pool.is_cpu and pool.dtype in _DTYPES and pool.is_contiguous() and pool.dim() == 5 \
        and slots.dtype == per_slot.dtype == torch.int64 and slots.is_contiguous() \
        and per_slot.is_contiguous() and slots.numel() == per_slot.numel()


def write_kv(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             offsets: torch.Tensor) -> bool:
    """Token t's k[t], v[t] [KVH, D] into pool [S, 2, KVH, page_size, D] at slot slots[t],
    offset offsets[t] (int64), as `pool[slots, 0, :, offsets] = k` does. False (nothing
    written) where the C op does not serve these tensors: the caller uses torch's."""
    if not (supports(k) and _serves_pool(pool, slots, offsets) and k.dtype == v.dtype):
        return False
    t, kvh, d = k.shape
    if k.stride()[1:] != (d, 1) or v.stride() != k.stride() or v.shape != k.shape \
            or not v.is_cpu or pool.shape[2] != kvh or pool.shape[4] != d or slots.numel() != t:
        return False
    _layerops.write_kv(pool.data_ptr(), pool.shape[0], kvh, pool.shape[3], d,
                       pool.dtype == torch.bfloat16, k.data_ptr(), v.data_ptr(), k.stride(0),
                       slots.data_ptr(), offsets.data_ptr(), t, k.dtype == torch.bfloat16)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2I] float32 -> silu(gate) * up [T, I] (new tensor), or None where the C op
    does not serve it (not float32, rows not contiguous: the caller runs torch's). The exp is
    a polynomial, within a few float32 ulp of torch's."""
    if not (LayerOps.enabled and _layerops is not None and gate_up.dtype == torch.float32
            and gate_up.is_cpu and gate_up.dim() == 2 and gate_up.stride(1) == 1
            and gate_up.shape[1] % 2 == 0):
        return None
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, n)
    _layerops.silu_mul(gate_up.data_ptr(), gate_up.data_ptr() + 4 * n, out.data_ptr(), t, n,
                       gate_up.stride(0))
    return out


def summarize_slots(pool: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor
                    ) -> torch.Tensor | None:
    """`summarize_pages(pool[slots, 0], valid)` (kernels/page_summary.py) read in place:
    slots, valid [n] int64 -> [n, KVH, 3, D] in the pool's dtype; None where the C op does
    not serve these tensors (the caller uses summarize_pages). min and max are its bits (key
    values); the mean sums the tokens in order where torch adds blocks of them, so it may
    differ by float32 rounding (one bf16 ulp at most)."""
    if not (LayerOps.enabled and _layerops is not None and _serves_pool(pool, slots, valid)
            and pool.shape[4] <= MAX_HEAD):
        return None
    n, (kvh, ps, d) = slots.numel(), pool.shape[2:]
    out = torch.empty(n, kvh, 3, d, dtype=pool.dtype)
    _layerops.summarize(pool.data_ptr(), pool.shape[0], kvh, ps, d,
                        pool.dtype == torch.bfloat16, slots.data_ptr(), valid.data_ptr(), n,
                        out.data_ptr())
    return out
