"""A Phi-3 GGUF, written as llama.cpp's converter writes one (fused attn_qkv and ffn_up,
LongRoPE factors as tensors, the rotary dims and pretraining length as metadata), converts and
loads to the same logits as the transformers checkpoint it was made from: transformers' GGUF
reader drops the rope fields, which the conversion gives back."""
from __future__ import annotations

import math

import numpy as np
import torch

from engine.gguf_convert import bundled_gguf_path, ensure_hf_folder
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from tests.kv_cache import make_kv_cache
from tests.model_helpers import PagedSequence, page_pool, save_tiny_hf, step

ORIGINAL = 8
FACTORS = {"short_factor": [1.0 + 0.1 * i for i in range(6)],
           "long_factor": [1.5 + 0.7 * i for i in range(6)]}
# llama.cpp's tensor names for Phi-3, by the HF name's module
NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
         "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _write_phi3_gguf(hf, path) -> None:
    import gguf
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(ORIGINAL)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(12)                  # 3/4 of 16
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(0)
    scale = cfg.max_position_embeddings / ORIGINAL
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
    reader = gguf.GGUFReader(str(bundled_gguf_path()))      # the bundled model's vocabulary
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub)
    w.add_tensor("rope_factors_long.weight", np.array(FACTORS["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(FACTORS["short_factor"], np.float32))
    for name, p in hf.state_dict().items():
        if name.startswith("model.layers."):
            layer, module = name[len("model.layers."):].split(".", 1)
            module, kind = module.rsplit(".", 1)
            out = f"blk.{layer}.{NAMES[module]}.{kind}"
        else:
            out = TOP[name]
        w.add_tensor(out, p.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_phi3_gguf_loads_with_its_longrope_and_partial_rotary(tmp_path):
    hf = save_tiny_hf("phi3", {"pad_token_id": 0, "vocab_size": 49152,
                               "partial_rotary_factor": 0.75,
                               "original_max_position_embeddings": ORIGINAL,
                               "rope_scaling": {"rope_type": "longrope", **FACTORS}},
                      tmp_path / "hf")
    path = tmp_path / "phi.gguf"
    _write_phi3_gguf(hf, path)
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    cfg = ModelConfig.from_hf(folder)
    assert cfg.rope_dims == 12 and cfg.sliding_window is None
    assert cfg.rope_scaling["rope_type"] == "longrope"
    ours = load_model(folder, cfg, dtype=torch.float32, gguf=path)
    tokens = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    (got,) = step(ours, make_kv_cache(ours, 16, 4), [(PagedSequence(tokens, page_pool(16)),
                                                       len(tokens))])
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
