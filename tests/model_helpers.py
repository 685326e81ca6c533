"""Test-only drivers for our model: run token chunks of several sequences through paged KV."""
from __future__ import annotations

import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.attention import AttentionBatch, TorchPagedAttention
from tests.kv_cache import DenseStep


@dataclass
class PagedSequence:
    """One sequence's tokens so far and the (shuffled) pages holding its KV."""
    tokens: list[int]
    pages: list[int]
    computed: int = 0                       # tokens whose K/V are in the cache
    logits: list[torch.Tensor] = field(default_factory=list)   # [n, vocab] per step


def page_pool(num_pages: int, seed: int = 0) -> list[int]:
    """Page ids in a shuffled order, so sequences get non-contiguous pages."""
    ids = list(range(num_pages))
    random.Random(seed).shuffle(ids)
    return ids


def step(model, cache, work: list[tuple[PagedSequence, int]], all_logits: bool = True):
    """Run `n` more tokens of each (sequence, n) in ONE batch; return [rows, vocab] per sequence
    (every new row when all_logits, else the last one)."""
    ids, pos, q_lens, kv_lens, pages, rows = [], [], [], [], [], []
    for seq, n in work:
        start = seq.computed
        ids += seq.tokens[start:start + n]
        pos += range(start, start + n)
        q_lens.append(n)
        kv_lens.append(start + n)
        pages.append(seq.pages)
        first = len(ids) - n
        rows += range(first, first + n) if all_logits else [first + n - 1]
    batch = AttentionBatch.build(pages, kv_lens, q_lens, cache.page_size)
    kv = DenseStep(cache, batch, TorchPagedAttention(), model.config.num_attention_heads,
                   model.dtype, model.config.layer_windows,
                   model.config.attn_logit_softcapping)
    logits = model(torch.tensor(ids), torch.tensor(pos), kv, torch.tensor(rows))
    out, at = [], 0
    for seq, n in work:
        k = n if all_logits else 1
        out.append(logits[at:at + k])
        seq.logits.append(logits[at:at + k])
        seq.computed += n
        at += k
    return out


def greedy(model, cache, prompt: list[int], max_new_tokens: int, pages: list[int],
           eos_ids: tuple[int, ...] = ()) -> list[int]:
    """Prefill the prompt, then decode one token at a time through the paged cache."""
    seq = PagedSequence(list(prompt), pages)
    out: list[int] = []
    n = len(prompt)
    for _ in range(max_new_tokens):
        (logits,) = step(model, cache, [(seq, n)], all_logits=False)
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        seq.tokens.append(token)
        n = 1
    return out


def greedy_logprobs(engine, prompts: list[list[int]], steps: int,
                    loras: list[str | None] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Greedy `steps` tokens of each prompt through an LLMEngine (loras: each prompt's LoRA
    adapter, None the base model): request id ("r0", "r1", ...) -> [(token, its logprob)]; a
    request that ends in error fails the test."""
    from scheduler.sampling_params import SamplingParams

    got = {}
    for i, p in enumerate(prompts):
        got[f"r{i}"] = []
        engine.add_request(f"r{i}", p, SamplingParams(
            max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=0,
            lora=None if loras is None else loras[i]))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id] += [(t, lp[0].logprob) for t, lp in
                                    zip(out.new_token_ids, out.new_logprobs)]
    return got


# a tiny checkpoint's shape (transformers config fields)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def save_tiny_hf(kind: str, extra: dict, folder) -> torch.nn.Module:
    """A tiny random transformers checkpoint of `kind` (llama, qwen2, qwen3, smollm3, mistral,
    phi3, gemma2, gemma3, qwen3_moe, qwen2_moe, mixtral) in `folder` (float32; weights big
    enough that mistakes show in the logits) -> the HF model."""
    import transformers as tf
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                              Gemma3TextConfig, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config,
                              Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                          "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM),
                          "phi3": (Phi3Config, Phi3ForCausalLM),
                          "gemma2": (Gemma2Config, Gemma2ForCausalLM),
                          "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
                          "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
                          "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
                          "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}[kind]
    kwargs = dict(TINY, **extra)
    if "rope_scaling" in kwargs and kind == "gemma3":   # the full-attention layers'
        kwargs["rope_parameters"] = {
            "full_attention": dict(kwargs.pop("rope_scaling"), rope_theta=1e6),
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    elif "rope_scaling" in kwargs:
        kwargs["rope_parameters"] = dict(kwargs.pop("rope_scaling"), rope_theta=10000.0)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).float().eval()
    with torch.no_grad():   # weights big enough that mistakes show in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):       # (Gemma's scale by 1 + w)
                p.copy_((not kind.startswith("gemma")) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return model


def hf_generate(hf, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens after `prompt` (no eos stop)."""
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def copy_tokenizer(src: Path, folder: Path) -> None:
    """The tokenizer files of the HF folder `src` (the bundled model's) into `folder`."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)
