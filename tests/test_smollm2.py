"""The bundled SmolLM2-135M-Instruct: conversion, and greedy parity with transformers."""
from __future__ import annotations

import json

import pytest
import torch

from engine.model_config import ModelConfig
from engine.model_loader import load_model
from tests.model_helpers import greedy, page_pool
from tests.kv_cache import make_kv_cache

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def _chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, return_dict=False)


def test_converted_folder_has_chatml_template_and_eos_ids(smollm2_dir, tokenizer):
    assert "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    cfg = ModelConfig.from_hf(smollm2_dir)
    assert cfg.eos_token_ids[0] == 2 and set(cfg.eos_token_ids) == {2, 0}
    assert tokenizer.convert_ids_to_tokens([0, 2]) == ["<|endoftext|>", "<|im_end|>"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())


def test_greedy_decode_equals_transformers_generate_fp32(smollm2_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ours = load_model(smollm2_dir, dtype=torch.float32, max_model_len=2048)
    cache = make_kv_cache(ours, 64, 16)
    for i, text in enumerate(PROMPTS):
        ids = _chat_ids(tokenizer, text)
        # NOTE: an eos id the model never emits, so both sides run all NEW_TOKENS steps
        # (past <|im_end|>) and every step is compared.
        no_eos = hf.config.vocab_size - 1
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=no_eos, pad_token_id=no_eos)[0, len(ids):].tolist()
        assert len(want) == NEW_TOKENS
        got = greedy(ours, cache, ids, NEW_TOKENS, page_pool(64, seed=i))
        assert got == want, (tokenizer.decode(got), tokenizer.decode(want))


def test_bf16_generates_sensible_text(smollm2_dir, tokenizer):
    ours = load_model(smollm2_dir, dtype=torch.bfloat16, max_model_len=2048)
    cache = make_kv_cache(ours, 16, 16)
    out = greedy(ours, cache, _chat_ids(tokenizer, PROMPTS[0]), 16, page_pool(16),
                 eos_ids=(2, 0))
    assert "Paris" in tokenizer.decode(out)
