"""Shared fixtures: markers, the bundled SmolLM2 converted once to an HF folder, a tiny Llama,
and (registered below) the real-server fixtures of tests/server_fixtures.py."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

# the real-server fixtures (`server`, `server_url`, `client`, `http`): tests/server_fixtures.py
pytest_plugins = ["tests.server_fixtures"]

REPO_ROOT = Path(__file__).resolve().parent.parent
# NOTE: the one-time GGUF conversion (~20-30 s) is cached inside the repo (.cache is ignored),
# so every test session after the first reuses it.
os.environ.setdefault("STRATA_CACHE_DIR", str(REPO_ROOT / ".cache" / "models"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "slow: loads a real model or runs for seconds")
    # NOTE: `--device auto` takes a GPU where torch sees one; the suite checks the CPU path
    # (engines and servers it starts included) unless the GPU tests are asked for: -m gpu
    if not re.search(r"(?<!not )\bgpu\b", config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF folder of the bundled SmolLM2-135M-Instruct (converted from its GGUF on first use)."""
    from engine.gguf_convert import ensure_hf_folder

    # NOTE: no skip when the bundled model is missing: `make test` installs it, and a broken
    # install step must fail the suite
    return ensure_hf_folder("bundled", Path(os.environ["STRATA_CACHE_DIR"]))


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (2 layers, 256 tokens) saved as an HF folder: engines over
    it build in a second."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(params=[2, 1, 0], ids=["avx512", "avx2", "portable"])
def kernel(request):
    """The C decode attention (kernels/sparse_attention.py's NativeSparseDecode) with its
    AVX-512 rows, its AVX2 rows, and its portable rows: every path this CPU has is tested (a
    path the CPU lacks falls back to the next)."""
    from kernels.sparse_attention import NativeSparseDecode

    k = NativeSparseDecode()
    k.simd = request.param
    return k
