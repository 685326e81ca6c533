"""MoE GGUFs, written as llama.cpp's converter writes them (qwen3moe, qwen2moe, Mixtral's
llama files with experts: each
projection's experts stacked in one 3-D tensor, here in 4- and 8-bit blocks; the router
`ffn_gate_inp`; Qwen2-MoE's shared expert and its gate as a vector), convert to a config
alone and load to the logits of the transformers checkpoint they were made from, the
experts' codes kept for the decode form."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.gguf_convert import ensure_hf_folder
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from tests.gguf_helpers import assert_serves_its_logits, write_gguf
from tests.kv_cache import make_kv_cache
from tests.model_helpers import PagedSequence, page_pool, save_tiny_hf, step

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp",
         "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
SIZE = 96                   # an expert's intermediate size (whole 32-blocks; not hidden's 64)
SHAPES = {"qwen3moe": ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 2,
                                     "norm_topk_prob": True, "head_dim": 32}),
          "qwen2moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "shared_expert_intermediate_size": 96}),
          # Mixtral's: a llama file with experts (q and k rows permuted as for Llama)
          "llama": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                "intermediate_size": SIZE})}


def _blocks(array: np.ndarray, kind: str):
    """array quantized to llama.cpp's blocks of `kind`, and its values as they dequantize."""
    import gguf
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(array, qtype)
    return raw, qtype, gguf.quants.dequantize(raw, qtype).reshape(array.shape)


def _write(hf, arch: str, path, sizes: bool = True) -> None:
    """The GGUF, gate|up experts as Q4_0 and down as Q8_0 blocks; hf's experts take the
    values the blocks dequantize to (so both sides hold the same weights)."""
    def metadata(w, cfg) -> None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if not sizes:           # (a file from before llama.cpp wrote them: the tensors' shapes)
            return
        w.add_expert_feed_forward_length(SIZE)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    def value(name: str, array: np.ndarray):
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("mlp.experts.gate_up_proj"):
            raw_g, t4, gate = _blocks(np.ascontiguousarray(array[:, :SIZE]), "Q4_0")
            raw_u, _, up = _blocks(np.ascontiguousarray(array[:, SIZE:]), "Q4_0")
            _set(name, np.concatenate([gate, up], axis=1))
            return {f"blk.{layer}.ffn_gate_exps.weight": (raw_g, t4),
                    f"blk.{layer}.ffn_up_exps.weight": (raw_u, t4)}
        if name.endswith("mlp.experts.down_proj"):
            raw, t8, down = _blocks(array, "Q8_0")
            _set(name, down)
            return {f"blk.{layer}.ffn_down_exps.weight": (raw, t8)}
        if name.endswith("shared_expert_gate.weight"):
            return {f"blk.{layer}.ffn_gate_inp_shexp.weight": (array.reshape(-1), None)}
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = hf.config.num_attention_heads if ".q_proj." in name \
                else hf.config.num_key_value_heads      # llama.cpp's RoPE row order
            return array.reshape(heads, 2, -1, array.shape[1]).swapaxes(1, 2).reshape(
                array.shape)
        return array

    def _set(name: str, values: np.ndarray) -> None:
        with torch.no_grad():
            hf.state_dict()[name].copy_(torch.from_numpy(values))

    write_gguf(hf, path, arch, NAMES, metadata, value)


@pytest.mark.parametrize("arch, sizes", [(a, True) for a in sorted(SHAPES)]
                         + [("qwen2moe", False)])
def test_an_moe_gguf_loads_its_experts_with_their_codes(tmp_path, arch, sizes):
    kind, extra = SHAPES[arch]
    hf = save_tiny_hf(kind, dict(extra, vocab_size=49152, moe_intermediate_size=SIZE),
                      tmp_path / "hf")
    path = tmp_path / f"{arch}.gguf"
    _write(hf, arch, path, sizes)
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    assert not list(folder.glob("*.safetensors"))       # the config alone
    cfg = ModelConfig.from_hf(folder)
    assert cfg.moe.num_experts == extra.get("num_experts", extra.get("num_local_experts"))
    assert cfg.moe.expert_size == SIZE and cfg.moe.norm_topk_prob == (arch != "qwen2moe")
    assert cfg.moe.shared_size == extra.get("shared_expert_intermediate_size", 0)
    assert_serves_its_logits(hf, folder, cfg, path)
    # the decode form: each expert's own 4- and 8-bit codes in our kernels' formats, packed
    # as they load and run for steps of any rows (no dense copy of the experts)
    packed = load_model(folder, cfg, dtype=torch.float32, gguf=path, decode_format="native",
                        prefill_rows=16)
    gate_up, down = packed.layers[0].experts[1]
    assert (gate_up.decode.fmt, down.decode.fmt) == ("q4", "q8")
    assert gate_up.weight_for(64) is gate_up.decode and down.weight_for(64) is down.decode
    want = hf.model.layers[0].mlp.experts.gate_up_proj[1]
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gate_up(x), x @ want.T, atol=0.05, rtol=0.05)
    tokens = torch.randint(3, cfg.vocab_size, (40,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    (got,) = step(packed, make_kv_cache(packed, 16, 4),
                  [(PagedSequence(tokens, page_pool(16)), len(tokens))])
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(got, ref, atol=0.3, rtol=0.05)
