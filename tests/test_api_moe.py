"""A mixture-of-experts model (a tiny random Qwen3-MoE: routed layers and a dense one) served
end to end: the OpenAI SDK's streamed chat, and requests at once whose greedy tokens equal
transformers' (each row's experts whatever else is in its step)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.model_helpers import copy_tokenizer, hf_generate, save_tiny_hf
from tests.server_helpers import completion_tokens, openai_client, running_server

pytestmark = pytest.mark.slow

MODEL = {"vocab_size": 49152, "num_hidden_layers": 3, "head_dim": 32, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
         "mlp_only_layers": [1], "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def served(smollm2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    hf = save_tiny_hf("qwen3_moe", MODEL, folder)
    copy_tokenizer(smollm2_dir, folder)                 # the bundled model's vocabulary
    with running_server("--model", str(folder), "--served-model-name", "moe",
                        "--dtype", "fp32", "--weights", "fp32") as s:
        yield s, hf


def test_streamed_chat(served):
    server, _ = served
    stream = openai_client(server.url).chat.completions.create(
        model="moe", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "Which experts answer this?"}])
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_requests_at_once_generate_what_transformers_generates(served):
    server, hf = served
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (40, 9, 23)]

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda p: completion_tokens(server.url, p, 10), prompts))
    assert got == [hf_generate(hf, p, 10) for p in prompts]
