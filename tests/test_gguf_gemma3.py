"""A Gemma 3 GGUF, written as llama.cpp's converter writes one (its norm names, norms stored
as 1 + w, the full layers' linear RoPE scaling as metadata), converts and loads to the same
logits as the transformers checkpoint it was made from: transformers' GGUF reader drops the
scaling, which the conversion gives back."""
from __future__ import annotations

import torch

from engine.gguf_convert import ensure_hf_folder
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from tests.gguf_helpers import assert_serves_its_logits, write_gguf
from tests.model_helpers import save_tiny_hf

# llama.cpp's tensor names for Gemma 3, by the HF name's module
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _metadata(w, cfg) -> None:
    import gguf
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)


def _value(name: str, value):
    if name == "lm_head.weight":            # tied: the embeddings
        return None
    # llama.cpp's converter stores Gemma's norms as 1 + w
    return value + 1 if name.endswith("norm.weight") else value


def test_a_gemma3_gguf_loads_with_its_norms_and_rope_scaling(tmp_path):
    # head_dim 8 apart from hidden / heads (16): the scale llama.cpp derives is head_dim's
    hf = save_tiny_hf("gemma3", {"vocab_size": 49152, "num_hidden_layers": 6, "head_dim": 8,
                                 "query_pre_attn_scalar": 8, "sliding_window": 7,
                                 "pad_token_id": 0,
                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                      tmp_path / "hf")
    path = tmp_path / "gemma.gguf"
    write_gguf(hf, path, "gemma3", NAMES, _metadata, _value)
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    cfg = ModelConfig.from_hf(folder)
    assert cfg.gemma and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.layer_windows == (7,) * 5 + (None,) and cfg.attention_scale == 8 ** -0.5
    assert_serves_its_logits(hf, folder, cfg, path)
    # the folder transformers wrote (bf16) holds the norms as w, as the checkpoint does
    alone = load_model(folder, cfg, dtype=torch.float32)
    hf_layer, layer = hf.model.layers[5], alone.layers[5]
    for name in ("input_layernorm", "post_feedforward_layernorm"):
        torch.testing.assert_close(getattr(layer, name).weight,
                                   1 + getattr(hf_layer, name).weight, atol=1e-2, rtol=0)
