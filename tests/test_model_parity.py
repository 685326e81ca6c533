"""Our paged Llama-family forward equals transformers' on tiny random checkpoints (float32)."""
from __future__ import annotations

import pytest
import torch

from engine.model_loader import load_model
from tests.model_helpers import TINY, PagedSequence, page_pool, save_tiny_hf, step
from tests.kv_cache import make_kv_cache

PAGE_SIZE = 4
PHI3 = {"pad_token_id": 0}
QWEN3_MOE = {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 48, "norm_topk_prob": True}
GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 7, "pad_token_id": 0}


def longrope(n: int) -> dict:
    """A LongRoPE scaling with `n` distinct short and long factors (n: rotary dims / 2)."""
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(n)],
            "long_factor": [1.5 + 0.7 * i for i in range(n)]}

CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama_rope_llama3": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama_rope_linear_tied": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                         "tie_word_embeddings": True}),
    "llama_rope_yarn": ("llama", {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama_rope_dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama_biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),        # head_dim != hidden / heads, as Qwen3's
    "qwen3_biases_tied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0], "pad_token_id": 0}),   # layer 1: NoPE
    "mistral": ("mistral", {"sliding_window": None}),
    # a sliding window shorter than the prompts (7 tokens: not a whole number of pages)
    "mistral_window": ("mistral", {"sliding_window": 7}),
    # Qwen2's: only the layers from max_window_layers on
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                               "max_window_layers": 1}),
    "phi3": ("phi3", PHI3),
    # Gemma 3: its block, a query scale apart from head_dim, a windowed layer (its own RoPE
    # base) and a full one (linear scaling); the default 5:1 pattern over 6 layers
    "gemma3": ("gemma3", dict(GEMMA3, layer_types=["sliding_attention", "full_attention"],
                              rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "gemma3_pattern": ("gemma3", dict(GEMMA3, num_hidden_layers=6,
                                      final_logit_softcapping=3.0)),
    # Gemma 2: every attention score soft-capped (at 2: the random scores reach past it), the
    # logits too, a windowed layer then a full one (its default pattern)
    "gemma2": ("gemma2", dict(GEMMA3, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0)),
    # MoE: 8 experts, 2 a token, renormalised; layer 1's MLP dense (mlp_only_layers)
    "qwen3_moe": ("qwen3_moe", dict(QWEN3_MOE, mlp_only_layers=[1])),
    # Qwen2-MoE's shared expert (sigmoid-gated), top-3 not renormalised, q/k/v biases
    "qwen2_moe": ("qwen2_moe", {"num_experts": 6, "num_experts_per_tok": 3,
                                "moe_intermediate_size": 64,
                                "shared_expert_intermediate_size": 96}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "intermediate_size": 48}),
    # LongRoPE, short factors: the served length (the config's 128) is within the pretraining
    # length, so no attention factor either
    "phi3_longrope_short": ("phi3", dict(PHI3, original_max_position_embeddings=128,
                                         rope_scaling=longrope(8))),
    # long factors (every prompt passes the pretraining length 8, so transformers takes them
    # too) and their attention factor
    "phi3_longrope_long": ("phi3", dict(PHI3, original_max_position_embeddings=8,
                                        rope_scaling=longrope(8))),
    # Phi-4-mini's shape: 3/4 of each head rotated (12 of 16 dims), LongRoPE, tied embeddings
    "phi3_partial_tied": ("phi3", dict(PHI3, partial_rotary_factor=0.75, tie_word_embeddings=True,
                                       original_max_position_embeddings=8,
                                       rope_scaling=longrope(6))),
}


def _prompts(n: int, lengths=(37, 23, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 256, (length,), generator=g).tolist() for length in lengths]


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    kind, extra = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hf(kind, extra, folder)
    ours = load_model(folder, dtype=torch.float32)
    return hf, ours


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def test_single_prefill_matches_hf_logits(pair):
    hf, ours = pair
    cache = make_kv_cache(ours, 64, PAGE_SIZE)
    pool = page_pool(64)
    for i, tokens in enumerate(_prompts(0)):
        seq = PagedSequence(tokens, pool[i * 12:(i + 1) * 12])
        (got,) = step(ours, cache, [(seq, len(tokens))])
        torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_decode_in_mixed_batches_match_hf_logits(pair):
    """Three sequences advance together with different chunkings (prefill chunks crossing
    pages, decode steps of one token) in shared batches; every row equals HF's."""
    hf, ours = pair
    cache = make_kv_cache(ours, 64, PAGE_SIZE)
    pool = page_pool(64, seed=3)
    prompts = _prompts(1)
    seqs = [PagedSequence(t, pool[i * 12:(i + 1) * 12]) for i, t in enumerate(prompts)]
    plans = [[7, 1, 12, 5, 1, 1, 1, 2, 7], [1, 1, 9, 3, 1, 1, 1, 1, 5], [9]]
    for s, plan in zip(seqs, plans):
        assert sum(plan) == len(s.tokens)
    for t in range(max(len(p) for p in plans)):
        work = [(s, p[t]) for s, p in zip(seqs, plans) if t < len(p)]
        step(ours, cache, work)
    for s in seqs:
        torch.testing.assert_close(torch.cat(s.logits), _hf_logits(hf, s.tokens),
                                   atol=1e-4, rtol=1e-4)


def test_logits_only_for_requested_rows(pair):
    hf, ours = pair
    cache = make_kv_cache(ours, 16, PAGE_SIZE)
    tokens = _prompts(2)[0]
    seq = PagedSequence(tokens, page_pool(16))
    (last,) = step(ours, cache, [(seq, len(tokens))], all_logits=False)
    assert last.shape == (1, 256) and last.dtype == torch.float32
    torch.testing.assert_close(last[0], _hf_logits(hf, tokens)[-1], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    hf = save_tiny_hf("llama", {}, tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path / "sharded", dtype=torch.float32)
    tokens = _prompts(4)[0]
    (got,) = step(ours, make_kv_cache(ours, 16, PAGE_SIZE), [(PagedSequence(tokens,
                                                                          page_pool(16)),
                                                           len(tokens))])
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("kind, extra", [("qwen3", {"head_dim": 32}),
                                         ("smollm3", {"no_rope_layers": [1, 0],
                                                      "pad_token_id": 0}),
                                         ("phi3", CASES["phi3_partial_tied"][1]),
                                         CASES["gemma3"], CASES["gemma2"],
                                         CASES["qwen3_moe"], CASES["qwen2_moe"]])
def test_the_engine_serves_newer_families_as_transformers_generates(tmp_path, weights, kind,
                                                                    extra):
    """A tiny Qwen3 (per-head q/k norms, head_dim apart from hidden / heads), SmolLM3 (a
    layer without RoPE), Phi-4-mini-shaped Phi-3 (partial rotary, LongRoPE past its
    pretraining length) or Gemma 3 (its block, a window shorter than the prompts) through the
    whole engine: paged KV store, chunked prefill, the
    resident decode path; greedy tokens equal transformers' generate (int8 decode weights: up
    to the first near-tie)."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests.engine_helpers import assert_same_greedy, run_scored

    hf = save_tiny_hf(kind, extra, tmp_path)
    prompts = _prompts(3, lengths=(41, 17))
    steps = 12
    engine = LLMEngine(EngineArgs(model=str(tmp_path), dtype="fp32", weights=weights,
                                  page_size=16, kv_device_gb=0.01, max_model_len=128,
                                  max_num_batched_tokens=32, prefix_cache="off"))
    got, margins = run_scored(engine, prompts, steps)
    ref = {}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            ref[f"r{i}"] = out[0, len(p):].tolist()
    if weights == "fp32":
        assert got == ref
    else:
        assert_same_greedy(got, ref, margins)


def test_gguf_names_of_the_qk_norms():
    from engine.gguf_weights import hf_name
    assert hf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"


@pytest.mark.parametrize("extra", [
    {},
    # sparse decode past 80 tokens (the 70-token prompt's last decode, whose 5-page budget
    # leaves one of its 6 pages out: the greedy tokens stay, the logprobs move); the full
    # layers select while the windowed ones attend their window
    {"sparse_budget": 80, "sparse_threshold": 80, "dense_layers": 0},
    {"sparse_budget": 80, "sparse_threshold": 80, "dense_layers": 0, "pipeline": "sfc",
     "micro_batch": 1},
    {"kv_disk_gb": 0.01}])          # the disk tier as the backing store
@pytest.mark.parametrize("kind, model", [
    # Phi-3-mini-4k's shape: every layer windowed (20 tokens: not whole pages)
    ("phi3", dict(PHI3, sliding_window=20)),
    # Gemma 3's: a windowed layer and a full one
    ("gemma3", dict(GEMMA3, sliding_window=20,
                    layer_types=["sliding_attention", "full_attention"])),
    ("gemma2", dict(GEMMA3, sliding_window=20, attn_logit_softcapping=2.0))])
def test_the_engine_serves_past_a_sliding_window_as_transformers_generates(tmp_path, kind,
                                                                           model, extra):
    """A window shorter than the served length, which is the model's positions: through the
    KV store (chunked prefill; decodes within the window, then past it, where a step with
    any sequence past it attends the window's pages), greedy tokens equal transformers'
    generate. The short prompt alone first: steps the window never cuts (the resident path)."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests.engine_helpers import run_logprobs

    hf = save_tiny_hf(kind, model, tmp_path / "model")
    engine = LLMEngine(EngineArgs(model=str(tmp_path / "model"), dtype="fp32", weights="fp32",
                                  page_size=16, kv_device_gb=0.01, max_num_batched_tokens=32,
                                  prefix_cache="off", kv_disk_path=tmp_path / "kv", **extra))
    assert engine.max_model_len == 128
    for prompts, steps in ((_prompts(5, lengths=(9,)), 6), (_prompts(5, lengths=(41, 17, 70)),
                                                             12)):
        got, logprobs = run_logprobs(engine, prompts, steps)
        with torch.no_grad():
            for i, p in enumerate(prompts):
                out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
                assert got[f"r{i}"] == out[0, len(p):].tolist()
                if "sparse_budget" in extra:
                    continue
                # and each token's logprob, as transformers scores the whole text
                ref = torch.log_softmax(_hf_logits(hf, out[0, :-1].tolist()), -1)
                ref = ref[len(p) - 1:].gather(1, out[0, len(p):, None])[:, 0]
                torch.testing.assert_close(torch.tensor(logprobs[f"r{i}"]), ref,
                                           atol=2e-4, rtol=0)
    if kind == "gemma3" and "sparse_budget" in extra:       # its full layer selected
        assert engine.store.stats.snapshot().selected_count > 0


def test_a_windowed_layer_reads_only_its_window_from_disk(tmp_path):
    """Every full page forced out to disk: decodes past a 20-token window read at most the
    window's full pages of each layer a step (2), where full attention reads them all (6; the
    page being written stays on the device)."""
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests.engine_helpers import run_scored

    reads = {}
    for window in (None, 20):
        folder = tmp_path / f"model-{window}"
        save_tiny_hf("phi3", dict(PHI3, sliding_window=window), folder)
        engine = LLMEngine(EngineArgs(model=str(folder), dtype="fp32", weights="fp32",
                                      page_size=16, kv_device_gb=0.01, kv_disk_gb=0.01,
                                      kv_disk_path=tmp_path / f"kv-{window}",
                                      kv_force_tier="disk", prefix_cache="off"))
        run_scored(engine, _prompts(6, lengths=(100,)), 1)         # the prompt alone
        before = engine.store.stats.snapshot().hits.get("disk", 0)
        run_scored(engine, _prompts(6, lengths=(100,)), 9)          # and 8 decodes
        reads[window] = engine.store.stats.snapshot().hits.get("disk", 0) - before
    # per layer (2) and decode (8)
    assert reads[None] >= 2 * 8 * 6 and 0 < reads[20] <= 2 * 8 * 2, reads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_norms_round_once_as_transformers(dtype):
    """Gemma's RMSNorm multiplies by 1 + w in float32 and rounds once (a Llama norm multiplies
    the rounded activations): on bf16 activations too, transformers' bits exactly."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from engine.norm import GemmaRMSNorm
    g = torch.Generator().manual_seed(0)
    hf = Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(0.3 * torch.randn(64, generator=g))
        ours = GemmaRMSNorm(64, 1e-6, dtype, "cpu")
        ours.weight.copy_(1.0 + hf.weight.float())
    x = (3 * torch.randn(7, 64, generator=g)).to(dtype)
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours(x), hf(x))


def test_a_gemma3_vision_language_checkpoint_serves_its_language_model(tmp_path):
    """Gemma 3 4B and larger come as Gemma3ForConditionalGeneration (a vision tower beside the
    language model, the text config nested): served text-only, its logits of a text prompt
    equal transformers' whole model's."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from engine.model_config import ModelConfig

    text = dict(TINY, **GEMMA3, layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=255,
        boi_token_index=253, eoi_token_index=254)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.15 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.multimodal and cfg.gemma and cfg.layer_windows == (7, None)
    ours = load_model(tmp_path, cfg, dtype=torch.float32)
    tokens = _prompts(7)[0]
    (got,) = step(ours, make_kv_cache(ours, 16, PAGE_SIZE),
                  [(PagedSequence(tokens, page_pool(16)), len(tokens))])
    torch.testing.assert_close(got, _hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
