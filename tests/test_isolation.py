"""One request's failure inside an engine step ends that request only: the others in the same
step go on and produce exactly the tokens they produce alone."""
from __future__ import annotations

import pytest

import engine.request_sampling as request_sampling
from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from scheduler.sampling_params import SamplingParams
from tests.engine_helpers import drive

BAD_SEED = 666


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)


PROMPTS = {"a": ([5, 6, 7, 8, 9], 1), "b": ([10, 11, 12], 2), "c": ([13, 14, 15, 16], 3)}


def run(folder, requests: dict) -> tuple[dict, dict]:
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="fp32", kv_device_gb=0.01))
    for rid, (prompt, seed) in requests.items():
        engine.add_request(rid, prompt, sampled(seed))
    return drive(engine, list(requests))


@pytest.fixture(scope="module")
def alone(tiny_folder):
    return {rid: run(tiny_folder, {rid: req})[0][rid] for rid, req in PROMPTS.items()}


def test_a_failing_generator_ends_its_request_alone(tiny_folder, alone, monkeypatch):
    real = request_sampling.make_generator

    def make_generator(seed, *a, **kw):
        if seed == BAD_SEED:
            raise OverflowError("Overflow when unpacking long long")
        return real(seed, *a, **kw)

    monkeypatch.setattr(request_sampling, "make_generator", make_generator)
    got, errors = run(tiny_folder, {**PROMPTS, "bad": ([20, 21, 22], BAD_SEED)})
    assert set(errors) == {"bad"} and "Overflow" in errors["bad"]
    assert {rid: got[rid] for rid in PROMPTS} == alone


def test_a_row_that_breaks_the_batch_sampler_ends_alone(tiny_folder, alone, monkeypatch):
    real = request_sampling.Sampler.sample

    def sample(self, logits, params, *a, **kw):
        if any(p.seed == BAD_SEED for p in params):
            raise RuntimeError("bad row")
        return real(self, logits, params, *a, **kw)

    monkeypatch.setattr(request_sampling.Sampler, "sample", sample)
    got, errors = run(tiny_folder, {**PROMPTS, "bad": ([20, 21, 22], BAD_SEED)})
    assert set(errors) == {"bad"} and "bad row" in errors["bad"]
    assert {rid: got[rid] for rid in PROMPTS} == alone


def test_a_batch_that_fails_after_its_draws_is_redrawn_as_it_was(tiny_folder, alone,
                                                                   monkeypatch):
    """The batch fails after every row drew (and Mirostat updated its mu): the row-by-row
    retry must start from the draws' state before the batch, or the seeded rows take a
    second uniform and Mirostat's mu moves twice."""
    miro = {"m": ([30, 31, 32, 33], 4)}
    mirostat = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True,
                              mirostat=2, mirostat_tau=3.0, mirostat_eta=0.5)

    def start(requests):
        engine = LLMEngine(EngineArgs(model=str(tiny_folder), dtype="fp32", kv_device_gb=0.01))
        for rid, (prompt, seed) in requests.items():
            engine.add_request(rid, prompt, mirostat if rid == "m" else sampled(seed))
        return drive(engine, list(requests))

    alone_m = start(miro)[0]["m"]
    real = request_sampling.Sampler.sample

    def sample(self, logits, params, *a, **kw):
        out = real(self, logits, params, *a, **kw)
        if len(params) > 1 and any(p.seed == BAD_SEED for p in params):
            raise RuntimeError("bad batch")
        if any(p.seed == BAD_SEED for p in params):
            raise RuntimeError("bad row")
        return out

    monkeypatch.setattr(request_sampling.Sampler, "sample", sample)
    got, errors = start({**PROMPTS, **miro, "bad": ([20, 21, 22], BAD_SEED)})
    assert set(errors) == {"bad"} and "bad row" in errors["bad"]
    assert {rid: got[rid] for rid in PROMPTS} == alone and got["m"] == alone_m


def test_a_duplicate_id_is_refused_and_the_request_holding_it_goes_on(tiny_folder, alone):
    """A second request with a running request's id used to overwrite its KV record and then
    free its pages (and was reported as "too large")."""
    from engine.llm_engine import DuplicateRequestId
    engine = LLMEngine(EngineArgs(model=str(tiny_folder), dtype="fp32", kv_device_gb=0.01))
    prompt, seed = PROMPTS["a"]
    engine.add_request("a", prompt, sampled(seed))
    first = [t for out in engine.step() for t in out.new_token_ids]
    with pytest.raises(DuplicateRequestId, match="already in use"):
        engine.add_request("a", [1, 2, 3], sampled(9))
    got, errors = drive(engine, ["a"])
    assert not errors and first + got["a"] == alone["a"]
