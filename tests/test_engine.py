"""LLMEngine end to end on the real SmolLM2: greedy parity with transformers in a mixed batch,
through chunked prefill and preemption."""
from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs, default_cache_dir
from engine.gguf_convert import ensure_hf_folder
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then list three colours of the rainbow.",
    "Hi",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def folder():
    return ensure_hf_folder(None, default_cache_dir())


@pytest.fixture(scope="module")
def prompt_ids(folder):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                    add_generation_prompt=True, return_dict=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_greedy(folder, prompt_ids):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for ids in prompt_ids:
        with torch.inference_mode():
            # NOTE: an eos id the model never emits, so both sides run all NEW_TOKENS steps
            no_eos = model.config.vocab_size - 1
            g = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=no_eos, pad_token_id=no_eos)
        outs.append(g[0, len(ids):].tolist())
    return outs


def run_all(engine: LLMEngine, prompt_ids, max_tokens=NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", ids, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        steps += 1
        assert steps < 10_000
    return [got[f"r{i}"] for i in range(len(prompt_ids))]


def test_greedy_mixed_batch_equals_transformers_generate(folder, prompt_ids, hf_greedy):
    # a small token budget forces chunked prefill of the longer prompts beside running decodes
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="fp32", max_num_batched_tokens=24,
                                  kv_device_gb=0.05))
    assert run_all(engine, prompt_ids) == hf_greedy
    assert engine.allocator.num_used_pages == 0


def test_greedy_alone_equals_transformers_generate(folder, prompt_ids, hf_greedy):
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="fp32", kv_device_gb=0.05))
    for i, ids in enumerate(prompt_ids[:2]):
        assert run_all(engine, [ids]) == [hf_greedy[i]]


def test_preemption_recomputes_and_keeps_greedy_output(folder, prompt_ids, hf_greedy):
    # KV for ~2 requests only: the newest is preempted, recomputed later, and still matches
    c_tokens = max(len(p) for p in prompt_ids) + NEW_TOKENS
    page_bytes = 30 * 2 * 16 * 3 * 64 * 4
    pages = 2 * (-(-c_tokens // 16)) + 1
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="fp32",
                                  kv_device_gb=pages * page_bytes / 2**30))
    assert run_all(engine, prompt_ids) == hf_greedy
    assert engine.num_preemptions > 0
    assert engine.allocator.num_used_pages == 0


def test_each_step_runs_on_the_threads_of_its_kind(folder, prompt_ids, hf_greedy):
    """use_threads (the server turns it on): a step with prompt tokens runs on the prefill
    threads, a step that only decodes on the decode threads (as --decode-threads fixes them;
    left to the engine, tests/test_core_split.py); greedy output is unchanged."""
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="fp32", max_num_batched_tokens=24,
                                  kv_device_gb=0.05, decode_threads=1))
    engine.use_threads(2, 1)
    seen = []
    execute = engine.runner.execute

    def recording(batch, requests):
        seen.append((batch.num_tokens == len(batch.requests), torch.get_num_threads()))
        return execute(batch, requests)

    engine.runner.execute = recording
    before = torch.get_num_threads()
    try:
        assert run_all(engine, prompt_ids) == hf_greedy
    finally:
        torch.set_num_threads(before)
    assert {n for decode_only, n in seen if not decode_only} == {2}
    assert {n for decode_only, n in seen if decode_only} == {1}
    with pytest.raises(ValueError, match="threads must be >= 1"):
        engine.use_threads(2, 0)


def test_the_server_engine_runs_steps_on_the_threads_its_args_ask_for(folder):
    """AsyncEngine (what `strata serve` runs) turns use_threads on with EngineArgs.torch_threads."""
    from engine.async_engine import AsyncEngine
    before = torch.get_num_threads()
    server = AsyncEngine(EngineArgs(model=str(folder), dtype="fp32", kv_device_gb=0.05,
                                    pipeline="sfc", threads=2))
    try:
        server.start()
        assert server.engine.threads == (2, 1)
        # sfc's stage threads run beside the attention kernel: it keeps to the decode count
        assert server.engine.store.sparse_attention.threads == 1
        server.engine.store.use_pipeline("sequential")
        server.engine.use_threads(2, 1)      # sequential: nothing computes beside attention
        assert server.engine.store.sparse_attention.threads == 2
        # the C page selection runs on the attention's pool, with its threads
        assert server.engine.store.selection.threads == 2
        assert server.engine.core_split is not None     # (and decode steps time the split)
    finally:
        server.shutdown()
        torch.set_num_threads(before)


@pytest.mark.parametrize("pipeline,threads,decode,want", [
    ("sequential", 2, 0, (2, 1)),    # and the server's HTTP threads
    ("sfc", 2, 0, (2, 1)),           # decode leaves the stage threads a core
    ("layer-ahead", 4, 0, (4, 3)),
    ("sfc", 1, 0, (1, 1)),
    ("sfc", 2, 2, (2, 2)),           # --decode-threads wins
])
def test_decode_threads_default_leaves_the_pipeline_stages_a_core(pipeline, threads, decode, want):
    assert EngineArgs(pipeline=pipeline, threads=threads,
                      decode_threads=decode).torch_threads() == want


def test_negative_thread_counts_are_refused():
    with pytest.raises(ValueError, match="--decode-threads must be >= 0"):
        EngineArgs(decode_threads=-1)
    with pytest.raises(ValueError, match="--threads must be >= 0"):
        EngineArgs(threads=-2)
