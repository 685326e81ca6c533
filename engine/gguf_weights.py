"""A GGUF file's tensors under their Hugging Face names, quantized tensors as they are stored.

`iter_gguf_weights` yields (HF name, tensor) pairs for LlamaForCausalLM.load_weights: float
tensors (F32, F16, BF16) as torch tensors, and the quantized types our kernels run (Q3_K to
Q8_0, the K types, IQ4_NL / IQ4_XS) as GroupQuant (their codes, and per group of 32 a scale
and a zero point: engine/gguf_blocks.py), so that the model can run them through packed 4- /
8-bit matmuls without dequantizing. Other quantized types (Q2_K, the 1-3-bit IQ types) are
dequantized to float32 by the `gguf` package.

llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs
neighbouring dims; HF's pairs halves); the permutation is undone here, on whole rows, so
codes and block scales move with their rows. Phi-3's fused q/k/v (`attn_qkv`) and gate/up
(`ffn_up`) load whole; its LongRoPE factors are tensors and its rotary dims and pretraining
length metadata, which transformers' GGUF reader drops: `phi3_config` gives them back as HF
config fields. An MoE file's 3-D expert tensors are split by expert (engine/gguf_moe.py).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.gguf_moe import EXPERT_PARTS, MOE_NAMES, expert_count, split_experts
from engine.model_config import ModelConfig
from engine.gguf_blocks import BITS as BLOCK_BITS, decode
from kernels.packed_linear import GroupQuant

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
}
# Gemma 3's four norms a layer (llama.cpp's ffn_norm is its MLP's input norm)
GEMMA_ARCHS = ("gemma2", "gemma3")
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# float tensors as numpy views (BF16 as its raw 16 bits, widened on read)
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: str                   # GGML type name: F32, Q4_1, ...
    shape: tuple[int, ...]      # numpy order (rows first): [N, K] for a matrix
    data: np.ndarray            # the file's bytes as a view: [N, K / block * block bytes] uint8
                                # for block types, the values for float types


class GGUFFile:
    """The header and tensors of a GGUF file (v2/v3), the tensors as views of one memory map.

    NOTE: gguf's GGUFReader parses every metadata value into numpy views, ~5 s for the
    bundled file's 49K-token vocabulary (read three times it made a server start 20 s); the
    weights need two metadata values, so the rest is skipped over."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, path: Path):
        import struct
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        self._buf = buf = np.memmap(path, dtype=np.uint8, mode="r")
        raw = memoryview(buf)
        if bytes(raw[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        self._raw, self._pos, self.fields = raw, 24, {}
        for _ in range(n_kv):
            key = self._string()
            value = self._value(struct.unpack_from("<I", raw, self._take(4))[0])
            if value is not None:                        # scalars and strings, no arrays
                self.fields[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = struct.unpack_from("<I", raw, self._take(4))[0]
            dims = struct.unpack_from(f"<{n_dims}Q", raw, self._take(8 * n_dims))
            kind, offset = struct.unpack_from("<IQ", raw, self._take(12))
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = []
        for name, dims, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            shape = tuple(int(d) for d in reversed(dims))
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = rows * shape[-1] // block * size
            data = buf[start + offset:start + offset + nbytes]
            if kind.name in _FLOAT_DTYPES:
                data = data.view(_FLOAT_DTYPES[kind.name]).reshape(shape)
            else:
                data = data.reshape(rows, -1)
            self.tensors.append(GGUFTensor(name, kind.name, shape, data))

    @property
    def architecture(self) -> str:
        return str(self.fields["general.architecture"])

    def _take(self, n: int) -> int:
        at, self._pos = self._pos, self._pos + n
        return at

    def _string(self) -> str:
        import struct
        n = struct.unpack_from("<Q", self._raw, self._take(8))[0]
        at = self._take(n)
        return bytes(self._raw[at:at + n]).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        import struct
        if vtype == 8:
            return self._string()
        if vtype == 9:                                   # array: skipped, strings one by one
            etype, count = struct.unpack_from("<IQ", self._raw, self._take(12))
            if etype in self._SCALARS:
                self._take(count * struct.calcsize(self._SCALARS[etype]))
            else:
                for _ in range(count):
                    self._value(etype)
            return None
        fmt = self._SCALARS[vtype]
        return struct.unpack_from(fmt, self._raw, self._take(struct.calcsize(fmt)))[0]


def hf_name(gguf_name: str, architecture: str = "") -> str | None:
    """The HF checkpoint name of a GGUF tensor name (None for tensors the model does not use,
    such as rope_freqs) in a file of `architecture` (general.architecture)."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        names = {**_LAYER_NAMES, **_GEMMA_NAMES} if architecture in GEMMA_ARCHS \
            else {**_LAYER_NAMES, **MOE_NAMES}
        if part not in names:
            return None
        return f"model.layers.{layer}.{names[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None


@functools.lru_cache(maxsize=2)
def _open(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, once per process while it is unchanged (start-up asks for its format,
    then for its tensors)."""
    st = Path(path).stat()
    return _open(Path(path).resolve(), st.st_size, st.st_mtime_ns)


def native_format(path: Path) -> str | None:
    """The packed format that runs a GGUF file's matmul weights as stored: int4 where its
    layers hold 4-bit blocks (Q4_0 / Q4_1 / Q4_K), else int8 where they hold 5- to 8-bit
    ones (engine/gguf_blocks.py), None for float files (and types we dequantize)."""
    bits = {BLOCK_BITS.get(t.kind) for t in open_gguf(path).tensors
            if len(t.shape) in (2, 3) and t.name.startswith("blk.")}     # (3: experts)
    return "int4" if 4 in bits else "int8" if 8 in bits else None


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(-1)


def _value(t: GGUFTensor) -> torch.Tensor | GroupQuant:
    """A tensor's values: its groups where our kernels run its blocks, else float32."""
    quant = decode(t.kind, t.data)
    if quant is not None:
        return quant
    if t.kind == "BF16":
        return torch.from_numpy(t.data.astype(np.int32) << 16).view(torch.float32)
    if t.kind in _FLOAT_DTYPES:
        return torch.from_numpy(t.data.astype(np.float32))
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    return torch.from_numpy(dequantize(np.asarray(t.data), GGMLQuantizationType[t.kind])
                            .astype(np.float32).reshape(t.shape))


def iter_gguf_weights(path: Path, config: ModelConfig
                      ) -> Iterator[tuple[str, torch.Tensor | GroupQuant]]:
    """(HF name, tensor or GroupQuant) for every tensor of the GGUF file the model uses."""
    file = open_gguf(path)
    experts = expert_count(file.fields, file.architecture)
    for t in file.tensors:
        name = hf_name(t.name, file.architecture)
        block = _BLOCK.match(t.name)
        part = block.group(2) if block and experts and block.group(2) in EXPERT_PARTS else None
        if name is None and part is None:
            continue
        value = _value(t)
        if part is not None:            # every expert's rows of one projection
            yield from split_experts(int(block.group(1)), part, value, experts)
            continue
        if name.endswith("shared_expert_gate.weight"):
            value = value.reshape(1, -1)        # (llama.cpp's is a vector)
        if file.architecture in GEMMA_ARCHS and name.endswith("norm.weight"):
            value = value - 1           # llama.cpp's converter stores Gemma's norms as 1 + w
        if file.architecture == "phi3" and name.endswith(".mlp.up_proj.weight"):
            name = name.replace(".up_proj.", ".gate_up_proj.")     # [gate | up] in one
        if file.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name \
                else config.num_key_value_heads
            order = _unpermute_rows(value.shape[0], heads)
            value = value.rows(order) if isinstance(value, GroupQuant) else value[order]
        yield name, value


def phi3_config(path: Path) -> dict:
    """The HF config fields of a Phi-3 GGUF that transformers' reader drops: LongRoPE (its
    factor tensors, pretraining length, attention factor), the rotary dims as
    partial_rotary_factor, the sliding window (0 there: none)."""
    file = open_gguf(path)
    f = file.fields
    heads, hidden = int(f["phi3.attention.head_count"]), int(f["phi3.embedding_length"])
    rot = int(f.get("phi3.rope.dimension_count", hidden // heads))
    rope: dict = {"rope_theta": float(f.get("phi3.rope.freq_base", 10000.0)),
                  "partial_rotary_factor": rot / (hidden // heads)}
    out: dict = {"sliding_window": int(f.get("phi3.attention.sliding_window", 0)) or None,
                 "partial_rotary_factor": rope["partial_rotary_factor"]}
    factors = {t.name: t.data.astype(np.float32).tolist() for t in file.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) == 2:
        orig = int(f["phi3.rope.scaling.original_context_length"])
        rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                    short_factor=factors["rope_factors_short.weight"],
                    original_max_position_embeddings=orig)
        if "phi3.rope.scaling.attn_factor" in f:
            rope["attention_factor"] = float(f["phi3.rope.scaling.attn_factor"])
        out["original_max_position_embeddings"] = orig
    out["rope_parameters"] = rope
    return out


def gemma2_config(path: Path) -> dict:
    """The HF config fields of a Gemma 2 GGUF that transformers' reader drops: the soft-caps
    and the attention scale, which llama.cpp derives as it does (hidden / heads on the 27B's
    46 layers, else head_dim)."""
    f = open_gguf(path).fields
    heads, hidden = int(f["gemma2.attention.head_count"]), int(f["gemma2.embedding_length"])
    head_dim = int(f.get("gemma2.attention.key_length", hidden // heads))
    big = int(f["gemma2.block_count"]) == 46
    caps = {name: float(f[f"gemma2.{name}"]) for name in
            ("attn_logit_softcapping", "final_logit_softcapping") if f"gemma2.{name}" in f}
    return {"query_pre_attn_scalar": hidden // heads if big else head_dim, **caps}


def gemma3_config(path: Path) -> dict:
    """The HF config fields of a Gemma 3 GGUF that transformers' reader drops: the full
    attention layers' RoPE scaling (linear x8 on the 4B and larger), and the attention scale,
    which llama.cpp derives as it does (hidden / heads on the 27B's 62 layers, else
    head_dim)."""
    f = open_gguf(path).fields
    heads, hidden = int(f["gemma3.attention.head_count"]), int(f["gemma3.embedding_length"])
    head_dim = int(f.get("gemma3.attention.key_length", hidden // heads))
    full: dict = {"rope_type": "default", "rope_theta": float(f.get("gemma3.rope.freq_base",
                                                                    1e6))}
    if f.get("gemma3.rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(f["gemma3.rope.scaling.factor"]))
    big = int(f["gemma3.block_count"]) == 62
    return {"rope_parameters": {"full_attention": full},
            "query_pre_attn_scalar": hidden // heads if big else head_dim}
