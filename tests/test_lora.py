"""LoRA adapters (engine/lora.py, `--lora-modules`): a request with an adapter generates what
transformers generates with the adapter merged into the weights (W + s B A), beside requests
of another adapter and of the base model in the same steps; an adapter's prompt pages are
never shared with the base model's or another adapter's; adapters that do not fit the model
are refused at start-up, naming what does not fit."""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine import weight_plan
from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from kernels import decode_layer
from kernels.decode_layer import DecodeLayers, FusedLayers
from scheduler.sampling_params import SamplingParams
from tests.model_helpers import greedy_logprobs, save_tiny_hf

pytestmark = pytest.mark.slow

STEPS = 12
LLAMA_MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                 "mlp": ("gate_proj", "up_proj", "down_proj")}
PHI3_MODULES = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}
PHI4_SHAPE = dict(pad_token_id=0, partial_rotary_factor=0.75, tie_word_embeddings=True)


def write_adapter(hf, folder, modules: dict, r: int, alpha: float, rslora=False, seed=0,
                  only=None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """A random PEFT LoRA adapter for `hf` in `folder` (`only`: these module names) -> its
    deltas by HF parameter name: (A, B, scale)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    scale = alpha / (math.sqrt(r) if rslora else r)
    for i, layer in enumerate(hf.model.layers):
        for part, names in modules.items():
            for name in names:
                if only is not None and name not in only:
                    continue
                w = getattr(getattr(layer, part), name).weight
                a = torch.randn(r, w.shape[1], generator=g) * 0.15
                b = torch.randn(w.shape[0], r, generator=g) * 0.15
                prefix = f"base_model.model.model.layers.{i}.{part}.{name}"
                tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
                deltas[f"model.layers.{i}.{part}.{name}.weight"] = (a, b, scale)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "use_rslora": rslora,
        "target_modules": sorted({n for ns in modules.values() for n in ns}), "bias": "none",
        "use_dora": False, "modules_to_save": None}))
    return deltas


def merged_greedy(hf, deltas, prompts) -> dict[str, list[int]]:
    """transformers' greedy tokens with the deltas merged into a copy of the weights."""
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        for name, (a, b, scale) in deltas.items():
            hf.state_dict()[name].add_(scale * b @ a)
        out = [hf.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
               for p in prompts]
    hf.load_state_dict(state)
    return out


def prompts_of(n: int, lengths=(41, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 256, (length,), generator=g).tolist() for length in lengths]


def engine_for(folder, adapters: dict, **kw) -> LLMEngine:
    args = dict(model=str(folder), dtype="fp32", weights="fp32", page_size=16,
                kv_device_gb=0.01, max_model_len=128, max_num_batched_tokens=32,
                lora_modules=",".join(f"{k}={v}" for k, v in adapters.items()))
    return LLMEngine(EngineArgs(**{**args, **kw}))


def generate(engine, requests: list[tuple[str, list[int], str | None]]):
    """requests (id, prompt, adapter), added together -> ({id: tokens}, {id: cached tokens})."""
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                       ignore_eos=True, lora=lora))
    got, cached = {rid: [] for rid, _, _ in requests}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    return got, cached


@pytest.mark.parametrize("kind, extra, modules", [
    ("llama", {}, LLAMA_MODULES),
    # Phi-4-mini's shape: fused qkv_proj / gate_up_proj adapted whole, q and k rows reordered
    ("phi3", PHI4_SHAPE, PHI3_MODULES)])
def test_adapters_generate_what_their_merged_weights_generate(tmp_path, kind, extra, modules):
    hf = save_tiny_hf(kind, extra, tmp_path / "model")
    prompts = prompts_of(1)
    a = write_adapter(hf, tmp_path / "a", modules, r=4, alpha=8, seed=1)
    b = write_adapter(hf, tmp_path / "b", modules, r=2, alpha=4, rslora=True, seed=2,
                      only={"q_proj", "v_proj", "qkv_proj", "down_proj"})
    want = {"base": merged_greedy(hf, {}, prompts), "a": merged_greedy(hf, a, prompts),
            "b": merged_greedy(hf, b, prompts)}
    assert want["a"] != want["base"] and want["b"] != want["base"]    # the deltas matter
    engine = engine_for(tmp_path / "model", {"a": tmp_path / "a", "b": tmp_path / "b"},
                        prefix_cache="off")
    requests = [(f"{name}{i}", p, None if name == "base" else name)
                for name in ("a", "base", "b") for i, p in enumerate(prompts)]
    got, _ = generate(engine, requests)          # all six in the same steps
    for name in want:
        assert [got[f"{name}{i}"] for i in range(len(prompts))] == want[name], name


@pytest.mark.skipif(decode_layer._layer is None, reason="C extensions not built")
@pytest.mark.parametrize("kind, extra, modules", [("llama", {}, LLAMA_MODULES),
                                                  ("phi3", PHI4_SHAPE, PHI3_MODULES)])
def test_the_one_call_decode_layers_add_the_adapters_deltas(tmp_path, monkeypatch, kind, extra,
                                                            modules):
    """Decode steps of adapter rows (two adapters and the base model in each step) run in
    the C decode layers, with our 4-bit decode weights: the tokens and log-probabilities of
    the model's layers op by op (whose deltas the test above checks against transformers)."""
    hf = save_tiny_hf(kind, extra, tmp_path / "model")
    write_adapter(hf, tmp_path / "a", modules, r=4, alpha=8, seed=1)
    write_adapter(hf, tmp_path / "b", modules, r=2, alpha=4, rslora=True, seed=2,
                  only={"q_proj", "v_proj", "qkv_proj", "down_proj"})
    monkeypatch.setattr(weight_plan, "_candidates", lambda weights, dtype, native: ["q4"])
    with_lora = []
    init = DecodeLayers.__init__
    monkeypatch.setattr(DecodeLayers, "__init__", lambda self, *a, **kw: (
        with_lora.append(kw.get("lora", a[5] if len(a) > 5 else None) is not None),
        init(self, *a, **kw))[1])
    p, q = prompts_of(5)
    prompts, loras = [p, p, q, q, p], ["a", None, "b", None, "b"]

    def decode(fused: bool):
        FusedLayers.enabled = fused
        try:
            engine = engine_for(tmp_path / "model", {"a": tmp_path / "a", "b": tmp_path / "b"},
                                prefix_cache="off", weights="int4")
            return greedy_logprobs(engine, prompts, STEPS, loras)
        finally:
            FusedLayers.enabled = True

    ref = decode(False)
    assert not with_lora
    got = decode(True)
    assert sum(with_lora) >= STEPS - 1          # every decode step, its adapter rows in C
    assert ref["r0"] != ref["r1"] and ref["r2"] != ref["r3"]        # the deltas matter
    for rid in ref:
        assert [t for t, _ in got[rid]] == [t for t, _ in ref[rid]], rid
        torch.testing.assert_close(torch.tensor([lp for _, lp in got[rid]]),
                                   torch.tensor([lp for _, lp in ref[rid]]),
                                   rtol=0, atol=2e-4)


def test_an_adapters_prompt_pages_are_its_own(tmp_path):
    hf = save_tiny_hf("llama", {}, tmp_path / "model")
    write_adapter(hf, tmp_path / "a", LLAMA_MODULES, r=4, alpha=8, seed=1)
    write_adapter(hf, tmp_path / "b", LLAMA_MODULES, r=4, alpha=8, seed=2)
    engine = engine_for(tmp_path / "model", {"a": tmp_path / "a", "b": tmp_path / "b"})
    prompt = prompts_of(2, lengths=(50,))[0]
    hits = []
    for rid, lora in (("base", None), ("a", "a"), ("b", "b"), ("a2", "a"), ("base2", None)):
        hits.append(generate(engine, [(rid, prompt, lora)])[1][rid])
    assert hits == [0, 0, 0, 48, 48]
    # a client's cache_salt that spells the adapter's salt does not reach its pages
    from dataclasses import replace
    spelled = f"lora:{engine.runner.loras['a'].fingerprint}|"
    engine.add_request("spoof", prompt, replace(SamplingParams(max_tokens=2), cache_salt=spelled))
    cached = None
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens
    assert cached == 0
    with pytest.raises(ValueError, match="no LoRA adapter named 'c'"):
        engine.add_request("c", prompt, SamplingParams(max_tokens=2, lora="c"))


@pytest.mark.parametrize("change, match", [
    (lambda c, t: c.update(use_dora=True), "use_dora"),
    (lambda c, t: c.update(peft_type="IA3"), "not LoRA"),
    (lambda c, t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}),
     "adapts no decoder projection"),
    (lambda c, t: t.update({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(7, 4)}),
     "another model's"),
])
def test_adapters_that_do_not_fit_are_refused_at_start_up(tmp_path, change, match):
    from safetensors.torch import load_file, save_file
    hf = save_tiny_hf("llama", {}, tmp_path / "model")
    write_adapter(hf, tmp_path / "a", LLAMA_MODULES, r=4, alpha=8)
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    change(conf, tensors)
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(conf))
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=match):
        engine_for(tmp_path / "model", {"a": tmp_path / "a"})


def test_lora_flags_are_checked():
    with pytest.raises(ValueError, match="not name=path"):
        EngineArgs(lora_modules="a=/x,b")
    with pytest.raises(ValueError, match="named twice"):
        EngineArgs(lora_modules="a=/x,a=/y")
    with pytest.raises(ValueError, match="kv-recompute"):
        EngineArgs(lora_modules="a=/x", kv_recompute="auto")


def test_an_adapter_loads_while_serving_and_unloads_once_unused(tmp_path):
    hf = save_tiny_hf("llama", {}, tmp_path / "model")
    write_adapter(hf, tmp_path / "a", LLAMA_MODULES, r=4, alpha=8, seed=1)
    engine = engine_for(tmp_path / "model", {})
    prompt = prompts_of(4, lengths=(20,))[0]
    engine.add_request("base", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.load_lora("a", tmp_path / "a")        # between two steps of a running request
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("a", tmp_path / "a")
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True, lora="a"))
    engine.step()
    with pytest.raises(ValueError, match="in flight"):
        engine.unload_lora("a")
    while engine.has_unfinished():
        engine.step()
    engine.unload_lora("a")
    with pytest.raises(KeyError):
        engine.unload_lora("a")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        engine.add_request("again", prompt, SamplingParams(max_tokens=2, lora="a"))


def test_an_moe_models_attention_takes_adapters_and_its_experts_refuse_them(tmp_path):
    """Qwen3-MoE: an adapter of the attention generates what transformers generates with it
    merged; one on a routed layer's MLP is refused at start-up (its MLP is the experts)."""
    from safetensors.torch import load_file, save_file
    from tests.test_model_parity import QWEN3_MOE
    hf = save_tiny_hf("qwen3_moe", dict(QWEN3_MOE, mlp_only_layers=[1]), tmp_path / "model")
    prompts = prompts_of(5)
    attn = {"self_attn": LLAMA_MODULES["self_attn"]}
    a = write_adapter(hf, tmp_path / "a", attn, r=4, alpha=8, seed=1)
    want = merged_greedy(hf, a, prompts)
    assert want != merged_greedy(hf, {}, prompts)
    engine = engine_for(tmp_path / "model", {"a": tmp_path / "a"}, prefix_cache="off")
    got, _ = generate(engine, [(f"a{i}", p, "a") for i, p in enumerate(prompts)])
    assert [got[f"a{i}"] for i in range(len(prompts))] == want
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.zeros(4, 64)
    tensors[f"{prefix}.lora_B.weight"] = torch.zeros(48, 4)
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="routed to experts"):
        engine_for(tmp_path / "model", {"a": tmp_path / "a"})
