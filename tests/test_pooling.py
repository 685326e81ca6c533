"""Embedding requests in the engine (SamplingParams.pooling): the prompt's final hidden state,
of its last token or the mean of all, L2-normalized, equal to transformers' for the bundled
model, whether the prompt is prefilled whole or in chunks, beside generating requests, and
with its pages from the prefix cache (last) or computed whole (mean)."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams

TEXTS = ["The harbour log lists ships, cargo and weather for each day of the week. " * 3,
         "Disks are slow; memory is fast.", "Hi"]


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    """transformers' final hidden states of each text, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            out[text] = (ids, hf(torch.tensor([ids]), output_hidden_states=True)
                         .hidden_states[-1][0])
    return out


def _embed(engine, prompts, pooling, extra=()):
    ids = [f"e{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(max_tokens=1, temperature=0.0,
                                                  pooling=pooling))
    for rid, p in extra:
        engine.add_request(rid, p, SamplingParams(max_tokens=8, temperature=0.0))
    got, tokens = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.embedding is not None:
                assert out.finished and out.request_id not in got
                # it ends once its prompt is computed, sampling nothing
                assert out.finish_reason == "stop" and out.num_output_tokens == 0
                got[out.request_id] = torch.tensor(out.embedding)
    return [got[rid] for rid in ids], tokens


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("chunk", [2048, 16])
def test_pooled_hidden_states_equal_transformers(smollm2_dir, reference, pooling, chunk):
    engine = LLMEngine(EngineArgs(model=str(smollm2_dir), dtype="fp32", weights="fp32",
                                  max_num_batched_tokens=chunk, prefix_cache="on"))
    prompts = [reference[t][0] for t in TEXTS]
    # a generating request beside them, and the first text again: its pages are cached
    # by then (last pooling reads them; mean pooling computes its prompt whole)
    got, tokens = _embed(engine, prompts + [prompts[0]], pooling,
                         extra=[("g", prompts[1])])
    for text, v in zip(TEXTS + TEXTS[:1], got):
        hidden = reference[text][1]
        want = _unit(hidden[-1] if pooling == "last" else hidden.mean(0))
        assert abs(v.norm() - 1) < 1e-5
        assert torch.dot(v, want) > 0.9999, (text, pooling, chunk)
    assert len(tokens["g"]) == 8
    assert all(tokens[f"e{i}"] == [] for i in range(len(got)))


def test_a_recomputed_prompt_starts_its_mean_again():
    # a preempted embedding request prefills again from position 0: its sum restarts, and
    # the embedding is made once, on the chunk that ends the prompt
    from engine.pooling import Pooler
    pooler = Pooler()
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 3.0]])
    pooler.add("r", a, "mean", restart=True, final=False, num_prompt_tokens=2)
    pooler.add("r", a * 100, "mean", restart=True, final=False, num_prompt_tokens=2)  # again
    assert pooler.take("r") is None
    pooler.add("r", b, "mean", restart=False, final=True, num_prompt_tokens=2)
    want = _unit(torch.tensor([100.0, 3.0]) / 2)
    assert torch.allclose(torch.tensor(pooler.take("r")), want) and pooler.take("r") is None
    assert Pooler.rows("last", 5, 3, final=False) == [] and Pooler.rows("last", 5, 3, True) == [7]
    assert Pooler.rows("mean", 5, 3, final=False) == [5, 6, 7]
