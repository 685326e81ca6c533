"""ModelConfig.from_hf over the config shapes transformers 4 and 5 write."""
from __future__ import annotations

import json

import pytest

from engine.model_config import ModelConfig

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1)


def test_unsupported_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3"):
        ModelConfig.from_hf(dict(BASE, architectures=["GPT2LMHeadModel"]))


def test_defaults_head_dim_and_rope():
    c = ModelConfig.from_hf(BASE)
    assert c.head_dim == 16 and c.rope_theta == 10000.0 and c.rope_scaling is None
    assert c.group_size == 2 and not c.tie_word_embeddings and c.sliding_window is None


def test_transformers4_rope_scaling_with_type_key():
    c = ModelConfig.from_hf(dict(BASE, rope_theta=5e5,
                                 rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_transformers5_rope_parameters_carry_theta():
    c = ModelConfig.from_hf(dict(BASE, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1e5}))
    assert c.rope_theta == 1e5 and c.rope_scaling is None


def test_eos_ids_merge_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, eos_token_id=[2, 0])))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    assert ModelConfig.from_hf(tmp_path).eos_token_ids == (2, 0, 7)


def test_qwen2_has_qkv_bias_and_ignores_disabled_sliding_window():
    c = ModelConfig.from_hf(dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                                 use_sliding_window=False))
    assert c.attention_bias and not c.o_proj_bias and c.sliding_window is None
    assert c.layer_windows == (None, None)


def test_qwen3_norms_each_q_and_k_head_and_has_no_qkv_bias_by_default():
    c = ModelConfig.from_hf(dict(BASE, model_type="qwen3", architectures=None, head_dim=32,
                                 sliding_window=4096, use_sliding_window=False))
    assert c.architecture == "Qwen3ForCausalLM" and c.qk_norm and c.head_dim == 32
    assert not c.attention_bias and c.sliding_window is None
    assert not ModelConfig.from_hf(BASE).qk_norm


def test_smollm3_nope_layers_listed_or_every_fourth():
    listed = ModelConfig.from_hf(dict(BASE, architectures=["SmolLM3ForCausalLM"],
                                      no_rope_layers=[1, 0]))
    assert listed.nope_layers == (1,) and not listed.qk_norm
    every = ModelConfig.from_hf(dict(BASE, model_type="smollm3", architectures=None,
                                     num_hidden_layers=8))
    assert every.nope_layers == (3, 7)
    assert ModelConfig.from_hf(BASE).nope_layers == ()


def test_mistral_sliding_window():
    c = ModelConfig.from_hf(dict(BASE, architectures=["MistralForCausalLM"], sliding_window=4096))
    assert c.sliding_window == 4096 and not c.attention_bias
    assert c.layer_windows == (4096, 4096) and c.served_positions == 256


def test_the_layers_a_sliding_window_applies_to():
    # Qwen2: the layers from max_window_layers on (transformers' default layer_types)
    qwen = dict(BASE, architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, sliding_window=64,
                use_sliding_window=True, max_window_layers=2)
    assert ModelConfig.from_hf(qwen).layer_windows == (None, None, 64, 64)
    # the config's own layer_types win
    listed = dict(qwen, layer_types=["sliding_attention", "full_attention"] * 2)
    assert ModelConfig.from_hf(listed).layer_windows == (64, None, 64, None)
    # SmolLM3: its layers without RoPE
    smol = dict(BASE, model_type="smollm3", architectures=None, num_hidden_layers=4,
                sliding_window=64, use_sliding_window=True)
    assert ModelConfig.from_hf(smol).layer_windows == (None, None, None, 64)


def test_phi3_longrope_named_su_keeps_its_pretraining_length_and_window():
    c = ModelConfig.from_hf(dict(BASE, architectures=["Phi3ForCausalLM"], sliding_window=2047,
                                 original_max_position_embeddings=64,
                                 rope_scaling={"type": "su", "short_factor": [1.0] * 8,
                                               "long_factor": [2.0] * 8}))
    assert c.rope_scaling == {"rope_type": "longrope", "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    assert c.sliding_window == 2047 and c.served_positions == 256   # the window is longer
    short = ModelConfig.from_hf(dict(BASE, model_type="phi3", architectures=None,
                                     sliding_window=100))
    # served past the window (attended within it)
    assert short.served_positions == 256 and short.layer_windows == (100, 100)
    assert c.rope_dims == 16 and not c.attention_bias


def test_partial_rotary_read_from_either_place_and_only_for_phi3():
    top = ModelConfig.from_hf(dict(BASE, architectures=["Phi3ForCausalLM"],
                                   partial_rotary_factor=0.75))
    nested = ModelConfig.from_hf(dict(BASE, architectures=["Phi3ForCausalLM"],
                                      rope_parameters={"rope_type": "default",
                                                       "partial_rotary_factor": 0.75}))
    assert top.rope_dims == nested.rope_dims == 12 and top.head_dim == 16
    assert nested.rope_scaling is None
    with pytest.raises(ValueError, match="Phi-3"):
        ModelConfig.from_hf(dict(BASE, partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="even"):
        ModelConfig.from_hf(dict(BASE, architectures=["Phi3ForCausalLM"],
                                 partial_rotary_factor=0.5625))   # 9 of 16 dims


def test_gemma2_as_its_checkpoints_write_it():
    # Gemma-2-9B-it's config.json as the hub has it (transformers 4: no layer_types)
    old = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584,
               intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
               num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
               hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
               cache_implementation="hybrid", rope_theta=10000.0, vocab_size=256000)
    c = ModelConfig.from_hf(old)
    assert c.gemma and not c.qk_norm and c.tie_word_embeddings
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert c.attention_scale == 256 ** -0.5 and c.rope_theta == 10000.0
    assert c.local_rope_theta is None and c.positions == 8192
    assert c.layer_windows == (4096, None) * 21          # the first of each pair windowed
    # the 27B's attention scale, transformers 5's listed layer types
    new = dict(old, query_pre_attn_scalar=144, architectures=None,
               layer_types=["full_attention", "sliding_attention"] * 21)
    c5 = ModelConfig.from_hf(new)
    assert c5.attention_scale == 144 ** -0.5 and c5.layer_windows == (None, 4096) * 21
    with pytest.raises(ValueError, match="activation"):
        ModelConfig.from_hf(dict(old, hidden_activation="gelu"))


def test_gemma3_as_transformers_4_and_5_write_it():
    # Gemma-3-4B's config.json as the hub has it (transformers 4: the defaults left out)
    old = dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=12, hidden_size=2560,
               num_attention_heads=8, num_key_value_heads=4, sliding_window=1024,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6,
               rope_local_base_freq=10000.0, final_logit_softcapping=None)
    c = ModelConfig.from_hf(old)
    assert c.gemma and c.qk_norm and c.tie_word_embeddings and c.head_dim == 256
    assert c.attention_scale == 256 ** -0.5 and c.rms_norm_eps == 1e-6
    assert c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.local_rope_theta == 10000.0 and c.positions == 131072      # already scaled
    assert c.layer_windows == (1024,) * 5 + (None,) + (1024,) * 5 + (None,)
    # transformers 5: a RoPE per layer type, the layer types listed (values apart from the
    # defaults, a 27B-like attention scale)
    new = dict(old, model_type="gemma3_text", architectures=None, rope_scaling=None,
               layer_types=["sliding_attention", "full_attention"] * 6, head_dim=128,
               query_pre_attn_scalar=168,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                   "rope_theta": 5e5},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 20000.0}})
    c5 = ModelConfig.from_hf(new)
    assert c5.rope_scaling == c.rope_scaling and c5.rope_theta == 5e5
    assert c5.layer_windows == (1024, None) * 6 and c5.local_rope_theta == 20000.0
    assert c5.attention_scale == 168 ** -0.5
    # --hf-overrides: rope_theta is the global layers'; a vision-language checkpoint's
    # overrides are its language model's
    assert ModelConfig.from_hf(new, {"rope_theta": 2e6}).rope_theta == 2e6
    vl = dict(architectures=["Gemma3ForConditionalGeneration"], text_config=dict(
        new, architectures=None), vision_config={}, eos_token_id=[1, 106])
    cv = ModelConfig.from_hf(vl, {"rope_theta": 2e6, "sliding_window": 512})
    assert cv.multimodal and cv.rope_theta == 2e6 and cv.layer_windows[0] == 512
    assert cv.eos_token_ids == (1, 106)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf(dict(old, attn_logit_softcapping=50.0))


# Qwen3-30B-A3B's config.json as published (the fields that matter here)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_experts": 128,
    "num_experts_per_tok": 8, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 48, "tie_word_embeddings": False, "bos_token_id": 151643,
    "eos_token_id": 151645}


def test_moe_configs_as_their_checkpoints_write_them():
    """Qwen3-MoE (Qwen3's attention, 128 experts, 8 a token), Qwen1.5-MoE (Qwen2's biases, a
    shared expert, top-k not renormalised, dense layers by decoder_sparse_step and
    mlp_only_layers), Mixtral (Mistral's, the experts sized by intermediate_size) and
    transformers 5's name for the expert count."""
    q = ModelConfig.from_hf(QWEN3_30B_A3B)
    assert q.architecture == "Qwen3MoeForCausalLM" and q.qk_norm and not q.attention_bias
    assert (q.moe.num_experts, q.moe.top_k, q.moe.expert_size, q.moe.norm_topk_prob,
            q.moe.shared_size) == (128, 8, 768, True, 0)
    assert q.moe.layers == tuple(range(48)) and q.sliding_window is None
    q2 = ModelConfig.from_hf(dict(BASE, architectures=["Qwen2MoeForCausalLM"],
                                  num_hidden_layers=6, num_experts=60, num_experts_per_tok=4,
                                  moe_intermediate_size=1408,
                                  shared_expert_intermediate_size=5632,
                                  decoder_sparse_step=2, mlp_only_layers=[3]))
    assert q2.attention_bias and not q2.qk_norm and not q2.moe.norm_topk_prob
    assert q2.moe.layers == (1, 5) and q2.moe.shared_size == 5632
    m = ModelConfig.from_hf(dict(BASE, model_type="mixtral", architectures=None,
                                 num_local_experts=8, num_experts_per_tok=2,
                                 intermediate_size=14336, sliding_window=None))
    assert m.architecture == "MixtralForCausalLM" and not m.attention_bias
    assert (m.moe.num_experts, m.moe.expert_size, m.moe.norm_topk_prob) == (8, 14336, True)
    t5 = ModelConfig.from_hf(dict(QWEN3_30B_A3B, num_experts=None, num_local_experts=128))
    assert t5.moe == q.moe
    assert ModelConfig.from_hf(BASE).moe is None
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be in 1..8"):
        ModelConfig.from_hf(dict(QWEN3_30B_A3B, num_experts=8, num_experts_per_tok=9))
