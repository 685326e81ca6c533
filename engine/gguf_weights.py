"""A GGUF file's tensors under their Hugging Face names, quantized tensors as they are stored.

`iter_gguf_weights` yields (HF name, tensor) pairs for LlamaForCausalLM.load_weights: float
tensors (F32, F16, BF16) as torch tensors, and Q4_0, Q4_1 and Q8_0 tensors as GroupQuant (their
codes, and per block of 32 a scale and a zero point), so that the model can run them through
packed int4 / int8 matmuls without requantizing. Other quantized types are dequantized to
float32 by the `gguf` package.

llama.cpp's converter permutes the rows of Llama's q and k projections (its RoPE pairs
neighbouring dims; HF's pairs halves); the permutation is undone here, on whole rows, so
codes and block scales move with their rows.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from engine.model_config import ModelConfig
from kernels.packed_linear import GROUP, GroupQuant

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# bytes per block of 32 weights
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_FLOAT_TYPES = ("F32", "F16", "BF16")


def hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor name (None for tensors the model does not use,
    such as rope_freqs)."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader
    field = GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def native_format(path: Path) -> str | None:
    """The packed format that runs a GGUF file's matmul weights as stored: int4 for Q4_0 /
    Q4_1 blocks, int8 for Q8_0, None for float files (and types we dequantize)."""
    from gguf import GGUFReader
    kinds = {t.tensor_type.name for t in GGUFReader(str(path)).tensors
             if len(t.shape) == 2 and t.name.startswith("blk.")}
    if kinds & {"Q4_0", "Q4_1"}:
        return "int4"
    return "int8" if "Q8_0" in kinds else None


def decode_blocks(kind: str, raw: np.ndarray) -> GroupQuant:
    """Blocks of one tensor, raw uint8 [N, K / 32 * block bytes] -> GroupQuant [N, K]."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, _BLOCK_BYTES[kind])
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).astype(np.int16))
        return GroupQuant(codes.reshape(n, -1), scale, torch.zeros_like(scale), 8)
    start = 4 if kind == "Q4_1" else 2
    qs = blocks[..., start:start + GROUP // 2]
    # a block's byte j holds weight j in its low nibble and weight j + 16 in its high one
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
    if kind == "Q4_1":
        zero = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0]
                                .astype(np.float32))
    else:                                    # Q4_0: w = d * (q - 8)
        zero = -8 * scale
    return GroupQuant(torch.from_numpy(codes).reshape(n, -1), scale, zero, 4)


def _unpermute_rows(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(-1)


def iter_gguf_weights(path: Path, config: ModelConfig
                      ) -> Iterator[tuple[str, torch.Tensor | GroupQuant]]:
    """(HF name, tensor or GroupQuant) for every tensor of the GGUF file the model uses."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    reader = GGUFReader(str(path))
    arch = gguf_architecture(path)
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        if kind in _BLOCK_BYTES:
            value: torch.Tensor | GroupQuant = decode_blocks(kind, np.asarray(t.data))
        elif kind in _FLOAT_TYPES:
            value = torch.from_numpy(np.asarray(t.data).astype(np.float32))
        else:
            value = torch.from_numpy(dequantize(t.data, t.tensor_type).astype(np.float32))
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name \
                else config.num_key_value_heads
            order = _unpermute_rows(value.shape[0], heads)
            value = value.permute_rows(order) if isinstance(value, GroupQuant) else value[order]
        yield name, value
