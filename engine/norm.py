"""RMSNorm of the Llama family (engine/llama.py), in C where kernels/layer_ops.py serves the
activations, with a float32 copy for a bf16 model's decode rows in the C layers."""
from __future__ import annotations

import torch
from torch import nn

from kernels import layer_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device),
                                   requires_grad=False)       # load_weights fills it
        self.eps = eps
        self._f32: list | None = None       # [weight version, float32 copy]

    def float32(self) -> RMSNorm:
        """This norm with a float32 weight: itself where it has one, else a copy, refreshed in
        place when the weight changed in place (a bf16 model's decode rows run float32 in the
        C layers, whose step words hold the copy's address: it is never replaced)."""
        if self.weight.dtype == torch.float32:
            return self
        try:
            version = self.weight._version
        except RuntimeError:            # an inference tensor: no in-place changes to see
            version = None
        if self._f32 is None:
            norm = RMSNorm(self.weight.shape[0], self.eps, torch.float32, self.weight.device)
            with torch.no_grad():
                norm.weight.copy_(self.weight)
            self._f32 = [version, norm]
        elif version != self._f32[0]:
            with torch.no_grad():
                self._f32[1].weight.copy_(self.weight)
            self._f32[0] = version
        return self._f32[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> [T, dim]; float32 statistics as in HF."""
        if layer_ops.supports(x):
            return layer_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm (transformers' Gemma2/3RMSNorm): the weight (1 + w, folded at load:
    engine/gemma.py) kept in float32 and multiplied before the one rounding to the activations'
    dtype, where Llama's multiplies the rounded activations."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__(dim, eps, torch.float32, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                * self.weight).to(x.dtype)
