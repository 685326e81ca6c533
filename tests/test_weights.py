"""Weight formats: GGUF blocks read as they are, packed matmuls, the per-phase plan, and the
bundled model running int4 against its dequantized float32 reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.gguf_random import random_blocks
from engine.gguf_blocks import decode
from engine.gguf_weights import iter_gguf_weights, native_format
from engine.model_config import ModelConfig
from engine.model_loader import iter_safetensors, load_model
from engine import weight_plan
from engine.weight_plan import plan_weights
from kernels.packed_linear import GroupQuant, Linear, PackedWeight, StagedWeight, quantize_int4
from tests.model_helpers import PagedSequence, greedy, page_pool, step
from tests.kv_cache import make_kv_cache

ROWS = (1, 3, 8, 17)          # awkward step sizes


EXACT_KINDS = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q3_K", "IQ4_NL",
               "IQ4_XS"]


@pytest.mark.parametrize("kind", EXACT_KINDS)
def test_gguf_blocks_decode_as_the_gguf_package_dequantizes_them(kind):
    """Each type's groups of 32 (4-bit codes for the Q4 types, 8-bit for the others) give the
    `gguf` package's dequantization bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    raw = random_blocks(kind, 24, 512)
    want = dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32)
    got = decode(kind, raw)
    assert got.bits == (4 if kind.startswith("Q4") else 8) and got.shape == (24, 512)
    assert got.codes.min() >= -128 and got.codes.max() <= 127
    assert torch.equal(got.dequantize(), torch.from_numpy(want))


def test_q6_k_groups_are_exact_where_a_byte_holds_them_else_within_an_eighth_step():
    """Q6_K: sub-blocks of 16 with int8 scales, two to a group of 32. The file's values are
    kept for the dense form; the groups of blocks whose scales share a divisor (8, 16, 24,
    32, either sign) are exact, of random scales within 1/8 of the group's larger sub-block
    step."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    rng = np.random.default_rng(5)
    raw = random_blocks("Q6_K", 24, 512).reshape(24, 2, 210)
    raw[:, 0, 192:208] = rng.choice([8, 16, 24, 32, -8, -16, -24, -32], (24, 16)
                                    ).astype(np.int8).view(np.uint8)
    raw[:, 1, 192:208] = rng.integers(-128, 128, (24, 16), dtype=np.int8).view(np.uint8)
    raw = raw.reshape(24, -1)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float32))
    got = decode("Q6_K", raw)
    assert got.bits == 8 and got.codes.min() >= -128 and got.codes.max() <= 127
    assert torch.equal(got.dequantize(), want)              # the dense form: the file's values
    err = (got.groups_only().dequantize() - want).view(24, 2, 256)
    assert torch.equal(err[:, 0], torch.zeros_like(err[:, 0]))
    d = raw.reshape(24, 2, 210)[:, 1, 208:210].copy().view(np.float16).astype(np.float32)
    sc = np.abs(raw.reshape(24, 2, 210)[:, 1, 192:208].view(np.int8).astype(np.float32))
    step = torch.from_numpy(d * sc.reshape(24, 8, 2).max(-1)).repeat_interleave(32, -1)
    assert (err[:, 1].abs() <= step / 8 * (1 + 1e-6)).all()
    assert err[:, 1].abs().max() > 0             # (random scales: some groups rounded)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4", "q8", "q4"])
def test_packed_matmul_matches_its_dequantized_weight(fmt):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=gen) * 0.05
    packed = PackedWeight.from_dense(w, fmt)
    ref_w = quantize_int4(w).dequantize() if fmt in ("int4", "q4") else w
    tol = 0 if fmt == "fp32" else 2e-2
    for rows in ROWS:
        x = torch.randn(rows, 96, generator=gen)
        want = x @ ref_w.T
        got = packed.mm(x)
        assert got.shape == (rows, 48) and got.dtype == torch.float32
        err = (got - want).abs().max() / want.abs().max()
        assert err <= tol + 1e-6, (fmt, rows, float(err))


@pytest.mark.parametrize("kind,fmt", [("Q4_1", "int4"), ("Q4_1", "q4"), ("Q4_0", "q4"),
                                      ("Q4_K", "q4"), ("Q8_0", "q8"), ("Q8_0", "int8"),
                                      ("Q5_K", "q8"), ("Q6_K", "q8"), ("Q5_1", "int8")])
def test_packed_formats_keep_a_gguf_files_codes(kind, fmt):
    q = decode(kind, random_blocks(kind, 32, 256, seed=3))
    x = torch.randn(5, 256)
    want = x @ q.groups_only().dequantize().T       # (Q6_K: its groups, not the file's values)
    err = (PackedWeight.from_quant(q, fmt).mm(x) - want).abs().max() / want.abs().max()
    assert err < (2e-2 if fmt in ("int4", "int8") else 2e-3)     # (torch's: bf16 x)


def test_linear_runs_long_steps_on_the_dense_form():
    w = torch.randn(32, 64) * 0.05
    bias = torch.randn(32)
    lin = Linear(PackedWeight.from_dense(w, "int4"), bias,
                 prefill=PackedWeight.from_dense(w, "fp32"), prefill_rows=16)
    long_x, short_x = torch.randn(16, 64), torch.randn(4, 64)
    assert torch.allclose(lin(long_x), long_x @ w.T + bias, atol=1e-5)
    packed = quantize_int4(w).dequantize()
    assert torch.allclose(lin(short_x), short_x @ packed.T + bias, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(lin(short_x), short_x @ w.T + bias, atol=1e-5)


def test_plan_takes_explicit_choices_and_times_only_real_choices(caplog):
    caplog.set_level("INFO", logger="engine.weight_plan")
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 64,
                               "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "max_position_embeddings": 64})
    plan = plan_weights(cfg, "fp32", "auto", None, (1, 1))
    assert (plan.dtype, plan.kv_dtype, plan.decode_format, plan.two_forms) == \
        ("fp32", "fp32", "fp32", False)
    plan = plan_weights(cfg, "bf16", "int4", None, (1, 1))
    assert (plan.dtype, plan.two_forms) == ("bf16", True)
    assert plan.decode_format in ("q4", "int4")             # our kernel or torch's, timed
    assert plan.prefill_rows > 1
    plan = plan_weights(cfg, "auto", "native", "int4", (1, 1))
    assert plan.decode_format in ("native", "native-torch") and plan.kv_dtype == "bf16"
    plan = plan_weights(cfg, "auto", "auto", "int4", (1, 1))
    assert plan.decode_format in ("native", "native-torch", "fp32", "bf16")
    assert plan.dtype in ("fp32", "bf16")
    assert "--dtype auto" in caplog.text and "--weights auto" in caplog.text
    with pytest.raises(ValueError, match="--weights"):
        plan_weights(cfg, "auto", "int3", None, (1, 1))
    # a GGUF whose dense copy would not fit keeps its packed weights alone: the copy may
    # take half of what is left beside the packed weights and the dense embedding
    params = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) + 64 * 64       # layers, head
    packed, dense, embedding = params * (0.5 + 0.125), params * 4, 64 * 64 * 4
    edge = packed + embedding + 2 * dense
    assert plan_weights(cfg, "fp32", "native", "int4", (1, 1), available=edge + 64).keep_dense
    small = plan_weights(cfg, "fp32", "native", "int4", (1, 1), available=edge - 64)
    assert not small.keep_dense and small.decode_format == "native"
    assert "does not fit" in caplog.text
    # long steps then dequantize our kernel's forms when they run, from a crossover timed
    # against that form
    assert small.prefill_rows > 1 and "dequantized when it runs" in caplog.text
    assert any(">" in fmt for fmt, *_ in weight_plan._PROBES)
    # --prefill-weights: staged drops the copy where it would fit, dense keeps it where not
    assert not plan_weights(cfg, "fp32", "native", "int4", (1, 1), available=edge + 64,
                            prefill="staged").keep_dense
    assert plan_weights(cfg, "fp32", "native", "int4", (1, 1), available=edge - 64,
                        prefill="dense").keep_dense
    assert plan_weights(cfg, "fp32", "int4", None, (1, 1), prefill="staged").keep_dense
    with pytest.raises(ValueError, match="--prefill-weights"):
        plan_weights(cfg, "fp32", "native", "int4", (1, 1), prefill="none")
    assert plan_weights(cfg, "fp32", "int4", None, (1, 1), available=1000).keep_dense
    # a GPU runs dense weights: no CPU probe, no packed CPU kernels
    assert plan_weights(cfg, "auto", "auto", "int4", (1, 1), "cuda").decode_format == "bf16"
    with pytest.raises(ValueError, match="CPU only"):
        plan_weights(cfg, "auto", "int4", None, (1, 1), "cuda")


def test_a_containers_memory_limit_bounds_the_memory_available(tmp_path, monkeypatch):
    from engine import weight_plan
    (tmp_path / "max").write_text("1000000000\n")
    (tmp_path / "current").write_text("200000000\n")
    monkeypatch.setattr(weight_plan, "CGROUP_MEMORY",
                        ((str(tmp_path / "max"), str(tmp_path / "current")),))
    assert weight_plan._mem_available() == 800_000_000
    (tmp_path / "max").write_text("max\n")                  # no limit: the OS's figure
    assert weight_plan._mem_available() > 800_000_000


# ---------------------------------------------------------------- the bundled model (slow)
@pytest.fixture(scope="module")
def bundled(smollm2_dir):
    from engine.gguf_convert import bundled_gguf_path
    return bundled_gguf_path(), ModelConfig.from_hf(smollm2_dir)


@pytest.mark.slow
def test_bundled_gguf_read_natively_equals_the_converted_folder(smollm2_dir, bundled):
    path, cfg = bundled
    assert native_format(path) == "int4"
    converted = dict(iter_safetensors(smollm2_dir))
    kinds = set()
    for name, value in iter_gguf_weights(path, cfg):
        kinds.add(type(value).__name__ if not isinstance(value, GroupQuant) else value.bits)
        dense = value.dequantize() if isinstance(value, GroupQuant) else value
        # the converted folder holds transformers' dequantization rounded to bf16
        assert torch.equal(dense.to(torch.bfloat16), converted.pop(name).to(torch.bfloat16)), name
    assert not converted and kinds == {4, 8, "Tensor"}


def _forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits [len(tokens), vocab] of each step when the model is fed `tokens` (teacher
    forcing: every model sees the same trajectory)."""
    seq = PagedSequence(list(prompt) + list(tokens), page_pool(32))
    cache = make_kv_cache(model, 32, 16)
    out = [step(model, cache, [(seq, len(prompt))], all_logits=False)[0][-1]]
    out += [step(model, cache, [(seq, 1)], all_logits=False)[0][-1] for _ in tokens[1:]]
    return torch.stack(out)


@pytest.mark.slow
@pytest.mark.parametrize("native,formats,tol,agreement", [
    ("native", ("q4", "q8"), 0.01, 1.0), ("native-torch", ("int4", "int8"), 0.4, 0.9)])
def test_bundled_model_in_int4_tracks_its_float32_reference(smollm2_dir, bundled, native,
                                                            formats, tol, agreement):
    """Decode steps in the file's own Q4_1 codes stay close to the dequantized float32 model:
    our kernels (16-bit x) to ~1e-3 logit standard deviations, with the same greedy tokens;
    torch's int4 (bf16 x) as close as bf16 weights were (the old default): measured top-1
    agreement 0.94-1.0 and max |logit error| / logit std 0.20-0.26 for both."""
    from transformers import AutoTokenizer
    path, _ = bundled
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ref = load_model(smollm2_dir, dtype=torch.float32, max_model_len=512, gguf=path)
    q4 = load_model(smollm2_dir, dtype=torch.float32, max_model_len=512, gguf=path,
                    decode_format=native, prefill_rows=64)
    assert (q4.layers[0].qkv.decode.fmt, q4.head.decode.fmt) == formats
    agree = steps = 0
    for i, text in enumerate(["What is the capital of France?", "Name three planets.",
                              "Write a haiku about disks."]):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, return_dict=False)
        want = greedy(ref, make_kv_cache(ref, 32, 16), ids, 16, page_pool(32, seed=i))
        r, q = _forced_logits(ref, ids, want), _forced_logits(q4, ids, want)
        assert ((q - r).abs().amax(-1) / r.std(-1)).max() < tol
        agree += int((q.argmax(-1) == r.argmax(-1)).sum())
        steps += len(want)
        if i == 0:
            assert "Paris" in tok.decode(greedy(q4, make_kv_cache(q4, 32, 16), ids, 12,
                                                page_pool(32)))
    assert agree >= agreement * steps, (agree, steps)


@pytest.mark.slow
def test_bundled_model_without_a_dense_copy_tracks_its_float32_reference(smollm2_dir, bundled):
    """keep_dense False (a model too big for its dense copy): decode steps run the file's own
    codes, prefill chunks of prefill_rows or more those codes dequantized when they run; the
    tied embedding stays dense for the lookup (and the head's long steps) and the head packs
    from its codes."""
    from transformers import AutoTokenizer
    path, _ = bundled
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ref = load_model(smollm2_dir, dtype=torch.float32, max_model_len=512, gguf=path)
    alone = load_model(smollm2_dir, dtype=torch.float32, max_model_len=512, gguf=path,
                       decode_format="native", prefill_rows=16, keep_dense=False)
    layer = alone.layers[0]
    staged = layer.qkv.weight_for(16)
    assert layer.qkv_proj.numel() == 0 and isinstance(staged, StagedWeight)
    assert staged.packed is layer.qkv.decode and layer.qkv.weight_for(15) is layer.qkv.decode
    assert alone.embed_tokens.numel() > 0 and alone.head.decode.fmt == "q8"
    head = alone.head.weight_for(512)                 # the tied embedding's own values
    assert not isinstance(head, StagedWeight) and head.fmt == "fp32"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=False)
    assert len(ids) >= 16                       # (its prefill runs the staged form)
    want = greedy(ref, make_kv_cache(ref, 32, 16), ids, 16, page_pool(32))
    r, q = _forced_logits(ref, ids, want), _forced_logits(alone, ids, want)
    assert ((q - r).abs().amax(-1) / r.std(-1)).max() < 0.01
    assert "Paris" in tok.decode(greedy(alone, make_kv_cache(alone, 32, 16), ids, 12,
                                        page_pool(32)))
