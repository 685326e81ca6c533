"""--device: resolved once at start-up, with a clear error for a device that cannot be used;
the suite runs with CUDA hidden unless `-m gpu` (tests/conftest.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine import devices
from engine.args import EngineArgs
from engine.devices import resolve_device


def test_auto_is_the_first_cuda_device_else_the_cpu(monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"sees 2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")


def test_a_device_that_cannot_be_used_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        resolve_device("cuda")
    for bad in ("gpu", "cuda:x", "cuda:", "mps", ""):
        with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N"):
            EngineArgs(device=bad)
    assert EngineArgs().device == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_serve_refuses_a_cuda_device_before_listening():
    proc = subprocess.run([sys.executable, "-m", "server", "serve", "--device", "cuda",
                           "--port", "18999"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "strata serve: --device cuda: torch sees no CUDA device" in proc.stderr


@pytest.mark.slow
def test_the_engine_runs_on_the_device_it_resolved(smollm2_dir):
    from engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), kv_device_gb=0.05))
    assert engine.device == torch.device("cpu")          # CUDA hidden: auto is the CPU
    assert engine.store.tiers.copies is None             # a CPU pool fills in place
