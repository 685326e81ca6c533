"""bench/attention_bw.py runs the real C kernel over each slot order and writes its rows."""
from __future__ import annotations

import json

import pytest

from kernels.sparse_attention import native_decode_built


@pytest.mark.skipif(not native_decode_built(), reason="C kernel not built")
def test_every_slot_order_batch_and_thread_count_gets_a_row(tmp_path):
    from bench import attention_bw

    out = tmp_path / "bw.json"
    attention_bw.main(["--batch", "1", "2", "--context", "300", "--threads", "1", "2",
                       "--rounds", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["bench"] == "attention_bw" and result["machine"]["cpu"]
    cells = {(r["order"], r["batch"], r["threads"]) for r in result["rows"]}
    assert cells == {(o, b, t) for o in attention_bw.ORDERS for b in (1, 2) for t in (1, 2)}
    assert all(r["ms_per_layer"] > 0 and r["gb_s"] > 0 for r in result["rows"])
