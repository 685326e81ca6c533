"""bench/engine_steps.py's decoding_engine with the bundled model: the steps a bench times
after it returns have every request as a row, however many steps the prompts' prefill took (the
earlier requests decode while the later ones prefill)."""
from __future__ import annotations

import pytest

from bench import engine_steps

pytestmark = pytest.mark.slow


def test_every_request_decodes_through_the_steps_the_caller_asked_for():
    # 3 x 100 prompt tokens, 128 a step: the first request decodes two tokens before the last
    # one's first, so a budget of exactly 4 tokens would end it inside the caller's 4 steps
    engine, ids = engine_steps.decoding_engine(100, 3, 4, max_num_batched_tokens=128,
                                               kv_device_gb=0.05)
    assert [len(engine.scheduler.get_request(r).output_token_ids) for r in ids] == [3, 2, 1]
    for _ in range(4):
        assert len(engine.step()) == 3
        assert engine_steps.all_decoding(engine, ids)
    while all(len(o.new_token_ids) for o in engine.step()) \
            and engine_steps.all_decoding(engine, ids):
        pass
    assert not engine_steps.all_decoding(engine, ids)
