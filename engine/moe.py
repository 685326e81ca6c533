"""An MoE model's routed decoder layer (Qwen3-MoE, Qwen2-MoE, Mixtral), run by the
Llama-family forward (engine/llama.py builds it for the layers engine/moe_config.py's
`MoeSpec.layers` names).

The attention is the dense family's (engine/llama.py `DecoderLayer.attention`); the MLP is
routed, as transformers' sparse MoE blocks compute it:
- a router (a [experts, hidden] linear) scores each token; softmax in float32; the top_k
  experts are kept, their probabilities renormalised to sum to 1 where the config says
  (`norm_topk_prob`; Mixtral always), then rounded to the activations' dtype (Qwen's; Mixtral
  keeps them float32);
- each chosen expert, a SiLU-gated MLP of its own, runs on the tokens routed to it, and its
  output, times the token's probability for it, is added to the token's row (in the
  experts' order);
- Qwen2-MoE adds a shared expert to every token, gated by sigmoid(shared_expert_gate).

The experts are stored as two 3-D parameters ([experts, 2 x expert_size, hidden] gate|up and
[experts, hidden, expert_size] down, transformers 5's layout); each expert's slices are
packed into matmuls of their own (`pack`), so a decode step reads only its tokens' experts'
bytes, in the decode format the weight plan chose, and a prefill chunk's experts pick their
form by the rows routed to them. A decode step's rows each run their experts in one C call
(kernels/_qmatmul.c `moe_row`) where the decode form is our kernel's. A GGUF file's expert
blocks are packed as they load (`take_codes`), their dense slices never filled. The rest is
op by op: the C decode layers run the Llama block only.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.llama import DecoderLayer, coded_linear, empty_param, make_linear, silu_mul
from engine.model_config import ModelConfig
from kernels.packed_linear import DENSE, GroupQuant, Linear, expert_table, moe_rows

# an expert's projection as the checkpoints name it (Qwen's, and Mixtral's w1 / w3 / w2)
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_SHARED = re.compile(r"^mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")


class MoeDecoderLayer(DecoderLayer):
    MATMULS = ("qkv", "o")          # (the experts' matmuls are built by `pack` below)

    def _mlp_params(self, cfg: ModelConfig, p: dict) -> None:
        moe, h = cfg.moe, cfg.hidden_size
        self.moe = moe
        self._parts: dict[str, dict[int, GroupQuant]] = {}      # `take_codes`' rows so far
        self._coded: dict[str, Linear] = {}                     # and what it packed
        self._row_steps = 0         # (`pack` sets it: steps of fewer rows are decode steps)
        self.router = empty_param(moe.num_experts, h, **p)
        self.experts_gate_up = empty_param(moe.num_experts, 2 * moe.expert_size, h, **p)
        self.experts_down = empty_param(moe.num_experts, h, moe.expert_size, **p)
        s = moe.shared_size
        self.shared_gate_up = empty_param(2 * s, h, **p) if s else None
        self.shared_down = empty_param(h, s, **p) if s else None
        self.shared_gate = empty_param(1, h, **p) if s else None

    def pack(self, quant: dict[str, GroupQuant], fmt: str | None, prefill_rows: int) -> None:
        """The attention's matmuls as a dense layer's, and each expert's gate|up and down
        (the shared expert's too) as matmuls of their own in `fmt` for short steps; those
        packed from a file's codes as they loaded (`take_codes`) as they are."""
        super().pack(quant, fmt, prefill_rows)

        def linear(weight: torch.Tensor, name: str) -> Linear:
            if name in self._coded:
                return self._coded[name]
            return make_linear(weight, None, quant.get(name), fmt, prefill_rows)
        self.experts = [(linear(self.experts_gate_up[e], f"experts.{e}.gate_up"),
                         linear(self.experts_down[e], f"experts.{e}.down"))
                        for e in range(self.moe.num_experts)]
        self.shared = None if self.shared_gate is None else (
            linear(self.shared_gate_up, "shared.gate_up"), linear(self.shared_down, "shared.down"))
        # steps of fewer rows than prefill_rows (decode) run each row in one C call, where
        # the experts' decode forms are our kernel's
        self._table = expert_table(self.experts) if fmt is not None else None
        self._row_steps = prefill_rows

    def take_codes(self, matmul: str, start: int, codes: GroupQuant,
                   decode_format: str | None) -> bool:
        """Keep a GGUF file's blocks of an expert's (or the shared expert's) `matmul` rows
        from `start`, and pack the matmul in `decode_format`, for steps of any rows, once all
        its rows are here; its dense slice is then never filled (a big MoE file's experts at
        2 bytes a weight, beside their codes, would not fit). False where the decode form is
        dense: the caller fills the dense slice."""
        if decode_format is None or decode_format in DENSE:
            return False
        parts = self._parts.setdefault(matmul, {})
        parts[start] = codes
        size = self.moe.shared_size if matmul.startswith("shared") else self.moe.expert_size
        rows = 2 * size if matmul.endswith("gate_up") else self.experts_down.shape[1]
        if sum(p.shape[0] for p in parts.values()) == rows:
            del self._parts[matmul]
            blocks = [parts[s] for s in sorted(parts)]      # (gate and up may differ in width)
            self._coded[matmul] = coded_linear(GroupQuant.cat(blocks), decode_format)
        return True

    def finish_codes(self) -> None:
        """After loading: a matmul whose rows came partly as codes and partly as floats (a
        file with mixed tensor types) was never packed; its codes are dequantized into their
        dense slices, and it is packed from those like a float checkpoint's."""
        for matmul, parts in self._parts.items():
            for start, codes in parts.items():
                dst = self._dense(matmul).narrow(0, start, codes.shape[0])
                with torch.no_grad():
                    dst.copy_(codes.dequantize())
        self._parts = {}

    def _dense(self, matmul: str) -> torch.Tensor:
        """The dense weight of `matmul` (experts.N.gate_up / .down, shared.gate_up / .down)."""
        if matmul.startswith("shared"):
            return self.shared_gate_up if matmul.endswith("gate_up") else self.shared_down
        e = int(matmul.split(".")[1])
        return self.experts_gate_up[e] if matmul.endswith("gate_up") else self.experts_down[e]

    def routed_weight(self, name: str) -> tuple[torch.Tensor, nn.Parameter, str | None, int
                                                ] | None:
        """Where checkpoint tensor `name` (past `model.layers.N.`) lands: the router, an
        expert's gate / up / down (one expert's, or all of them as transformers 5 fuses
        them), Qwen2-MoE's shared expert and its gate; None for the attention's tensors.
        (slice, its parameter, the matmul packed from it, the slice's first row there)"""
        m = _EXPERT.match(name)
        if m is not None:
            e, part = int(m.group(1)), _PART[m.group(2)]
            if e >= self.moe.num_experts:
                raise ValueError(f"checkpoint has expert {e} but the config says "
                                 f"{self.moe.num_experts} experts")
            if part == 2:
                return self.experts_down[e], self.experts_down, f"experts.{e}.down", 0
            size = self.moe.expert_size
            return (self.experts_gate_up[e].narrow(0, part * size, size), self.experts_gate_up,
                    f"experts.{e}.gate_up", part * size)
        m = _SHARED.match(name)
        if m is not None and self.shared_gate is not None:
            if m.group(1) == "down_proj":
                return self.shared_down, self.shared_down, "shared.down", 0
            s = self.moe.shared_size
            start = 0 if m.group(1) == "gate_proj" else s
            return (self.shared_gate_up.narrow(0, start, s), self.shared_gate_up,
                    "shared.gate_up", start)
        whole = {"mlp.gate.weight": self.router, "block_sparse_moe.gate.weight": self.router,
                 "mlp.experts.gate_up_proj": self.experts_gate_up,
                 "mlp.experts.down_proj": self.experts_down,
                 "mlp.shared_expert_gate.weight": self.shared_gate}.get(name)
        return None if whole is None else (whole, whole, None, 0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top_k experts [T, k] int64 and their weights [T, k] (in x's dtype,
        or float32 where the family keeps them so: Mixtral) (a
        decode step's rows scored one by one: a GEMM's rounding depends on its rows, and a
        row's experts must not depend on its batch)."""
        if x.shape[0] < self._row_steps:
            logits = torch.cat([F.linear(x[i:i + 1], self.router) for i in range(x.shape[0])])
        else:
            logits = F.linear(x, self.router)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = probs.topk(self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype) if self.moe.round_weights else weights

    def mlp(self, normed: torch.Tensor, lora, native: bool) -> torch.Tensor:
        """The routed MLP's output [T, hidden] of its normed inputs (engine/lora.py serves no
        adapter on a routed layer's MLP)."""
        chosen, weights = self.route(normed)
        if self._table is not None and normed.shape[0] < self._row_steps:
            out = moe_rows(normed, self._table, chosen, weights, self.moe.expert_size)
        else:
            out = self._torch_experts(normed, chosen, weights, native)
        if self.shared is not None:
            gate = torch.sigmoid(F.linear(normed, self.shared_gate))
            out = out + gate * self._expert(self.shared, normed, native)
        return out

    def _torch_experts(self, normed: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                       native: bool) -> torch.Tensor:
        """The routed experts' weighted sum [T, hidden], matmul by matmul."""
        out = torch.zeros_like(normed)
        if normed.shape[0] == 1:        # a decode row: its k experts, in the experts' order
            ids = chosen[0].tolist()
            for j in sorted(range(len(ids)), key=ids.__getitem__):
                y = self._expert(self.experts[ids[j]], normed, native) * weights[0, j]
                out += y.to(out.dtype)
        else:
            self._grouped(normed, chosen, weights, out, native)
        return out

    def _grouped(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor, native: bool) -> None:
        """out += each row's experts' outputs times their weights, each expert run once on
        the rows routed to it."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)        # (row, slot) pairs by expert
        rows, w = order // chosen.shape[1], weights.reshape(-1, 1)[order]
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if n:
                sel = rows[start:start + n]
                y = self._expert(self.experts[e], x[sel], native) * w[start:start + n]
                out.index_add_(0, sel, y.to(out.dtype))
                start += n

    @staticmethod
    def _expert(pair: tuple[Linear, Linear], x: torch.Tensor, native: bool) -> torch.Tensor:
        gate_up, down = pair
        return down(silu_mul(gate_up(x), native))
