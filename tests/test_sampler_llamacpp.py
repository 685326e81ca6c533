"""llama.cpp's samplers (engine/sampler_llamacpp.py) against independent references and their
defining properties: typical sampling equals transformers' TypicalLogitsWarper, top-n-sigma
keeps exactly the logits within n standard deviations of the top, XTC removes every top
choice but the least likely one, dynamic temperature spans its range with the entropy,
Mirostat holds the observed surprise at tau, and llama.cpp's repeat_last_n window."""
from __future__ import annotations

import math

import pytest
import torch

from engine import sampler_llamacpp as lcpp
from engine.sampler import Sampler, make_generator
from scheduler.sampling_params import SamplingParams


def zipf(vocab: int = 500, s: float = 1.1) -> torch.Tensor:
    """Logits of a Zipf distribution (what Mirostat models text as), in a shuffled order."""
    g = torch.Generator().manual_seed(3)
    logits = -s * torch.arange(1, vocab + 1, dtype=torch.float32).log()
    return logits[torch.randperm(vocab, generator=g)]


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_keeps_what_transformers_typical_warper_keeps(mass):
    from transformers.generation.logits_process import TypicalLogitsWarper
    g = torch.Generator().manual_seed(int(mass * 100))
    for _ in range(5):
        row = torch.randn(1000, generator=g) * 3
        row[torch.randperm(1000, generator=g)[:50]] = float("-inf")    # excluded already
        ours = row.clone()
        lcpp.typical(ours, mass)
        want = TypicalLogitsWarper(mass, min_tokens_to_keep=1)(None, row[None].clone())[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(want))


def test_top_n_sigma_keeps_the_logits_within_n_deviations_of_the_top():
    row = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, float("-inf")])
    finite = row[:5]
    cutoff = 5.0 - 1.0 * float(finite.std(unbiased=False))     # 5 - 2.15
    kept = row.clone()
    lcpp.top_n_sigma(kept, 1.0)
    assert torch.isfinite(kept).tolist() == [v >= cutoff for v in row.tolist()]
    assert torch.isfinite(kept).tolist() == [True, True, True, False, False, False]
    off = row.clone()
    lcpp.top_n_sigma(off, 0.0)
    assert torch.equal(off, row)


def test_xtc_removes_the_top_choices_but_their_least_likely():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    row = probs.log()
    cut = row.clone()
    lcpp.xtc(cut, probability=1.0, threshold=0.12, generator=make_generator(0))
    assert torch.isfinite(cut).tolist() == [False, False, True, True, True]
    one = row.clone()            # a single token above the threshold stays
    lcpp.xtc(one, probability=1.0, threshold=0.35, generator=make_generator(0))
    assert torch.equal(one, row)
    high = row.clone()           # above 0.5 never has two tokens: off
    lcpp.xtc(high, probability=1.0, threshold=0.6, generator=make_generator(0))
    assert torch.equal(high, row)
    # with probability 0.5 it applies to about half of the draws
    g, hits = make_generator(1), 0
    for _ in range(400):
        r = row.clone()
        lcpp.xtc(r, probability=0.5, threshold=0.12, generator=g)
        hits += int(torch.isinf(r[0]))
    assert 150 < hits < 250


def test_dynamic_temperature_spans_its_range_with_the_entropy():
    flat = torch.zeros(100)
    assert lcpp.dynamic_temperature(flat, 1.0, 0.5, 1.0) == pytest.approx(1.5)
    peaked = torch.full((100,), -50.0)
    peaked[0] = 50.0
    assert lcpp.dynamic_temperature(peaked, 1.0, 0.5, 1.0) == pytest.approx(0.5, abs=1e-3)
    half = torch.tensor([0.0, 0.0] + [float("-inf")] * 2)    # 2 candidates, uniform: max
    assert lcpp.dynamic_temperature(half, 0.8, 0.3, 2.0) == pytest.approx(1.1)


@pytest.mark.parametrize("version, tau", [(2, 3.0), (2, 5.0), (1, 4.0)])
def test_mirostat_holds_the_observed_surprise_at_tau(version, tau):
    # Mirostat's feedback: the surprise of each token in the distribution it drew from
    # (truncated, renormalized) is read back from its update of mu; mu settles, and that
    # surprise averages tau. The same tokens' surprise under the whole distribution is a little
    # higher (the truncation's mass is < 1), never lower.
    row, eta = zipf(), 0.1
    state, g = lcpp.MirostatState(2 * tau), make_generator(7)
    p = torch.softmax(row, dim=-1)
    drawn, whole, mus = [], [], []
    for _ in range(3000):
        before = state.mu
        token = lcpp.mirostat(row, version, tau, eta, state, float(torch.rand((), generator=g)))
        drawn.append(tau + (before - state.mu) / eta)
        whole.append(-math.log2(float(p[token])))
        mus.append(state.mu)
    assert abs(sum(drawn[1000:]) / 2000 - tau) < 0.05
    assert tau <= sum(whole[1000:]) / 2000 < tau + 1.0
    assert max(mus[1000:]) - min(mus[1000:]) < 4 * tau       # settled, not drifting


def test_a_mirostat_row_draws_by_mirostat_within_a_batch_and_keeps_its_state():
    logits = torch.stack([zipf(), zipf()])
    params = [SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=2.0, seed=5),
              SamplingParams(temperature=1.0, seed=5)]
    states = [lcpp.MirostatState(4.0), None]
    sampler = Sampler()
    gens = [make_generator(5), make_generator(5)]
    seen = set()
    for _ in range(200):
        out = sampler.sample(logits, params, [[], []], gens, states=states)
        seen.add(out.token_ids[0])
    p = torch.softmax(zipf(), dim=-1)
    # a target surprise of 2 bits: only the few most likely tokens are ever drawn
    assert max(-math.log2(float(p[t])) for t in seen) < 8
    assert states[0].mu != 4.0


def test_repeat_last_n_penalizes_only_the_window():
    logits = torch.zeros(1, 20)
    logits[0, :] = 2.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, repetition_window=3,
                             logprobs=20)]
    out = Sampler().sample(logits, params, [[7, 8]], [None], prompt_token_ids=[[1, 2, 3]])
    # the last 3 of prompt + output are 3, 7, 8: their logits halved, the others not
    lp = {t.token_id: t.logprob for t in out.logprobs[0][1]}
    assert lp[3] == lp[7] == lp[8] < lp[1] == lp[2] == lp[0]


def _dry_reference(context, multiplier, base, allowed, breakers, vocab):
    """DRY by its definition, brute force: for each token t, the longest k such that the
    context's last k tokens occur earlier, followed by t, with no breaker inside."""
    pen = [0.0] * vocab
    n = len(context)
    if not n or context[-1] in breakers:
        return pen
    for t in range(vocab):
        best = 0
        for end in range(n - 1):              # an earlier stretch ending at `end`, then t
            if context[end + 1] != t or t in breakers:
                continue
            k = 0
            while k <= end and context[end - k] == context[n - 1 - k] \
                    and context[n - 1 - k] not in breakers:
                k += 1
            best = max(best, k)
        if best >= allowed:
            pen[t] = multiplier * base ** (best - allowed)
    return pen


def test_dry_penalizes_what_would_extend_a_repeat_by_its_length():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        vocab = 6
        context = torch.randint(0, vocab, (40,), generator=g).tolist()
        context += context[5:12]               # a planted repeat of 7 tokens
        breakers = frozenset({5}) if trial % 2 else frozenset()
        row = torch.zeros(vocab)
        lcpp.dry(row, context, 0.8, 1.75, 2, breakers)
        want = _dry_reference(context, 0.8, 1.75, 2, breakers, vocab)
        assert torch.allclose(-row, torch.tensor(want)), (trial, context)


def test_dry_rows_in_a_batch_penalize_from_their_own_context():
    logits = torch.zeros(2, 10)
    params = [SamplingParams(temperature=0.0, dry_multiplier=1.0, dry_allowed_length=2,
                             logprobs=10),
              SamplingParams(temperature=0.0, logprobs=10)]
    # prompt 1 2 3 4, output 1 2 3: DRY sees "1 2 3" repeat, followed by 4 before
    out = Sampler().sample(logits, params, [[1, 2, 3], [1, 2, 3]], [None, None],
                           dry_prompts=[[1, 2, 3, 4], []])
    lp = {t.token_id: t.logprob for t in out.logprobs[0][1]}
    assert lp[4] < lp[0] and out.token_ids[0] != 4
    assert len({t.logprob for t in out.logprobs[1][1]}) == 1       # the other row: untouched


def test_dry_over_a_long_repeat_bans_the_next_repeat_without_overflowing():
    # 5000 times the same token: the repeat is as long as the context; its follower (the
    # token itself) is penalized by DRY's bound, not by base^4998
    row = torch.zeros(8)
    lcpp.dry(row, [3] * 5000, 0.8, 1.75, 2, frozenset())
    assert row[3] == -lcpp.DRY_MAX_PENALTY and torch.all(row[[0, 1, 2, 4, 5, 6, 7]] == 0)
    row = torch.zeros(8)                       # a breaker every 10 tokens bounds the repeats
    lcpp.dry(row, ([3] * 9 + [5]) * 500 + [3] * 4, 0.8, 1.75, 2, frozenset({5}))
    assert -row[3] == pytest.approx(0.8 * 1.75 ** (4 - 2))      # the tail's 4 tokens
