"""Loading a checkpoint into the Llama-family model (engine/llama.py's LlamaForCausalLM, which
takes these methods): HF-named tensors into the fused parameters, a GGUF file's codes kept for
the packed decode weights, a partial rotary's rows reordered, Gemma's norms folded."""
from __future__ import annotations

from typing import Iterable

import torch

from engine.model_config import matmul_rows, projection_rows
from engine.rope import rotary_order
from kernels.packed_linear import GroupQuant

# a layer's norms: over the hidden state (Gemma 3 has all four; engine/gemma.py), and over
# each q and k head (Qwen3's, Gemma 3's)
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm", "q_norm", "k_norm")


class LlamaWeights:
    """The weight loading of LlamaForCausalLM (a mixin: its parameters are the model's)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GroupQuant]],
                     decode_format: str | None = None, keep_dense: bool = True) -> None:
        """Copy HF-named tensors (model.layers.N.self_attn.q_proj.weight, ...) into the fused
        parameters; raises if a parameter was left unfilled or a name is unknown. A
        GroupQuant (a GGUF file's blocks) fills its parameter dequantized and keeps its codes
        for `pack`; an MoE expert's blocks are packed in `decode_format` as they arrive
        instead, their dense slice left unfilled (engine/moe.py `take_codes`). Any other
        matmul whose rows all come as codes is packed in `decode_format` as soon as they are
        here (their 2 bytes a weight let go; not for a partial rotary, whose rows `pack`
        reorders); without `keep_dense` its parameter is never filled and is let go (a
        model whose dense copy would not fit in memory; the tied embedding is filled, for
        the lookup)."""
        cfg = self.config
        if not keep_dense and cfg.rope_dims != cfg.head_dim:
            raise ValueError("a partial rotary reorders the dense rows: keep_dense needed")
        fused = projection_rows(cfg)
        filled: dict[int, int] = {}
        parts = _Codes(self, decode_format if cfg.rope_dims == cfg.head_dim else None,
                       keep_dense)

        def put(param: torch.Tensor | None, tensor, name: str, start=0, size=None, key=None,
                owner: torch.Tensor | None = None, packed: bool = False):
            # owner: the parameter `param` is a slice of, whose elements are counted; packed:
            # the tensor's codes are packed already and `param` stays unfilled
            if param is None:
                raise ValueError(f"checkpoint has {name} but the config says it has no such "
                                 "parameter (check attention_bias / mlp_bias)")
            dst = param if size is None else param.narrow(0, start, size)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model expects {tuple(dst.shape)}")
            if isinstance(tensor, GroupQuant) and key is not None:
                packed = parts.add(key, start, tensor) or packed
            if not packed:
                if isinstance(tensor, GroupQuant):
                    tensor = tensor.dequantize()
                with torch.no_grad():
                    dst.copy_(tensor)
            counted = id(param if owner is None else owner)
            filled[counted] = filled.get(counted, 0) + dst.numel()

        for name, tensor in weights:
            name = self._language_name(name)
            if name is None or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "model.embed_tokens.weight":
                put(self.embed_tokens, tensor, name,
                    key=(-1, "head") if self.lm_head is None else None)
            elif name == "lm_head.weight":
                if self.lm_head is not None:   # tied checkpoints may still carry a copy
                    put(self.lm_head, tensor, name, key=(-1, "head"))
            elif name == "model.norm.weight":
                put(self.norm.weight, tensor, name)
            elif name.startswith("model.layers."):
                idx, rest = name[len("model.layers."):].split(".", 1)
                layer = self.layers[int(idx)]
                module, kind = rest.rsplit(".", 1)           # e.g. self_attn.q_proj, weight
                leaf = module.split(".")[-1]
                routed = layer.routed_weight(rest)          # (an MoE layer's router, experts)
                if routed is not None:      # (a slice of `owner`; `matmul` may pack its codes)
                    dst, owner, matmul, start = routed
                    packed = isinstance(tensor, GroupQuant) and matmul is not None \
                        and layer.take_codes(matmul, start, tensor, decode_format)
                    put(dst, tensor, name, owner=owner, packed=packed)
                elif leaf in LAYER_NORMS:
                    norm = getattr(layer, leaf, None)       # (None: not this family's)
                    put(None if norm is None else norm.weight, tensor, name)
                elif leaf in fused:
                    group, start, size = fused[leaf]
                    attr = f"{group}_proj" if kind == "weight" else f"{group}_bias"
                    put(getattr(layer, attr), tensor, name, start, size,
                        key=(int(idx), group) if kind == "weight" else None)
                else:
                    raise ValueError(f"unexpected checkpoint tensor {name}")
            else:
                raise ValueError(f"unexpected checkpoint tensor {name}")
        for layer in self.layers:
            layer.finish_codes()
        missing = [n for n, p in self.named_parameters() if filled.get(id(p), 0) != p.numel()]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
        self._quant = parts.finish()
        if cfg.rope_dims != cfg.head_dim:
            self._reorder_rotary()
        if cfg.gemma:
            from engine.gemma import fold_norms
            fold_norms(self)

    def _language_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as the language model's (a vision-language checkpoint's
        `language_model.model.*` or `model.language_model.*`), or None for the parts a
        text-only serving leaves (its vision tower and projector)."""
        if not self.config.multimodal:
            return name
        for prefix in ("language_model.model.", "model.language_model."):
            if name.startswith(prefix):
                return "model." + name[len(prefix):]
        return "lm_head.weight" if name in ("language_model.lm_head.weight",
                                            "lm_head.weight") else None

    def qkv_rows(self) -> torch.Tensor | None:
        """The order of the fused q/k/v rows against the checkpoint's (a partial rotary's
        q and k heads in `rotary_order`), or None where they are as in the checkpoint."""
        cfg = self.config
        if cfg.rope_dims == cfg.head_dim:
            return None
        d, order = cfg.head_dim, rotary_order(cfg.head_dim, cfg.rope_dims)
        heads = cfg.num_attention_heads + cfg.num_key_value_heads
        return torch.cat([h * d + order for h in range(heads)]
                         + [torch.arange(heads * d, (heads + cfg.num_key_value_heads) * d)])

    def _reorder_rotary(self) -> None:
        """Put each q and k head's dims in `rotary_order` (a partial rotary served as a full
        one): the fused weight's rows, its bias, the head norms, and the file's codes."""
        cfg = self.config
        order, rows = rotary_order(cfg.head_dim, cfg.rope_dims), self.qkv_rows()
        for i, layer in enumerate(self.layers):
            with torch.no_grad():
                layer.qkv_proj.copy_(layer.qkv_proj[rows])
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(layer.qkv_bias[rows])
                for norm in (layer.q_norm, layer.k_norm):
                    if norm is not None:
                        norm.weight.copy_(norm.weight[order])
            if (i, "qkv") in self._quant:
                self._quant[(i, "qkv")] = self._quant[(i, "qkv")].rows(rows)


class _Codes:
    """A GGUF file's codes of each matmul, by (layer, matmul) key ((-1, "head"): the output
    head), as its tensors load. A fused weight keeps them only when all its parts (or the
    whole, as Phi-3's files have it) came quantized (parts of 4 and 8 bits: as 8-bit
    groups). With a `pack_format` a matmul whose rows are all here is packed at once and its
    codes let go; without `keep_dense` its dense parameter stays unfilled, and is let go."""

    def __init__(self, model, pack_format: str | None, keep_dense: bool):
        self.model, self.fmt, self.keep_dense = model, pack_format, keep_dense
        self.rows = dict(matmul_rows(model.config), head=model.config.vocab_size)
        self.parts: dict[tuple[int, str], dict[int, GroupQuant]] = {}
        self.packed: dict[tuple[int, str], object] = {}

    def add(self, key: tuple[int, str], start: int, quant: GroupQuant) -> bool:
        """Keep `quant`'s rows of `key` from `start`; True where its dense slice is left
        unfilled (the tied embedding is always filled)."""
        p = self.parts.setdefault(key, {})
        # (the file's exact values, where the groups round them, stay until the key is
        # packed: the source of any requantized form and of a partial key's dense slices)
        p[start] = quant if self.fmt is not None else quant.groups_only()
        if self.fmt is None:
            return False
        if self._complete(key, p):
            from engine.llama import packed_codes
            self.packed[key] = packed_codes(self._cat(self.parts.pop(key)), self.fmt)
        return not self.keep_dense and not self._tied(key)

    def finish(self) -> dict:
        """After loading: each key's codes (GroupQuant) or packed form (PackedWeight). Without
        a dense copy, a matmul whose rows came partly as floats gets its codes dequantized
        into its dense slices (and is packed from those), and the parameters of the others
        are let go."""
        if self.fmt is None:
            return {key: self._cat(p) for key, p in self.parts.items()
                    if self._complete(key, p)}
        if not self.keep_dense:
            for key, p in self.parts.items():
                with torch.no_grad():
                    for start, g in p.items():
                        self._param(key).narrow(0, start, g.shape[0]).copy_(g.dequantize())
            for key in self.packed:
                if not self._tied(key):
                    self._release(key)
        return self.packed

    def _complete(self, key: tuple[int, str], p: dict[int, GroupQuant]) -> bool:
        """Whether every row of `key`'s matmul came as codes."""
        return sum(g.shape[0] for g in p.values()) == self.rows[key[1]]

    def _tied(self, key: tuple[int, str]) -> bool:
        return key == (-1, "head") and self.model.lm_head is None

    @staticmethod
    def _cat(p: dict[int, GroupQuant]) -> GroupQuant:
        return GroupQuant.cat([p[s] for s in sorted(p)])

    def _param(self, key: tuple[int, str]) -> torch.Tensor:
        m = self.model
        if key[0] < 0:
            return m.embed_tokens if m.lm_head is None else m.lm_head
        return getattr(m.layers[key[0]], f"{key[1]}_proj")

    def _release(self, key: tuple[int, str]) -> None:
        """The key's (never filled) dense parameter, replaced by an empty one."""
        old = self._param(key)
        empty = torch.nn.Parameter(old.new_empty(0), requires_grad=False)
        if key[0] < 0:
            self.model.lm_head = empty
        else:
            setattr(self.model.layers[key[0]], f"{key[1]}_proj", empty)
