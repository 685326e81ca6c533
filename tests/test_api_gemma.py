"""A Gemma 3-shaped model (tiny, random: windowed and full layers) served end to end: the
OpenAI SDK's streamed chat, and greedy tokens past the window equal to transformers'; in a KV
pool that holds them only without the windowed layers' old pages, requests at once."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.model_helpers import copy_tokenizer, hf_generate, save_tiny_hf
from tests.server_helpers import (REQUEST_TIMEOUT_S, completion_tokens, openai_client,
                                  running_server)

pytestmark = pytest.mark.slow

MODEL = {"vocab_size": 49152, "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 16,
         "query_pre_attn_scalar": 24, "pad_token_id": 0, "max_position_embeddings": 512,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}


@pytest.fixture(scope="module")
def checkpoint(smollm2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma")
    hf = save_tiny_hf("gemma3", MODEL, folder)
    copy_tokenizer(smollm2_dir, folder)                 # the bundled model's vocabulary
    return folder, hf


@pytest.fixture(scope="module")
def served(checkpoint):
    folder, hf = checkpoint
    with running_server("--model", str(folder), "--served-model-name", "gemma",
                        "--dtype", "fp32", "--weights", "fp32") as s:
        yield s, hf


def test_streamed_chat_past_the_window(served):
    server, _ = served
    client = openai_client(server.url)
    stream = client.chat.completions.create(
        model="gemma", max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Tell me about disks. " * 10}])
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens > MODEL["sliding_window"]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length"


def test_greedy_tokens_equal_transformers_past_the_window(served):
    server, hf = served
    prompt = torch.randint(3, 49152, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    assert completion_tokens(server.url, prompt, 12) == hf_generate(hf, prompt, 12)


def test_requests_at_once_in_a_pool_that_holds_them_only_windowed(checkpoint):
    """17 whole pages (3 layers of 16 tokens, 4 KiB a layer) hold 272 tokens; without the
    windowed layers' old pages one request holds 592 (64-token steps): three of 340 tokens
    (each more than the whole pages hold) run at once or in turns (preempted, recomputed),
    and each one's greedy tokens are transformers'."""
    folder, hf = checkpoint
    gb = f"{17 * 3 * 4096 / 2**30:.10f}"
    with running_server("--model", str(folder), "--served-model-name", "gemma", "--dtype",
                        "fp32", "--weights", "fp32", "--kv-device-gb", gb,
                        "--max-num-batched-tokens", "64") as server:
        prompts = [torch.randint(3, 49152, (300,), generator=torch.Generator().manual_seed(i))
                   .tolist() for i in range(3)]

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: completion_tokens(server.url, p, 40), prompts))
        metrics = httpx.get(server.url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    assert re.search(r"^strata_kv_pages_total 17(\.0)?$", metrics, re.M), metrics[:2000]
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_generate(hf, prompt, 40)
