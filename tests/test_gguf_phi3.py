"""A Phi-3 GGUF, written as llama.cpp's converter writes one (fused attn_qkv and ffn_up,
LongRoPE factors as tensors, the rotary dims and pretraining length as metadata), converts and
loads to the same logits as the transformers checkpoint it was made from: transformers' GGUF
reader drops the rope fields, which the conversion gives back."""
from __future__ import annotations

import math

import numpy as np

from engine.gguf_convert import ensure_hf_folder
from engine.model_config import ModelConfig
from tests.gguf_helpers import assert_serves_its_logits, write_gguf
from tests.model_helpers import save_tiny_hf

ORIGINAL = 8
FACTORS = {"short_factor": [1.0 + 0.1 * i for i in range(6)],
           "long_factor": [1.5 + 0.7 * i for i in range(6)]}
# llama.cpp's tensor names for Phi-3, by the HF name's module
NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
         "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _metadata(w, cfg) -> None:
    w.add_rope_scaling_orig_ctx_len(ORIGINAL)
    w.add_rope_dimension_count(12)                  # 3/4 of 16
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(0)
    scale = cfg.max_position_embeddings / ORIGINAL
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
    w.add_tensor("rope_factors_long.weight", np.array(FACTORS["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(FACTORS["short_factor"], np.float32))


def test_a_phi3_gguf_loads_with_its_longrope_and_partial_rotary(tmp_path):
    hf = save_tiny_hf("phi3", {"pad_token_id": 0, "vocab_size": 49152,
                               "partial_rotary_factor": 0.75,
                               "original_max_position_embeddings": ORIGINAL,
                               "rope_scaling": {"rope_type": "longrope", **FACTORS}},
                      tmp_path / "hf")
    path = tmp_path / "phi.gguf"
    write_gguf(hf, path, "phi3", NAMES, _metadata)
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    cfg = ModelConfig.from_hf(folder)
    assert cfg.rope_dims == 12 and cfg.sliding_window is None
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert_serves_its_logits(hf, folder, cfg, path)
