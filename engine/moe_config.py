"""What a mixture-of-experts checkpoint's config.json says about its experts (Qwen3-MoE,
Qwen2-MoE / Qwen1.5-MoE, Mixtral), as transformers 4 and 5 write it.

An MoE model is its dense family's (Qwen3's attention with q/k head norms, Qwen2's q/k/v
biases, Mistral's) with the MLP of some layers replaced by a routed block (engine/moe.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# an MoE architecture -> the dense family whose attention and config fields it shares
MOE_BASE = {"Qwen3MoeForCausalLM": "Qwen3ForCausalLM", "Qwen2MoeForCausalLM": "Qwen2ForCausalLM",
            "MixtralForCausalLM": "MistralForCausalLM"}
MOE_MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                   "mixtral": "MixtralForCausalLM"}


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int                      # experts each token is routed to
    expert_size: int                # an expert's intermediate size
    norm_topk_prob: bool            # the top-k probabilities renormalised to sum to 1
    shared_size: int                # Qwen2-MoE's shared expert (sigmoid-gated); 0: none
    layers: tuple[int, ...]         # the layers whose MLP is routed (the others are dense)
    round_weights: bool = True      # the top-k weights rounded to the activations' dtype
                                    # before they scale the experts (Qwen's; Mixtral's stay
                                    # float32)

    def routed(self, layer: int) -> bool:
        return layer in self.layers


def parse_moe(cfg: Mapping[str, Any], arch: str) -> MoeSpec | None:
    """The experts of an MoE architecture's config (None for a dense one). Qwen's configs
    name the expert count num_experts (transformers 5 writes Qwen3-MoE's as
    num_local_experts, Mixtral's name), give the experts their own moe_intermediate_size, and
    route every `decoder_sparse_step`-th layer not in `mlp_only_layers`; Mixtral routes every
    layer, always renormalising its top-k."""
    if arch not in MOE_BASE:
        return None
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok {top_k} must be in 1..{experts} "
                         "(the config's expert count)")
    if arch == "MixtralForCausalLM":
        return MoeSpec(experts, top_k, int(cfg["intermediate_size"]), True, 0,
                       tuple(range(layers)), round_weights=False)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    routed = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) \
        if arch == "Qwen2MoeForCausalLM" else 0
    return MoeSpec(experts, top_k, int(cfg.get("moe_intermediate_size")
                                       or cfg["intermediate_size"]),
                   bool(cfg.get("norm_topk_prob", False)), shared, routed)
