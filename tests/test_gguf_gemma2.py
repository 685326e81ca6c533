"""A Gemma 2 GGUF, written as llama.cpp's converter writes one (Gemma's norm names, norms
stored as 1 + w, the soft-caps as metadata), converts and loads to the same logits as the
transformers checkpoint it was made from: transformers' GGUF reader drops the soft-caps and the
attention scale, which the conversion gives back."""
from __future__ import annotations

from engine.gguf_convert import ensure_hf_folder
from engine.model_config import ModelConfig
from tests.gguf_helpers import assert_serves_its_logits, write_gguf
from tests.model_helpers import save_tiny_hf
from tests.test_gguf_gemma3 import NAMES, _value

GEMMA2_NAMES = {k: v for k, v in NAMES.items() if not k.endswith("_norm")}


def _metadata(w, cfg) -> None:
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(cfg.sliding_window)
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def test_a_gemma2_gguf_loads_with_its_norms_and_soft_caps(tmp_path):
    # head_dim 8 apart from hidden / heads (16): the scale llama.cpp derives is head_dim's;
    # soft-caps the random scores and logits reach past
    hf = save_tiny_hf("gemma2", {"vocab_size": 49152, "num_hidden_layers": 4, "head_dim": 8,
                                 "query_pre_attn_scalar": 8, "sliding_window": 7,
                                 "attn_logit_softcapping": 2.0,
                                 "final_logit_softcapping": 3.0, "pad_token_id": 0},
                      tmp_path / "hf")
    path = tmp_path / "gemma.gguf"
    write_gguf(hf, path, "gemma2", GEMMA2_NAMES, _metadata, _value)
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    cfg = ModelConfig.from_hf(folder)
    assert cfg.gemma and cfg.architecture == "Gemma2ForCausalLM"
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (2.0, 3.0)
    assert cfg.layer_windows == (7, None) * 2 and cfg.attention_scale == 8 ** -0.5
    assert_serves_its_logits(hf, folder, cfg, path)
