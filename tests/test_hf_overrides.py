"""`--hf-overrides` (vLLM's): keys that replace the model's config.json's at load. Its main
use is a longer context than the model was trained for: a YaRN (or linear, dynamic)
rope_scaling serves the original positions times its factor, as vLLM serves them, and the
model then generates what transformers generates with that rope_scaling in its config."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from scheduler.sampling_params import SamplingParams
from tests.model_helpers import TINY, save_tiny_hf

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}


def config(**extra) -> ModelConfig:
    return ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **TINY, **extra})


@pytest.mark.parametrize("scaling, positions", [
    (None, 128),
    ({"rope_type": "linear", "factor": 2.0}, 256),
    ({"rope_type": "dynamic", "factor": 4.0}, 512),     # (served: 128 unless asked)
    (YARN, 256),
    # the config already gives the scaled length (DeepSeek's and YaRN fine-tunes' shape)
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, 128)])
def test_a_rope_scaling_serves_its_factor_times_the_positions(scaling, positions):
    cfg = config(**({} if scaling is None else {"rope_scaling": scaling}))
    assert cfg.positions == positions
    # dynamic NTK is transformers' only up to the model's positions: served there by default
    dynamic = scaling is not None and scaling["rope_type"] == "dynamic"
    assert cfg.served_positions == (128 if dynamic else positions)


def test_overrides_replace_the_configs_keys_wherever_rope_is_kept():
    # a transformers 5 config keeps RoPE in rope_parameters, read before the top level
    v5 = {"architectures": ["LlamaForCausalLM"], **TINY,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = ModelConfig.from_hf(v5, {"rope_theta": 5e5, "rope_scaling": YARN,
                                   "max_position_embeddings": 64})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == YARN
    assert cfg.max_position_embeddings == 64 and cfg.positions == 256
    assert ModelConfig.from_hf(v5).rope_scaling is None
    v4 = {**v5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    del v4["rope_parameters"]
    cfg = ModelConfig.from_hf(v4, {"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                      "rope_theta": 1e4}})
    assert cfg.rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize("value, match", [("[1]", "JSON object"), ("{bad", "not JSON")])
def test_a_bad_override_is_refused_at_start_up(value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(hf_overrides=value)


@pytest.mark.slow
def test_a_yarn_override_serves_past_the_trained_positions_as_transformers(tmp_path,
                                                                          monkeypatch):
    import json

    import engine.llm_engine as llm_engine
    namespaces = []         # the prefix cache's: pages rotated otherwise are not shared
    real = llm_engine.model_fingerprint
    monkeypatch.setattr(llm_engine, "model_fingerprint",
                        lambda *a: namespaces.append(real(*a)) or namespaces[-1])
    plain = save_tiny_hf("llama", {}, tmp_path / "plain")
    yarn = save_tiny_hf("llama", {"rope_scaling": YARN}, tmp_path / "yarn")
    for a, b in zip(plain.state_dict().values(), yarn.state_dict().values()):
        assert torch.equal(a, b)                    # the same weights, another RoPE
    prompt = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want, unscaled = (m.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
                          for m in (yarn, plain))
    assert want != unscaled                         # the RoPE matters here
    args = dict(model=str(tmp_path / "plain"), dtype="fp32", weights="fp32", page_size=16,
                kv_device_gb=0.01, prefix_cache="off")
    assert LLMEngine(EngineArgs(**args)).max_model_len == 128
    with pytest.raises(ValueError, match="exceeds the model's 128 positions.*hf-overrides"):
        LLMEngine(EngineArgs(**args, max_model_len=256))
    engine = LLMEngine(EngineArgs(**args, hf_overrides=json.dumps({"rope_scaling": YARN})))
    assert engine.max_model_len == 256
    assert len(namespaces) == 2 and namespaces[0] != namespaces[1]
    engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                   ignore_eos=True))
    got = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got += out.new_token_ids
    assert got == want


def test_a_phi3_config_names_longrope_yarn_but_an_override_without_its_factors_is_yarn():
    phi3 = {"architectures": ["Phi3ForCausalLM"], **TINY}
    lr = {"rope_type": "yarn", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
          "original_max_position_embeddings": 64}
    assert ModelConfig.from_hf({**phi3, "rope_scaling": lr}).rope_scaling["rope_type"] \
        == "longrope"
    cfg = ModelConfig.from_hf(phi3, {"rope_scaling": YARN})
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.positions == 256
