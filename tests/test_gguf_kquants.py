"""A GGUF as llama.cpp's K-quant mixes write one (Q4_K_M, the usual download: Q4_K for most
matrices, Q6_K for the output head and some layers' attn_v / ffn_down; here also Q5_K, Q5_0,
Q5_1, Q3_K, IQ4_NL and IQ4_XS) loads to the logits of the checkpoint holding the values its
blocks dequantize to, and decodes in the file's own codes: 4-bit groups for Q4_K, 8-bit
groups for the others, and a fused q|k|v of 4- and 8-bit parts as 8-bit groups."""
from __future__ import annotations

import numpy as np
import torch

from bench.gguf_random import random_blocks
from engine.gguf_convert import ensure_hf_folder
from engine.gguf_weights import native_format
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from tests.gguf_helpers import assert_serves_its_logits, write_gguf
from tests.kv_cache import make_kv_cache
from tests.model_helpers import PagedSequence, page_pool, save_tiny_hf, step

NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm"}
# each matrix's block type: layer 0 as Q4_K_M's "more bits" layers, layer 1 the other types
# our kernels run as 8-bit groups
KINDS = {"model.embed_tokens": "Q4_K", "lm_head": "Q6_K",
         "model.layers.0.self_attn.q_proj": "Q4_K", "model.layers.0.self_attn.k_proj": "Q4_K",
         "model.layers.0.self_attn.v_proj": "Q6_K", "model.layers.0.self_attn.o_proj": "Q4_K",
         "model.layers.0.mlp.gate_proj": "Q4_K", "model.layers.0.mlp.up_proj": "Q4_K",
         "model.layers.0.mlp.down_proj": "Q6_K",
         "model.layers.1.self_attn.q_proj": "Q5_K", "model.layers.1.self_attn.k_proj": "IQ4_NL",
         "model.layers.1.self_attn.v_proj": "Q5_0", "model.layers.1.self_attn.o_proj": "Q5_1",
         "model.layers.1.mlp.gate_proj": "Q3_K", "model.layers.1.mlp.up_proj": "IQ4_XS",
         "model.layers.1.mlp.down_proj": "Q5_K"}
SHAPE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


def _write(hf, path) -> None:
    """hf's shape as a llama GGUF of random KINDS blocks; hf takes the values they dequantize
    to (q and k in llama.cpp's permuted row order in the file)."""
    import gguf

    def metadata(w, cfg) -> None:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])

    def value(name: str, array: np.ndarray):
        kind = KINDS.get(name.rsplit(".", 1)[0])
        if kind is None:
            return array
        qtype = gguf.GGMLQuantizationType[kind]
        raw = random_blocks(kind, *array.shape, seed=len(name), size=7.5)
        values = gguf.quants.dequantize(raw, qtype).reshape(array.shape)
        if ".q_proj." in name or ".k_proj." in name:
            heads = hf.config.num_attention_heads if ".q_proj." in name \
                else hf.config.num_key_value_heads      # the file's rows -> HF's
            values = values.reshape(heads, -1, 2, array.shape[1]).swapaxes(1, 2).reshape(
                array.shape)
        with torch.no_grad():
            hf.state_dict()[name].copy_(torch.from_numpy(values))
        out = name.replace("model.embed_tokens", "token_embd").replace("lm_head", "output")
        if name.startswith("model.layers."):
            layer, module = name[len("model.layers."):].split(".", 1)
            out = f"blk.{layer}.{NAMES[module.rsplit('.', 1)[0]]}.weight"
        return {out: (raw, qtype)}

    write_gguf(hf, path, "llama", NAMES, metadata, value)


def test_a_k_quant_mix_loads_exactly_and_decodes_in_its_own_codes(tmp_path):
    hf = save_tiny_hf("llama", SHAPE, tmp_path / "hf")
    path = tmp_path / "q4_k_m.gguf"
    _write(hf, path)
    assert native_format(path) == "int4"
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    cfg = ModelConfig.from_hf(folder)
    assert_serves_its_logits(hf, folder, cfg, path)     # the dense form: the file's values
    packed = load_model(folder, cfg, dtype=torch.float32, gguf=path, decode_format="native",
                        prefill_rows=64)
    first, second = packed.layers
    assert (first.qkv.decode.fmt, first.o.decode.fmt, first.gate_up.decode.fmt,
            first.down.decode.fmt, packed.head.decode.fmt) == ("q8", "q4", "q4", "q8", "q8")
    assert (second.qkv.decode.fmt, second.o.decode.fmt, second.gate_up.decode.fmt,
            second.down.decode.fmt) == ("q8", "q8", "q8", "q8")
    tokens = torch.randint(3, cfg.vocab_size, (24,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    seq = PagedSequence(tokens, page_pool(16))
    cache = make_kv_cache(packed, 16, 4)
    step(packed, cache, [(seq, 20)])                    # a prefill chunk (dense form), then
    got = torch.cat([step(packed, cache, [(seq, 1)])[0] for _ in range(4)])    # decode rows
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, 20:].float()
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    # measured 0.024 logit standard deviations off, 0.0013 with the Q6_K tensors as Q5_K
    # (exact groups): Q6_K's groups round to 1/8 of a sub-block's step (tests/test_weights.py)
    assert ((got - ref).abs().amax(-1) / ref.std(-1)).max() < 0.05


def test_without_a_dense_copy_every_step_runs_the_files_codes(tmp_path):
    """keep_dense False (a model whose dense copy would not fit): the matmuls are packed as
    they load, their dense parameters never filled and let go; decode rows run the packed
    form, prefill chunks that form dequantized when it runs (the head never), both as close
    to the checkpoint as the decode rows were; KV recompute (k|v of the fused weight) runs
    them too."""
    hf = save_tiny_hf("llama", SHAPE, tmp_path / "hf")
    path = tmp_path / "q4_k_m.gguf"
    _write(hf, path)
    folder = ensure_hf_folder(str(path), tmp_path / "cache")
    cfg = ModelConfig.from_hf(folder)
    both = load_model(folder, cfg, dtype=torch.float32, gguf=path, decode_format="native",
                      prefill_rows=64)
    tokens = torch.randint(3, cfg.vocab_size, (40,),
                           generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    for rows in (64, 16):                   # the 40-token prefill packed, then staged
        alone = load_model(folder, cfg, dtype=torch.float32, gguf=path, decode_format="native",
                           prefill_rows=rows, keep_dense=False)
        for layer in alone.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                assert getattr(layer, f"{name}_proj").numel() == 0
                lin = getattr(layer, name)
                assert lin.weight_for(rows - 1) is lin.decode
                assert lin.weight_for(rows).packed is lin.decode        # a StagedWeight
        assert alone.lm_head.numel() == 0 and alone.head.weight_for(512) is alone.head.decode
        assert alone.embed_tokens.numel() == cfg.vocab_size * cfg.hidden_size
        (got,) = step(alone, make_kv_cache(alone, 16, 4),
                      [(PagedSequence(tokens, page_pool(16)), len(tokens))])
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
        assert ((got - ref).abs().amax(-1) / ref.std(-1)).max() < 0.05
    for n in (5, 20):                       # KV recompute's k|v: packed, then staged
        xn = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
        cos, sin = both.rope.cos_sin(torch.arange(n), torch.float32)
        for a, b in zip(alone.layers[1].kv_from_inputs(xn, cos, sin),
                        both.layers[1].kv_from_inputs(xn, cos, sin)):
            torch.testing.assert_close(a, b, atol=0.02, rtol=0.02)
