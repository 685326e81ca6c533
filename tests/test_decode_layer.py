"""A decode step's layers as one C call each (kernels/decode_layer.py, kernels/_layer.c)
against the model's layers op by op: the same greedy tokens and log-probabilities, bit for bit
(the same C ops in the same order), the path taken where it serves and not where it does not,
and a bad slot failing the call alone, nothing written."""
from __future__ import annotations

import pytest
import torch

from engine import weight_plan
from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from kernels import decode_layer, layer_ops
from kernels.decode_layer import DecodeLayers, FusedLayers, SparseWords
from kvstore.resident import ResidentDecode
from scheduler.sampling_params import SamplingParams
from tests.model_helpers import greedy_logprobs, save_tiny_hf

pytestmark = pytest.mark.skipif(decode_layer._layer is None, reason="C extensions not built")
# the sparse table's word of the selection's marks count (_layer.c's P_N_KEYS)
_N_KEYS = 15


def test_silu_mul_is_torchs_within_a_few_float32_ulp():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(5, 2 * 1000, generator=g) * torch.tensor([0.01, 1, 8, 40, 200])[:, None]
    gate_up[0, :6] = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-30, -1e-30])
    ref = torch.nn.functional.silu(gate_up[:, :1000]) * gate_up[:, 1000:]
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), ref, rtol=2e-6, atol=1e-30)
    wide = torch.randn(3, 2500, generator=g)[:, :2000]          # rows of a wider tensor
    torch.testing.assert_close(layer_ops.silu_mul(wide),
                               torch.nn.functional.silu(wide[:, :1000]) * wide[:, 1000:],
                               rtol=2e-6, atol=1e-30)
    assert layer_ops.silu_mul(torch.tensor([[float("nan"), 1.0]]))[0, 0].isnan()
    assert layer_ops.silu_mul(gate_up.bfloat16()) is None


@pytest.fixture
def runs(monkeypatch):
    """Counts the layers run in one call. --weights native means our kernel (not a start-up
    timing against torch's packed one, which this path does not run)."""
    original_candidates = weight_plan._candidates
    monkeypatch.setattr(weight_plan, "_candidates", lambda weights, dtype, native: (
        ["native"] if weights == "native" else original_candidates(weights, dtype, native)))
    made = []
    original = DecodeLayers.run

    def run(self, *args):
        made.append(args[0])
        return original(self, *args)

    monkeypatch.setattr(DecodeLayers, "run", run)
    return made


def decode(folder, prompts, fused: bool, steps: int = 24, **kw):
    """Greedy tokens of the bundled GGUF (folder: its converted form, made by the fixture)."""
    FusedLayers.enabled = fused
    try:
        args = dict(model="bundled", page_size=16, prefix_cache="off", dtype="fp32",
                    weights="native", kv_device_gb=0.5)
        engine = LLMEngine(EngineArgs(**{**args, **kw}))
        return greedy_logprobs(engine, prompts, steps), engine
    finally:
        FusedLayers.enabled = True


def prompts_of(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (length + 13 * i,), generator=gen).tolist()
            for i in range(n)]


def same(a: dict, b: dict) -> None:
    for rid in a:
        assert [t for t, _ in a[rid]] == [t for t, _ in b[rid]], rid
        torch.testing.assert_close(torch.tensor([lp for _, lp in a[rid]]),
                                   torch.tensor([lp for _, lp in b[rid]]), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["fp32", "auto", "bf16"])
def test_one_call_layers_decode_as_the_layers_do(smollm2_dir, runs, dtype):
    # three sequences of awkward lengths (partial last pages; one crosses a page boundary
    # while decoding); fp32: a float32 KV pool; auto: bf16 KV and this CPU's activations
    prompts = prompts_of(3, 37)
    ref, _ = decode(smollm2_dir, prompts, False, dtype=dtype)
    assert not runs
    got, engine = decode(smollm2_dir, prompts, True, dtype=dtype)
    assert len(runs) >= 20 * engine.runner.model.config.num_hidden_layers
    if engine.weight_plan.dtype == "fp32":
        same(got, ref)
        return
    # bf16 activations: the C layers decode float32 copies of the rows, where the layers op
    # by op round every op to bf16: the same first token (the prefill's), then close
    for rid in ref:
        (t0, lp0), *rest = got[rid]
        assert (t0, lp0) == ref[rid][0]
        agree = [abs(a[1] - b[1]) for a, b in zip(rest, ref[rid][1:]) if a[0] == b[0]]
        assert len(agree) >= len(rest) // 2 and max(agree) < 0.5, (rid, agree)


def test_a_bf16_norms_float32_copy_keeps_its_address():
    """The C layers' words hold the float32 copy's address: a changed weight refreshes the
    copy in place, never a new tensor (the old one freed under the words)."""
    from engine.norm import RMSNorm
    norm = RMSNorm(8, 1e-6, torch.bfloat16, "cpu")
    with torch.no_grad():
        norm.weight.fill_(2)
    copy = norm.float32()
    address = copy.weight.data_ptr()
    assert copy.weight.dtype == torch.float32 and torch.equal(copy.weight, torch.full((8,), 2.))
    with torch.no_grad():
        norm.weight.fill_(3)
    again = norm.float32()
    assert again.weight.data_ptr() == address and torch.equal(again.weight, torch.full((8,), 3.))


def test_not_taken_where_it_does_not_serve(smollm2_dir, runs):
    prompts = prompts_of(2, 40)
    decode(smollm2_dir, prompts, True, steps=4, weights="fp32")    # dense decode weights
    assert not runs


def test_sparse_steps_where_the_budget_covers_the_context(smollm2_dir, runs):
    # a sparse budget above the context: dense attention, summaries kept for later selection
    prompts = prompts_of(2, 40)
    ref, _ = decode(smollm2_dir, prompts, False, sparse_budget=1024)
    got, _ = decode(smollm2_dir, prompts, True, sparse_budget=1024)
    same(got, ref)
    assert runs


def count_selections(monkeypatch) -> tuple[list, list]:
    """The sparse layers' selections made in the layer's C call (SparseWords) and between a
    split layer's two calls."""
    fused, split = [], []
    result, attend = SparseWords.result, ResidentDecode._attend_sparse_layer
    monkeypatch.setattr(SparseWords, "result",
                        lambda self, layer: fused.append(layer) or result(self, layer))
    monkeypatch.setattr(ResidentDecode, "_attend_sparse_layer",
                        lambda self, *a: split.append(a[0]) or attend(self, *a))
    return fused, split


@pytest.mark.parametrize("fused_sparse", [True, False], ids=["one-call", "two-calls"])
def test_sparse_decode_layers_select_in_the_layers_call(smollm2_dir, runs, monkeypatch,
                                                        fused_sparse):
    # contexts past the budget: a sparse layer selects its pages and attends to them in its
    # one call (on steps where a page fills too: summarized after the call, the same pages);
    # or, switched off, in two calls around the KV store's selection and attention
    prompts = prompts_of(2, 300)
    kw = dict(sparse_budget=128, sparse_threshold=128, steps=20)
    ref, _ = decode(smollm2_dir, prompts, False, **kw)
    fused, split = count_selections(monkeypatch)
    monkeypatch.setattr(SparseWords, "enabled", fused_sparse)
    got, engine = decode(smollm2_dir, prompts, True, **kw)
    same(got, ref)
    sparse_layers = engine.runner.model.config.num_hidden_layers \
        - engine.args.kv_store_config().dense_layers
    assert len(runs) >= 15 * engine.runner.model.config.num_hidden_layers
    used, unused = (fused, split) if fused_sparse else (split, fused)
    assert len(used) >= 15 * sparse_layers and not unused


def test_a_bad_selection_fails_the_layers_call(smollm2_dir, runs, monkeypatch):
    # the sparse table's marks made too short for the selected pages' keys: that call raises
    # a ValueError, the next one (restored) completes the step
    engine = LLMEngine(EngineArgs(model="bundled", page_size=16, dtype="fp32",
                                  weights="native", kv_device_gb=0.5, prefix_cache="off",
                                  sparse_budget=64))
    engine.add_request("r", prompts_of(1, 200)[0], SamplingParams(max_tokens=8, temperature=0,
                                                                  ignore_eos=True))
    fused, _ = count_selections(monkeypatch)
    engine.step()
    failed = []
    original = DecodeLayers.run

    def run(self, layer, eps, scale):
        sp = self.kv.sparse
        if sp is not None and sp.sparse[layer] and not failed:
            keys = sp.words[_N_KEYS].item()
            sp.words[_N_KEYS] = 1
            with pytest.raises(ValueError, match="selection"):
                original(self, layer, eps, scale)
            sp.words[_N_KEYS] = keys
            failed.append(layer)
        return original(self, layer, eps, scale)

    monkeypatch.setattr(DecodeLayers, "run", run)
    outs = engine.step()
    assert failed == [engine.args.kv_store_config().dense_layers] and fused
    assert outs[0].finish_reason != "error"


def test_a_bad_slot_fails_the_call_and_writes_nothing(smollm2_dir, runs):
    engine = LLMEngine(EngineArgs(model="bundled", page_size=16, dtype="fp32",
                                  weights="native", kv_device_gb=0.1, prefix_cache="off"))
    engine.add_request("r", prompts_of(1, 20)[0], SamplingParams(max_tokens=8, temperature=0,
                                                                 ignore_eos=True))
    engine.step()
    seen = []
    original = DecodeLayers.run

    def run(self, layer, eps, scale):
        if not seen:        # the first layer: its token's slot past the pool, then restored
            slots = self.kv.tok_slots
            good = int(slots[layer, 0])
            slots[layer, 0] = self.kv.pool.shape[0] + 5
            x, pool = self.x.clone(), self.kv.pool.clone()
            with pytest.raises(IndexError, match="out of range"):
                original(self, layer, eps, scale)
            assert torch.equal(self.x, x) and torch.equal(self.kv.pool, pool)
            slots[layer, 0] = good
        seen.append(layer)
        return original(self, layer, eps, scale)

    DecodeLayers.run = run
    try:
        outs = engine.step()
    finally:
        DecodeLayers.run = original
    # every layer ran (the first twice: the failed call, then the good one)
    assert seen == list(range(30)) and runs[:2] == [0, 0] and outs[0].finish_reason != "error"


@pytest.mark.parametrize("kind, extra", [
    ("qwen3", {"head_dim": 32}),                                    # per-head q/k norms
    ("smollm3", {"no_rope_layers": [0, 1], "pad_token_id": 0}),     # a layer without RoPE
    ("phi3", {"pad_token_id": 0, "partial_rotary_factor": 0.75}),   # 12 of 16 dims rotated
])
def test_other_layer_shapes_run_in_the_layers_call(tmp_path, runs, monkeypatch, kind, extra):
    # a tiny Qwen3 (each q and k head RMS-normed before RoPE), SmolLM3 (NoPE layers) or Phi-3
    # (fused checkpoint weights, partial rotary) in our 4-bit decode form: the one-call layers
    # give the op-by-op layers' tokens and log-probabilities bit for bit
    save_tiny_hf(kind, extra, tmp_path)
    monkeypatch.setattr(weight_plan, "_candidates", lambda weights, dtype, native: ["q4"])
    prompts = [p[:40] for p in prompts_of(3, 30)]
    prompts = [[t % 256 for t in p] for p in prompts]
    kw = dict(model=str(tmp_path), max_model_len=128, kv_device_gb=0.01, weights="int4",
              steps=20)
    ref, _ = decode(None, prompts, False, **kw)
    assert not runs
    got, engine = decode(None, prompts, True, **kw)
    same(got, ref)
    assert len(runs) >= 15 * engine.runner.model.config.num_hidden_layers
