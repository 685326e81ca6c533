"""A Gemma 3 GGUF, written as llama.cpp's converter writes one (its norm names, norms stored
as 1 + w, the full layers' linear RoPE scaling as metadata), converts and loads to the same
logits as the transformers checkpoint it was made from: transformers' GGUF reader drops the
scaling, which the conversion gives back."""
from __future__ import annotations

import torch

from engine.gguf_convert import bundled_gguf_path, ensure_hf_folder
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from tests.kv_cache import make_kv_cache
from tests.model_helpers import PagedSequence, page_pool, save_tiny_hf, step

# llama.cpp's tensor names for Gemma 3, by the HF name's module
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def _write_gemma3_gguf(hf, path) -> None:
    import gguf
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(2.0)
    reader = gguf.GGUFReader(str(bundled_gguf_path()))      # the bundled model's vocabulary
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub)
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight":            # tied: the embeddings
            continue
        if name.startswith("model.layers."):
            layer, module = name[len("model.layers."):].split(".", 1)
            module, kind = module.rsplit(".", 1)
            out = f"blk.{layer}.{NAMES[module]}.{kind}"
        else:
            out = TOP[name]
        value = p.float().numpy()
        if name.endswith("norm.weight"):
            value = value + 1                   # as llama.cpp's converter stores Gemma's
        w.add_tensor(out, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gemma3_gguf_loads_with_its_norms_and_rope_scaling(tmp_path):
    # head_dim 8 apart from hidden / heads (16): the scale llama.cpp derives is head_dim's
    hf = save_tiny_hf("gemma3", {"vocab_size": 49152, "num_hidden_layers": 6, "head_dim": 8,
                                 "query_pre_attn_scalar": 8, "sliding_window": 7,
                                 "pad_token_id": 0,
                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                      tmp_path / "hf")
    path = tmp_path / "gemma.gguf"
    _write_gemma3_gguf(hf, path)
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    cfg = ModelConfig.from_hf(folder)
    assert cfg.gemma and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.layer_windows == (7,) * 5 + (None,) and cfg.attention_scale == 8 ** -0.5
    ours = load_model(folder, cfg, dtype=torch.float32, gguf=path)
    tokens = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    (got,) = step(ours, make_kv_cache(ours, 16, 4), [(PagedSequence(tokens, page_pool(16)),
                                                       len(tokens))])
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the folder transformers wrote (bf16) holds the norms as w, as the checkpoint does
    alone = load_model(folder, cfg, dtype=torch.float32)
    hf_layer, layer = hf.model.layers[5], alone.layers[5]
    for name in ("input_layernorm", "post_feedforward_layernorm"):
        torch.testing.assert_close(getattr(layer, name).weight,
                                   1 + getattr(hf_layer, name).weight, atol=1e-2, rtol=0)
