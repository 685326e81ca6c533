"""Gemma 3's decoder layer (and Gemma 2's: the same without the q/k head norms), run by the
Llama-family forward (engine/llama.py).

What differs from a Llama layer (transformers' `Gemma3DecoderLayer`):
- four norms: the attention's output and the MLP's are normed before their residual adds
  (`post_attention_layernorm`, `post_feedforward_layernorm`), the MLP's input by
  `pre_feedforward_layernorm`;
- every RMSNorm (these, the q and k head norms, the final one) scales by 1 + w: the weights
  are stored as w, and `fold_norms` adds the 1 once at load, in float32 (engine/norm.py
  `GemmaRMSNorm` multiplies before rounding to the activations' dtype, as transformers);
- the MLP is GELU (tanh approximation) gated;
- the attention scale is query_pre_attn_scalar ** -0.5;
- the windowed layers (five of six) take their own RoPE base, the others the config's (with
  its scaling).
The model (engine/llama.py, which builds these layers where the config says `gemma`) scales
the embeddings by sqrt(hidden), picks each layer's RoPE, and soft-caps the logits where the
config says. Op by op: the C decode layers run the Llama block only. Gemma 2 soft-caps every
attention score too, which the KV store's window attention alone does (kvstore/step.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.llama import DecoderLayer
from engine.llama_weights import LAYER_NORMS
from engine.model_config import ModelConfig
from engine.norm import GemmaRMSNorm


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device):
        super().__init__(cfg, index, dtype, device)
        h = cfg.hidden_size
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv,
                lora=None) -> torch.Tensor:
        native = False          # (the C small ops fuse Llama's residual add and norm)
        o = self.attention(self.input_layernorm(x), rope, kv, lora, native)
        h = x + self.post_attention_layernorm(o)
        return h + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(h), lora, native))

    def mlp(self, normed: torch.Tensor, lora, native: bool) -> torch.Tensor:
        """The MLP's output [T, hidden] of its normed inputs (GELU-gated, tanh)."""
        gate_up = self.gate_up(normed)
        if lora is not None:
            gate_up = lora.apply(self.index, "gate_up", normed, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        return self.down(act) if lora is None else lora.apply(self.index, "down", act,
                                                               self.down(act))

    def norm_weights(self) -> list[torch.Tensor]:
        """The weights of the layer's RMSNorms (`fold_norms`)."""
        norms = (getattr(self, name) for name in LAYER_NORMS)
        return [n.weight for n in norms if n is not None]


def fold_norms(model) -> None:
    """Every RMSNorm weight w of a loaded Gemma model (engine/llama.py's) becomes 1 + w, in
    float32 (GemmaRMSNorm's weights are), as transformers computes `1.0 + weight.float()`."""
    weights = [w for layer in model.layers for w in layer.norm_weights()]
    with torch.no_grad():
        for w in weights + [model.norm.weight]:
            w.copy_(1.0 + w.float())
