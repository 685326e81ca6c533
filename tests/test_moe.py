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
