"""What the engine needs to know about a Llama-family checkpoint, read from its HF config.json."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from engine.moe_config import MOE_BASE, MOE_MODEL_TYPES, MoeSpec, parse_moe

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM", "SmolLM3ForCausalLM", "Phi3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", *MOE_BASE)
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                       "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                       "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
                       "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                       **MOE_MODEL_TYPES}
# Gemma3TextConfig's defaults, which transformers leaves out of a config.json it writes
_GEMMA3_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh",
                    "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
                    "eos_token_id": 1, "bos_token_id": 2}
# Gemma2Config's (a transformers 4 checkpoint's config.json lists no layer_types)
_GEMMA2_DEFAULTS = {**_GEMMA3_DEFAULTS, "vocab_size": 256000, "max_position_embeddings": 8192,
                    "rope_theta": 10000.0, "final_logit_softcapping": 30.0,
                    "attn_logit_softcapping": 50.0}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                     # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None   # HF dict with "rope_type" (no rope_theta); None = default
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool                  # bias on q/k/v projections
    o_proj_bias: bool                     # bias on o_proj (Llama's attention_bias covers it too)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None            # None when absent or disabled
    dtype: str | None = None              # checkpoint dtype ("bfloat16", ...) if recorded
    qk_norm: bool = False                 # RMSNorm on each q and k head before RoPE (Qwen3)
    nope_layers: tuple[int, ...] = ()     # layers without RoPE (SmolLM3's NoPE layers)
    rotary_dim: int = 0                   # leading dims of a head that RoPE rotates (Phi-4's
                                          # partial rotary); 0: all of head_dim
    sliding_layers: tuple[int, ...] | None = None   # the layers sliding_window applies to
                                                    # (None: every layer)
    # Gemma 3's block (engine/gemma.py): norms of weight 1 + w, the attention's and the MLP's
    # outputs normed before their residual adds, embeddings times sqrt(hidden), GELU (tanh)
    gemma: bool = False
    query_pre_attn_scalar: float | None = None   # attention scale its ** -0.5 (None: head_dim)
    local_rope_theta: float | None = None   # the windowed layers' RoPE base (default type);
                                            # None: theirs is the others'
    final_logit_softcapping: float | None = None    # logits = cap * tanh(logits / cap)
    # Gemma 2's: every attention score so (kernels/window_attention.py attends them all)
    attn_logit_softcapping: float | None = None
    # a vision-language checkpoint (Gemma 3 4B and larger) served text-only: its language
    # model's weights are read, the vision tower's and projector's left (llama_weights.py)
    multimodal: bool = False
    moe: MoeSpec | None = None          # the routed experts of an MoE model (engine/moe.py)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window: the keys a query at position p attends to are those in
        (p - window, p] (None: the whole context)."""
        layers = range(self.num_hidden_layers)
        if self.sliding_layers is None:
            return tuple(self.sliding_window for _ in layers)
        return tuple(self.sliding_window if i in self.sliding_layers else None for i in layers)

    @property
    def rope_dims(self) -> int:
        """The dims of a head RoPE rotates (head_dim unless the rotary is partial)."""
        return self.rotary_dim or self.head_dim

    @property
    def positions(self) -> int:
        """The longest sequence the model's RoPE serves: max_position_embeddings, scaled by a
        linear, dynamic or YaRN rope_scaling's factor as vLLM scales it (YaRN: the original
        positions times the factor; LongRoPE and Llama 3 configs give the scaled length)."""
        s = self.rope_scaling or {}
        if self.gemma or s.get("rope_type") not in ("linear", "dynamic", "yarn") \
                or not s.get("factor"):     # (Gemma 3's positions are the scaled ones)
            return self.max_position_embeddings
        base = self.max_position_embeddings
        if s["rope_type"] == "yarn":
            base = s.get("original_max_position_embeddings") or base
        return max(self.max_position_embeddings, int(base * float(s["factor"])))

    @property
    def served_positions(self) -> int:
        """The default served length: the model's positions. Dynamic NTK serves
        max_position_embeddings unless a longer --max-model-len asks (engine/rope.py fixes its
        base at the served length, which equals transformers' only up to
        max_position_embeddings)."""
        dynamic = (self.rope_scaling or {}).get("rope_type") == "dynamic"
        return self.max_position_embeddings if dynamic else self.positions

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any],
                overrides: Mapping[str, Any] | None = None) -> "ModelConfig":
        """From an HF model folder (config.json, plus generation_config.json when present for
        extra eos ids) or an already-parsed config dict; `overrides` (--hf-overrides) replace
        its keys."""
        gen: Mapping[str, Any] = {}
        if isinstance(path_or_dict, Mapping):
            cfg = dict(path_or_dict)
        else:
            folder = Path(path_or_dict)
            cfg = json.loads((folder / "config.json").read_text())
            gen_file = folder / "generation_config.json"
            if gen_file.is_file():
                gen = json.loads(gen_file.read_text())
        cfg, multimodal = _language_model(cfg)
        parsed = cls._parse(_overridden(cfg, overrides or {}), gen)
        return dataclasses.replace(parsed, multimodal=True) if multimodal else parsed

    @classmethod
    def _parse(cls, cfg: Mapping[str, Any], gen: Mapping[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(cfg.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch or cfg.get('model_type')!r}: "
                             f"Strata runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch == "Gemma3ForCausalLM":
            return cls._parse_gemma3({**_GEMMA3_DEFAULTS, **cfg}, gen)
        if arch == "Gemma2ForCausalLM":
            return cls._parse_gemma2({**_GEMMA2_DEFAULTS, **cfg}, gen)
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        is_phi3 = arch == "Phi3ForCausalLM"
        rope_theta, rope_scaling = _rope(cfg, is_phi3)
        family = MOE_BASE.get(arch, arch)       # (an MoE model's attention is its family's)
        is_qwen2, is_qwen3 = family == "Qwen2ForCausalLM", family == "Qwen3ForCausalLM"
        is_mistral = family == "MistralForCausalLM"
        attention_bias = True if is_qwen2 else (False if is_mistral
                                                else bool(cfg.get("attention_bias", False)))
        llama_like = arch in ("LlamaForCausalLM", "SmolLM3ForCausalLM")
        o_bias = attention_bias if llama_like or is_qwen3 else False
        mlp_bias = bool(cfg.get("mlp_bias", False)) if llama_like else False
        rotary_dim = _rotary_dim(cfg, head_dim, is_phi3)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            eos_token_ids=_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
            sliding_window=_sliding_window(cfg, is_qwen2 or is_qwen3, is_mistral or is_phi3),
            sliding_layers=_sliding_layers(cfg, is_qwen2 or is_qwen3,
                                           _nope_layers(cfg) if arch == "SmolLM3ForCausalLM"
                                           else None),
            dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            qk_norm=is_qwen3,
            nope_layers=_nope_layers(cfg) if arch == "SmolLM3ForCausalLM" else (),
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            moe=parse_moe(cfg, arch))

    @classmethod
    def _parse_gemma3(cls, cfg: Mapping[str, Any], gen: Mapping[str, Any]) -> "ModelConfig":
        """Gemma 3's text model: the Llama fields plus its block, windowed layers every
        `sliding_window_pattern` but the last of each (or its `layer_types`), and a RoPE per
        layer type (transformers 5 keeps them in rope_parameters by type)."""
        if cfg.get("attn_logit_softcapping") or cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 configs with attn_logit_softcapping or bidirectional "
                             "attention are not supported")
        _check_gemma(cfg, "Gemma 3")
        layers = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if not types:
            every = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention"
                     for i in range(layers)]
        params = cfg.get("rope_parameters") or {}
        full, local = params.get("full_attention"), params.get("sliding_attention")
        if full is not None:                # transformers 5: by layer type
            cfg = {**cfg, "rope_parameters": full}
        theta, scaling = _rope(cfg, False)
        local_theta = float((local or {}).get("rope_theta", cfg["rope_local_base_freq"]))
        if (local or {}).get("rope_type", "default") != "default":
            raise ValueError("Gemma 3's windowed layers take the default RoPE")
        llama = cls._parse({**cfg, "architectures": ["LlamaForCausalLM"], "layer_types": types,
                            "rope_theta": theta, "rope_scaling": scaling,
                            "rope_parameters": None}, gen)
        return dataclasses.replace(
            llama, architecture="Gemma3ForCausalLM", gemma=True, qk_norm=True,
            sliding_window=int(cfg["sliding_window"]),     # (the layers: `types`)
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
            local_rope_theta=local_theta,
            final_logit_softcapping=cfg.get("final_logit_softcapping"))


    @classmethod
    def _parse_gemma2(cls, cfg: Mapping[str, Any], gen: Mapping[str, Any]) -> "ModelConfig":
        """Gemma 2: Gemma 3's block without the q/k head norms, every other layer windowed
        (the first of each pair), one RoPE, and every attention score soft-capped."""
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma 2 configs with bidirectional attention are not supported")
        _check_gemma(cfg, "Gemma 2")
        types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention"
            for i in range(int(cfg["num_hidden_layers"]))]
        llama = cls._parse({**cfg, "architectures": ["LlamaForCausalLM"], "layer_types": types},
                           gen)
        return dataclasses.replace(
            llama, architecture="Gemma2ForCausalLM", gemma=True,
            sliding_window=int(cfg["sliding_window"]),
            query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"))


def _check_gemma(cfg: Mapping[str, Any], name: str) -> None:
    if cfg.get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{name} activation {cfg.get('hidden_activation')!r}: "
                         "Strata runs gelu_pytorch_tanh")


def rope_identity(cfg: ModelConfig, overrides: Mapping[str, Any], served_len: int) -> str:
    """What rotates a layer's keys beyond the model's files ("" when nothing does): the
    --hf-overrides, and the served length where the RoPE depends on it (dynamic NTK,
    LongRoPE's short or long factors). Names the prefix cache's pages and the low-rank
    projection fitted on those keys."""
    ident = json.dumps(dict(overrides), sort_keys=True) if overrides else ""
    if (cfg.rope_scaling or {}).get("rope_type") in ("dynamic", "longrope"):
        ident += f"|positions {served_len}"
    return ident


def projection_rows(cfg: ModelConfig) -> dict[str, tuple[str, int, int | None]]:
    """Each checkpoint projection -> (the layer's matmul it lands in, its first output row
    there, its rows; None: all of them): q/k/v fuse into qkv, gate/up into gate_up (Phi-3's
    checkpoints come fused)."""
    q, kv, inter = (cfg.num_attention_heads * cfg.head_dim,
                    cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    return {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, kv), "v_proj": ("qkv", q + kv, kv),
            "qkv_proj": ("qkv", 0, None), "o_proj": ("o", 0, None),
            "gate_proj": ("gate_up", 0, inter), "up_proj": ("gate_up", inter, inter),
            "gate_up_proj": ("gate_up", 0, None), "down_proj": ("down", 0, None)}


def matmul_rows(cfg: ModelConfig) -> dict[str, int]:
    """Output rows of each of a layer's matmuls."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv": q + 2 * kv, "o": cfg.hidden_size, "gate_up": 2 * cfg.intermediate_size,
            "down": cfg.hidden_size}


def _overridden(cfg: dict, overrides: Mapping[str, Any]) -> dict:
    """`cfg` with `overrides`' keys in place of its own. A transformers 5 config keeps RoPE
    in rope_parameters, which `_rope` reads before the top-level keys: an overridden
    rope_theta goes there too, and an overridden rope_scaling is read instead of it (a
    rope_parameters override, over a transformers 4 rope_scaling)."""
    cfg = {**cfg, **overrides}
    params = cfg.get("rope_parameters")
    if "rope_theta" in overrides and isinstance(params, dict):
        if "full_attention" in params:      # Gemma 3's, by layer type: the global layers'
            params = {**params, "full_attention": {**params["full_attention"],
                                                   "rope_theta": overrides["rope_theta"]}}
            cfg["rope_parameters"] = params
        else:
            cfg["rope_parameters"] = {**params, "rope_theta": overrides["rope_theta"]}
    if "rope_parameters" in overrides and "rope_scaling" not in overrides:
        cfg.pop("rope_scaling", None)
    return cfg


def _rope(cfg: Mapping[str, Any], is_phi3: bool) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from `rope_scaling` (transformers 4) or
    `rope_parameters` (transformers 5, which also carries rope_theta). Phi-3's configs name
    LongRoPE "su" or "yarn" (transformers reads both as longrope) and keep
    original_max_position_embeddings beside it."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)       # ModelConfig.rotary_dim
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("type", None)
    if scaling.get("rope_type") in (None, "default"):
        return theta, None
    if is_phi3 and scaling["rope_type"] in ("su", "yarn") and "long_factor" in scaling:
        scaling["rope_type"] = "longrope"       # (a YaRN of --hf-overrides stays YaRN)
    if scaling["rope_type"] == "longrope" and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = int(cfg["original_max_position_embeddings"])
    return theta, scaling


def _rotary_dim(cfg: Mapping[str, Any], head_dim: int, is_phi3: bool) -> int:
    """The dims of a head RoPE rotates: partial_rotary_factor x head_dim (Phi-4-mini: 0.75),
    read where transformers 4 (top level) or 5 (rope_parameters) writes it; only Phi-3's
    modelling rotates part of a head."""
    factor = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                   or cfg.get("partial_rotary_factor") or 1.0)
    if factor == 1.0:
        return head_dim
    dim = int(head_dim * factor)
    if not is_phi3 or not 0 < dim < head_dim or dim % 2 or (head_dim - dim) % 2:
        raise ValueError(f"partial_rotary_factor {factor} is supported for Phi-3-family models "
                         f"with an even rotary and pass-through part of head_dim {head_dim}")
    return dim


def _ids(*values: Any) -> tuple[int, ...]:
    flat = [int(i) for v in values for i in ([v] if isinstance(v, int) else list(v or []))]
    return tuple(dict.fromkeys(flat))           # (each once, in order)


def _nope_layers(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers` lists 1 (RoPE) or 0 (none) per layer;
    absent, every `no_rope_layer_interval`-th layer (4th) has none."""
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    return tuple(i for i, rope in enumerate(flags) if not rope)


def _language_model(cfg: dict) -> tuple[dict, bool]:
    """A vision-language checkpoint's language model config (Gemma 3 4B and larger: its
    text_config, with the top level's token ids), and whether it was one; other configs as
    they are. --hf-overrides then apply to the language model."""
    if (cfg.get("architectures") or [None])[0] != "Gemma3ForConditionalGeneration":
        return cfg, False
    text = {k: cfg[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings")
            if k in cfg}
    text.update(cfg.get("text_config") or {}, architectures=["Gemma3ForCausalLM"])
    return text, True


def _sliding_layers(cfg: Mapping[str, Any], is_qwen: bool,
                    nope: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The layers the sliding window applies to, as transformers reads them: the config's
    `layer_types` where it lists them; else SmolLM3's layers without RoPE (`nope`), Qwen's
    from max_window_layers on, or every layer."""
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types:
        return tuple(i for i, t in enumerate(types[:layers]) if t == "sliding_attention")
    if nope is not None:
        return nope
    if is_qwen:
        return tuple(range(int(cfg.get("max_window_layers", 28)), layers))
    return None


def _sliding_window(cfg: Mapping[str, Any], is_qwen: bool, always: bool) -> int | None:
    """The attention window, where the architecture applies it: Mistral and Phi-3 whenever
    the config sets one, Qwen and SmolLM3 only when they enable it."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if always:
        return int(window)
    if (is_qwen or cfg.get("model_type") == "smollm3") and (cfg.get("use_sliding_window")
                     or "sliding_attention" in (cfg.get("layer_types") or [])):
        return int(window)
    return None
