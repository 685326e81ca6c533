"""An MoE layer's decode rows (engine/moe.py): each row through its experts in one C call
(kernels/_qmatmul.c moe_row) gives what the experts' matmuls give one by one, and the same
result whether the row decodes alone or in a batch."""
from __future__ import annotations

import pytest
import torch

from engine.model_loader import load_model
from kernels import packed_linear
from tests.model_helpers import save_tiny_hf
from tests.test_model_parity import QWEN3_MOE

pytestmark = pytest.mark.skipif(packed_linear._qmatmul is None, reason="C extensions not built")


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_decode_rows_in_one_call_equal_the_experts_matmuls(tmp_path, fmt):
    save_tiny_hf("qwen3_moe", dict(QWEN3_MOE, moe_intermediate_size=64), tmp_path)
    model = load_model(tmp_path, dtype=torch.float32, decode_format=fmt, prefill_rows=16)
    layer = model.layers[0]
    assert layer._table is not None
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        chosen, weights = layer.route(x)
        assert len(set(chosen.flatten().tolist())) > 2       # rows take different experts
        got = layer.mlp(x, None, True)                        # 5 rows < 16: one call a row
        want = layer._torch_experts(x, chosen, weights, True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        alone = torch.cat([layer.mlp(x[i:i + 1], None, True) for i in range(5)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("kind, extra", [("qwen3_moe", QWEN3_MOE),
                                         ("mixtral", {"num_local_experts": 4,
                                                      "num_experts_per_tok": 2})])
def test_the_routed_mlp_rounds_as_transformers_in_bf16(tmp_path, kind, extra):
    """bf16, bit for bit against transformers' block (its eager experts): Qwen rounds the
    top-k weights to bf16 before they scale the experts, Mixtral keeps them float32."""
    hf = save_tiny_hf(kind, extra, tmp_path).to(torch.bfloat16)
    hf.config._experts_implementation = "eager"
    block = hf.model.layers[0].mlp
    block.experts.config._experts_implementation = "eager"
    ours = load_model(tmp_path, dtype=torch.bfloat16).layers[0]
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours.mlp(x, None, False), block(x[None])[0])


def test_an_expert_of_codes_and_floats_loads_whole(tmp_path):
    """A file with mixed tensor types: each expert's gate as 8-bit codes, its up as floats.
    The codes kept for packing complete no matmul; they are dequantized into the dense
    weight at the end of loading, so the model equals one loaded from those values as floats
    (the same decode form packed from them), and its prefill is transformers'."""
    from engine.llama import LlamaForCausalLM
    from engine.model_config import ModelConfig
    from engine.model_loader import iter_safetensors
    from kernels.packed_linear import quantize_int8
    from tests.kv_cache import make_kv_cache
    from tests.model_helpers import PagedSequence, page_pool, step
    save_tiny_hf("qwen3_moe", dict(QWEN3_MOE, moe_intermediate_size=64), tmp_path)
    cfg = ModelConfig.from_hf(tmp_path)

    def loaded(gate) -> LlamaForCausalLM:
        model = LlamaForCausalLM(cfg, dtype=torch.float32, max_model_len=64)
        model.load_weights(((n, gate(t) if n.endswith("gate_proj.weight") else t)
                            for n, t in iter_safetensors(tmp_path)), "q8")
        model.pack("q8", 16)
        return model

    def logits(model) -> torch.Tensor:
        tokens = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(2))
        seq = PagedSequence(tokens.tolist(), page_pool(16))
        return step(model, make_kv_cache(model, 16, 4), [(seq, 20)])[0]

    mixed = loaded(quantize_int8)
    assert not mixed.layers[0]._parts and not mixed.layers[0]._coded
    floats = loaded(lambda t: quantize_int8(t).dequantize())
    assert torch.equal(logits(mixed), logits(floats))
