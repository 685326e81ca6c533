"""A mixture-of-experts GGUF (llama.cpp's `qwen3moe` and `qwen2moe` files, and Mixtral's,
which are `llama` files with experts): the experts' tensors under the HF names engine/moe.py
loads, and the HF config fields transformers' GGUF reader does not give.

llama.cpp stores a routed layer's experts as three 3-D tensors ([experts, rows, K] in numpy
order: `ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), each expert's rows quantized in
blocks along K as a 2-D tensor's are; they are split here into each expert's projection,
their codes kept (engine/gguf_weights.py decodes the blocks once for the whole tensor).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from kernels.packed_linear import GroupQuant

# llama.cpp's 3-D expert tensors -> each expert's HF projection
EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                "ffn_down_exps": "down_proj"}
# a routed layer's other tensors: the router, Qwen2-MoE's shared expert and its gate
MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
             "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj"}
# general.architecture -> (HF architecture, model_type) of a file with experts
_ARCHS = {"qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
          "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
          "llama": ("MixtralForCausalLM", "mixtral")}


def expert_count(fields: dict, arch: str) -> int:
    """The file's experts a routed layer (0: a dense model)."""
    return int(fields.get(f"{arch}.expert_count", 0) or 0)


def split_experts(layer: int, part: str, value: torch.Tensor | GroupQuant, experts: int
                  ) -> Iterator[tuple[str, torch.Tensor | GroupQuant]]:
    """(HF name, that expert's [rows, K]) of each expert of a 3-D `part` tensor: a float one
    [experts, rows, K], or the blocks of all its rows as one GroupQuant [experts x rows, K]."""
    proj = EXPERT_PARTS[part]
    rows = value.shape[0] // experts if isinstance(value, GroupQuant) else value.shape[1]
    if isinstance(value, GroupQuant) and rows * experts != value.shape[0] \
            or not isinstance(value, GroupQuant) and value.shape[0] != experts:
        raise ValueError(f"blk.{layer}.{part}: shape {tuple(value.shape)} does not hold "
                         f"{experts} experts")
    for e in range(experts):
        name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        if isinstance(value, GroupQuant):
            s = slice(e * rows, (e + 1) * rows)
            yield name, value.rows(s)
        else:
            yield name, value[e]


def moe_config(fields: dict, arch: str, shapes: dict[str, tuple[int, ...]]) -> dict:
    """The HF config fields of a GGUF with experts: the architecture, the expert count and
    how many a token takes, an expert's size and Qwen2-MoE's shared expert's (from the
    tensors' `shapes` by name: files from before llama.cpp wrote them as metadata lack
    them), whether the top-k weights are renormalised (llama.cpp's expert_weights_norm, else
    as its model code does: Qwen3-MoE and Mixtral do, Qwen2-MoE does not)."""
    hf_arch, model_type = _ARCHS[arch]
    experts, used = expert_count(fields, arch), int(fields[f"{arch}.expert_used_count"])
    gate = next((v for k, v in shapes.items() if k.endswith(".ffn_gate_exps.weight")), None)
    size = gate[1] if gate else int(fields.get(f"{arch}.expert_feed_forward_length")
                                    or fields[f"{arch}.feed_forward_length"])
    out: dict = {"architectures": [hf_arch], "model_type": model_type,
                 "num_experts_per_tok": used}
    if arch == "llama":
        return {**out, "num_local_experts": experts, "intermediate_size": size}
    norm = fields.get(f"{arch}.expert_weights_norm", arch == "qwen3moe")
    out.update(num_experts=experts, moe_intermediate_size=size, norm_topk_prob=bool(norm),
               decoder_sparse_step=1, mlp_only_layers=[])
    shexp = next((v for k, v in shapes.items() if k.endswith(".ffn_gate_shexp.weight")), None)
    shared = shexp[0] if shexp else fields.get(f"{arch}.expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def is_moe_gguf(path: Path) -> bool:
    from engine.gguf_weights import open_gguf
    file = open_gguf(path)
    return expert_count(file.fields, file.architecture) > 0


def moe_fields(path: Path) -> dict:
    """`moe_config` of the GGUF file at `path`."""
    from engine.gguf_weights import open_gguf
    file = open_gguf(path)
    return moe_config(file.fields, file.architecture, {t.name: t.shape for t in file.tensors})
