"""The Llama-family forward (Llama, SmolLM2/3, Qwen2, Qwen3, Mistral, Phi-3; Gemma 3 with the
layers of engine/gemma.py) over a paged KV cache.

One step runs T tokens of B sequences, flattened: every projection sees all T tokens at once
([T, hidden]); only attention knows about sequences, through the step's KV access object
(`kv.attend`), which writes the new K/V before attending, so a sequence's queries see its
cached tokens and this step's tokens alike. Weights are fused at load: q/k/v into one
`qkv_proj`, gate/up into one `gate_up_proj` (Phi-3's checkpoints come fused so). A partial
rotary's q and k rows are reordered at load (engine/rope.py `rotary_order`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.llama_weights import LlamaWeights
from engine.model_config import ModelConfig
from engine.norm import GemmaRMSNorm, RMSNorm
from engine.rope import RotaryEmbedding
from kernels import layer_ops
from kernels.decode_layer import DecodeLayers, FusedLayers, layer_words
from kernels.packed_linear import (BITS, DENSE, NATIVE, OURS, GroupQuant, Linear, PackedWeight,
                                   StagedWeight)

_WEIGHTS = ("qkv", "o", "gate_up", "down")      # a layer's matmuls: <name>_proj, <name>_bias


def empty_param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    # NOTE: uninitialised on purpose: load_weights fills every parameter (and checks it did).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = cfg.attention_scale
        p = dict(dtype=dtype, device=device)
        norm = GemmaRMSNorm if cfg.gemma else RMSNorm
        self.input_layernorm = norm(h, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = norm(h, cfg.rms_norm_eps, dtype, device)
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_proj = empty_param(qkv, h, **p)                            # [q|k|v, hidden]
        self.qkv_bias = empty_param(qkv, **p) if cfg.attention_bias else None
        self.o_proj = empty_param(h, self.q_size, **p)
        self.o_bias = empty_param(h, **p) if cfg.o_proj_bias else None
        self._mlp_params(cfg, p)
        # Qwen3: each q and k head RMS-normed (over head_dim) before RoPE
        self.q_norm = norm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = norm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.rope = index not in cfg.nope_layers        # SmolLM3: some layers have no RoPE
        self.pack({}, None, 0)

    MATMULS = _WEIGHTS          # the layer's matmuls `pack` builds (an MoE layer's differ)

    def _mlp_params(self, cfg: ModelConfig, p: dict) -> None:
        """The MLP's parameters (engine/moe.py's layer has experts instead)."""
        h = cfg.hidden_size
        inter = cfg.intermediate_size
        self.gate_up_proj = empty_param(2 * inter, h, **p)                  # [gate|up, hidden]
        self.gate_up_bias = empty_param(2 * inter, **p) if cfg.mlp_bias else None
        self.down_proj = empty_param(h, inter, **p)
        self.down_bias = empty_param(h, **p) if cfg.mlp_bias else None

    def pack(self, quant: dict[str, GroupQuant], fmt: str | None, prefill_rows: int) -> None:
        """Build the layer's matmuls: each weight in `fmt` for steps of fewer than
        `prefill_rows` rows (from the file's own codes where `quant` has them), and as the
        dense parameter for longer steps (fmt None: the dense parameter only)."""
        for name in self.MATMULS:
            setattr(self, name, make_linear(getattr(self, f"{name}_proj"),
                                            getattr(self, f"{name}_bias"), quant.get(name),
                                            fmt, prefill_rows))

    def routed_weight(self, name: str) -> tuple[torch.Tensor, nn.Parameter, str | None, int
                                                ] | None:
        """Where an MoE layer's checkpoint tensor `name` (past `model.layers.N.`) lands: the
        slice of a parameter, the parameter, the matmul that keeps a GGUF file's codes of it
        (None: none does) and its first row there (engine/moe.py); None here."""
        return None

    def take_codes(self, matmul: str, start: int, codes: GroupQuant,
                   decode_format: str | None) -> bool:
        """Whether the layer packs a file's codes of `matmul`'s rows from `start` itself, as
        they load (an MoE layer's experts: engine/moe.py); not here."""
        return False

    def finish_codes(self) -> None:
        """After loading (an MoE layer completes what `take_codes` kept); nothing here."""

    def decode_norms(self) -> tuple[torch.Tensor | None, ...]:
        """The norm weights in float32 for the C decode layers (kernels/decode_layer.py):
        input, post-attention, and Qwen3's q and k head norms (None without)."""
        return (self.input_layernorm.float32().weight,
                self.post_attention_layernorm.float32().weight,
                *(None if n is None else n.float32().weight for n in (self.q_norm, self.k_norm)))

    def predict_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """This layer's queries [n, H, D] computed from x [n, hidden] (another layer's input:
        the layer-ahead guess of which KV pages this layer will want)."""
        q = self.qkv(self.input_layernorm(x))[:, :self.q_size]
        q = self._head_norm(self.q_norm, q.reshape(x.shape[0], self.num_heads, self.head_dim))
        return RotaryEmbedding.apply(q, cos, sin) if self.rope else q

    def _norm_heads_(self, qkv: torch.Tensor, t: int) -> None:
        """Each q and k head of qkv [T, q+2kv] RMS-normed in place (the C norm, as
        kernels/_layer.c does it)."""
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
        q.copy_(self._head_norm(self.q_norm, q.reshape(t, self.num_heads, -1)).view(t, -1))
        k.copy_(self._head_norm(self.k_norm, k.reshape(t, self.num_kv_heads, -1)).view(t, -1))

    @staticmethod
    def _head_norm(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
        """x [n, heads, D] with each head RMS-normed (Qwen3's q_norm / k_norm), or x."""
        if norm is None:
            return x
        n, heads, d = x.shape
        return norm(x.reshape(n * heads, d)).view(n, heads, d)

    def kv_from_inputs(self, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (with RoPE) and V [n, KVH, D] of tokens whose normed inputs are xn [n, hidden]
        (KV recompute, kvstore/recompute.py): the k|v rows of the dense fused weight."""
        if self.qkv_proj.numel():
            w = self.qkv_proj[self.q_size:]
            b = None if self.qkv_bias is None else self.qkv_bias[self.q_size:]
            kv = F.linear(xn.to(w.dtype), w, b)
        else:                                   # (packed only: q computed and dropped)
            kv = self.qkv(xn)[:, self.q_size:]
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        n = xn.shape[0]
        k = self._head_norm(self.k_norm, k.reshape(n, self.num_kv_heads, self.head_dim))
        if self.rope:
            k = RotaryEmbedding.apply(k, cos, sin)
        return k, v.reshape(n, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv,
                lora=None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; rope = (cos, sin) [T, 1, head_dim] of the step;
        lora: the step's adapter rows (engine/lora.py LoraBatch), each matmul's delta added."""
        native = layer_ops.supports(x)      # the small ops in C (kernels/layer_ops.py)
        h = self.attention(self.input_layernorm(x), rope, kv, lora, native)
        norm = self.post_attention_layernorm
        if native:          # h += x (the residual stream, in the new tensor), and its norm
            normed = layer_ops.rms_norm(h, norm.weight, norm.eps, residual=x)
        else:
            h = x + h
            normed = norm(h)
        return h + self.mlp(normed, lora, native)

    def attention(self, xn: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv,
                  lora, native: bool) -> torch.Tensor:
        """The attention block's output [T, hidden] (o_proj's) of the normed inputs xn."""
        t, d = xn.shape[0], self.head_dim
        qkv = self.qkv(xn)                                                   # [T, q+2kv]
        if lora is not None:
            qkv = lora.apply(self.index, "qkv", xn, qkv)
        cos, sin = rope
        if native:          # q and k heads (normed, Qwen3) rotated in place in qkv
            if self.q_norm is not None:
                self._norm_heads_(qkv, t)
            if self.rope:
                layer_ops.rope_(qkv, self.num_heads + self.num_kv_heads, d, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), \
            v.view(t, self.num_kv_heads, d)
        if not native:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
            if self.rope:
                q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        if getattr(kv, "keeps_inputs", False):     # KV recompute stores the layer's inputs
            o = kv.attend(self.index, q, k, v, self.scale, inputs=xn)
        else:
            o = kv.attend(self.index, q, k, v, self.scale)                   # [T, H, D]
        o = o.reshape(t, self.q_size)
        return self.o(o) if lora is None else lora.apply(self.index, "o", o, self.o(o))

    def mlp(self, normed: torch.Tensor, lora, native: bool) -> torch.Tensor:
        """The MLP's output [T, hidden] of its normed inputs (SiLU-gated)."""
        gate_up = self.gate_up(normed)
        if lora is not None:
            gate_up = lora.apply(self.index, "gate_up", normed, gate_up)
        act = silu_mul(gate_up, native)
        return self.down(act) if lora is None else lora.apply(self.index, "down", act,
                                                               self.down(act))


def silu_mul(gate_up: torch.Tensor, native: bool) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] = [gate | up] (the C op where `native` allows)."""
    act = layer_ops.silu_mul(gate_up) if native else None       # (float32 only)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return act


def coded_linear(quant: GroupQuant, fmt: str) -> Linear:
    """A Linear of a file's codes alone, in decode format `fmt` for steps of any rows (no
    dense form)."""
    return Linear(packed_codes(quant, fmt))


def packed_codes(quant: GroupQuant, fmt: str) -> PackedWeight:
    """A file's codes in decode format `fmt`: at their own width where `fmt` is "native" /
    "native-torch" or that width, else requantized."""
    if fmt in NATIVE:
        fmt = NATIVE[fmt][quant.bits]
    return _packed(quant, fmt, quant.dequantize)


def _packed(quant: GroupQuant | None, fmt: str, dense) -> PackedWeight:
    """`fmt`'s form: from the file's codes where they have its width, else from the dense
    values `dense()`."""
    if quant is not None and BITS.get(fmt) == quant.bits:
        return PackedWeight.from_quant(quant, fmt)
    return PackedWeight.from_dense(dense(), fmt)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                quant: GroupQuant | PackedWeight | None, fmt: str | None,
                prefill_rows: int, stage: bool = True) -> Linear:
    """A Linear over the dense parameter `weight`, plus a `fmt` form for short steps (packed
    from the file's codes `quant` when given, else from the dense values; `quant` may be
    that form already, packed as the file loaded). fmt "native": the file's codes at their
    own width in our kernels' formats (4 bits: q4, 8: q8), "native-torch" in torch's (int4,
    int8); float tensors dense. An empty `weight` (no dense copy): the packed form, and for
    long steps that form dequantized to the weight's dtype when it runs (where it is our
    kernel's and `stage`; a StagedWeight)."""
    dtype = next(k for k, v in DENSE.items() if v == weight.dtype)
    dense = None if not weight.numel() else PackedWeight(dtype, tuple(weight.shape),
                                                         (weight.detach(),))
    if isinstance(quant, PackedWeight):
        if dense is None and stage and quant.fmt in OURS:
            dense = StagedWeight(quant, dtype)
        return Linear(quant, bias, prefill=dense, prefill_rows=prefill_rows)
    if fmt in NATIVE:
        fmt = None if quant is None else NATIVE[fmt][quant.bits]
    if fmt is None or fmt == dense.fmt:
        return Linear(dense, bias)
    return Linear(_packed(quant, fmt, weight.detach), bias, prefill=dense,
                  prefill_rows=prefill_rows)


def _layer_class(cfg: ModelConfig, index: int) -> type[DecoderLayer]:
    """Layer `index`'s class: Gemma's block, an MoE model's routed layer, or Llama's."""
    if cfg.gemma:
        from engine.gemma import GemmaDecoderLayer
        return GemmaDecoderLayer
    if cfg.moe is not None and cfg.moe.routed(index):
        from engine.moe import MoeDecoderLayer
        return MoeDecoderLayer
    return DecoderLayer


class LlamaForCausalLM(LlamaWeights, nn.Module):
    """Our Llama-family model. Build with `engine.model_loader.load_model`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", max_model_len: int | None = None):
        super().__init__()
        max_len = max_model_len or config.served_positions
        self.config = config
        self.dtype = dtype
        self.max_model_len = max_len
        p = dict(dtype=dtype, device=device)
        self.embed_tokens = empty_param(config.vocab_size, config.hidden_size, **p)
        self.layers = nn.ModuleList(_layer_class(config, i)(config, i, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = (GemmaRMSNorm if config.gemma else RMSNorm)(
            config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (None if config.tie_word_embeddings
                        else empty_param(config.vocab_size, config.hidden_size, **p))
        self.rope = RotaryEmbedding(config.head_dim, max_len, config.rope_theta,
                                    config.rope_scaling, config.max_position_embeddings,
                                    config.rope_dims).to(device)
        # Gemma 3: the windowed layers' RoPE (its own base, no scaling)
        self.rope_local = None if config.local_rope_theta is None else RotaryEmbedding(
            config.head_dim, max_len, config.local_rope_theta, None,
            config.max_position_embeddings, config.rope_dims).to(device)
        self.local_layers = frozenset() if self.rope_local is None else frozenset(
            i for i, w in enumerate(config.layer_windows) if w is not None)
        self._quant: dict[tuple[int, str], GroupQuant] = {}    # the file's codes, by layer
        self.pack(None)

    def pack(self, fmt: str | None, prefill_rows: int = 0) -> None:
        """Give every matmul a `fmt` form for steps of fewer than `prefill_rows` rows (decode),
        keeping the dense parameters for longer steps (None: dense only). Quantized weights
        that load_weights received (GGUF blocks) are packed from their own codes, which are
        then let go, whatever `fmt` (2 bytes a weight; a later `pack` quantizes the dense
        values)."""
        for i, layer in enumerate(self.layers):
            layer.pack({name: q for (j, name), q in self._quant.items() if j == i}, fmt,
                       prefill_rows)
        self._decode_words = None       # kernels/decode_layer.py's view of them, when asked
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        # (no staged head: a step's logits rows are few, but prompt logprobs would stage
        # the whole vocabulary's weight)
        self.head = make_linear(head, None, self._quant.get((-1, "head")), fmt, prefill_rows,
                                stage=False)
        self._quant = {}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv,
                logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None,
                lora=None):
        """input_ids [T] int64, positions [T] int64 -> logits [S, vocab] float32 for the rows
        `logits_indices` [S] int64 (the last token of each sequence that samples).
        kv: the step's KV access (`attend(layer, q, k, v, scale) -> o`): writes this step's
        K/V and attends (kvstore.step.StepKV, or tests/kv_cache.py's DenseStep).
        hidden_indices: also return the normed final hidden states [H, hidden] of these rows
        (prompt logprobs: `self.head` runs on them in blocks, not all at once).
        lora: the step's adapter rows (engine/lora.py; None: the base model alone)."""
        x = F.embedding(input_ids, self.embed_tokens)                        # [T, hidden]
        if self.config.gemma:           # times sqrt(hidden), in the model's dtype
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        rope = self.rope.cos_sin(positions, self.dtype)                      # [T, 1, head_dim]
        ropes = {False: rope, True: None if self.rope_local is None
                 else self.rope_local.cos_sin(positions, self.dtype)}
        # layer-ahead prefetch: the KV store wants layer i+1's queries guessed from layer i's
        # input, for the rows it decodes sparsely (None: no prediction)
        ahead = getattr(kv, "lookahead_rows", None)
        if ahead is not None:
            ahead_ropes = {k: None if r is None else (r[0][ahead], r[1][ahead])
                           for k, r in ropes.items()}
        layers = None if ahead is not None else self._decode_layers(x, positions, rope, kv,
                                                                    lora)
        norm = self.norm
        if layers is not None:          # float32 rows (a copy where the model's dtype is not)
            x, norm = layers.x, self.norm.float32()
        for i, layer in enumerate(self.layers):
            if layers is not None:      # the layer in C, x updated in place
                layers.run(i, layer.input_layernorm.eps, layer.scale)
                continue
            if ahead is not None and i + 1 < len(self.layers):
                kv.lookahead(i + 1, self.layers[i + 1].predict_q(
                    x[ahead], *ahead_ropes[i + 1 in self.local_layers]))
            x = layer(x, ropes[i in self.local_layers], kv, lora)
        logits = (self.logits(norm(x[logits_indices]))                       # [S, vocab]
                  if logits_indices.numel() else x.new_zeros(0, self.config.vocab_size,
                                                             dtype=torch.float32))
        if hidden_indices is None:
            return logits
        return logits, norm(x[hidden_indices])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] of normed final hidden states [n, hidden] (soft-capped
        where the config says: cap * tanh(logits / cap))."""
        logits = self.head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def _decode_layers(self, x: torch.Tensor, positions: torch.Tensor, rope, kv,
                       lora=None) -> DecodeLayers | None:
        """The step's layers as C calls (kernels/decode_layer.py), where the KV store, the
        weights and the step's LoRA adapters (engine/lora.py LoraBatch) allow it (else None:
        op by op). They run float32 rows: a bf16 model's (bf16 activations for prefill, on a
        CPU with AVX512_BF16) are copied to float32, with float32 RoPE and norms."""
        table = getattr(kv, "layer_table", None)
        if table is None or not FusedLayers.enabled or self.config.gemma \
                or self.config.moe or getattr(kv, "keeps_inputs", False):   # (Llama's block)
            return None
        if self._decode_words is None:      # the layers' decode weights, once (`pack` resets)
            self._decode_words = (layer_words(self.layers),)
        if self._decode_words[0] is None:
            return None
        lora_words = None if lora is None else lora.native()     # (made once an adapter runs)
        if lora is not None and lora_words is None:
            return None
        cfg = self.config
        kv_table = table(cfg.num_attention_heads // cfg.num_key_value_heads)
        if kv_table is None or x.shape[0] >= self._decode_words[0][1]:
            return None                 # (before a bf16 prefill chunk is copied for nothing)
        if x.dtype != torch.float32:
            x, rope = x.float(), self.rope.cos_sin(positions, torch.float32)
        return DecodeLayers.build(self._decode_words[0], x, rope, kv_table,
                                  (cfg.hidden_size, cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.intermediate_size), lora_words)

    @torch.inference_mode()
    def kv_from_inputs(self, layer: int, xn: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K, V [n, KVH, D] of tokens at `positions` [n] from their normed
        inputs xn [n, hidden] (what the KV store's recompute calls)."""
        rope = self.rope_local if layer in self.local_layers else self.rope
        cos, sin = rope.cos_sin(positions.to(rope.cos.device), self.dtype)
        return self.layers[layer].kv_from_inputs(xn, cos, sin)
