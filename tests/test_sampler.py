import math

import pytest
import torch

from engine.outputs import TokenLogprob
from engine.sampler import Sampler, make_generator
from scheduler.sampling_params import SamplingParams

V = 49152


def sample(logits, params, outputs=None, gens=None, banned=None, sampler=None):
    n = logits.shape[0]
    sampler = sampler or Sampler(seed=0)
    return sampler.sample(logits, params, outputs or [[] for _ in range(n)],
                          gens or [None] * n, banned_token_ids=banned)


def rand_logits(rows, vocab=V, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_argmax():
    logits = rand_logits(8)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_top_k_one_equals_greedy():
    logits = rand_logits(6, seed=1)
    out = sample(logits, [SamplingParams(temperature=1.3, top_k=1)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_small_top_p_keeps_only_the_top_token():
    logits = rand_logits(6, seed=2)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for s in range(200):
        seen |= set(sample(logits, [SamplingParams(top_p=0.8)], sampler=Sampler(seed=s)).token_ids)
    assert seen == {0, 1}                                 # 0.5 + 0.3 >= 0.8
    seen = set()
    for s in range(200):
        seen |= set(sample(logits, [SamplingParams(top_p=0.81)], sampler=Sampler(seed=s)).token_ids)
    assert seen == {0, 1, 2}
    # top-k first, then the nucleus over the renormalized top-k: 0.5/0.95 + 0.3/0.95 >= 0.81
    seen = set()
    for s in range(200):
        seen |= set(sample(logits, [SamplingParams(top_p=0.81, top_k=3)],
                           sampler=Sampler(seed=s)).token_ids)
    assert seen == {0, 1}


def test_same_seed_gives_same_tokens_whatever_the_batch():
    p = SamplingParams(temperature=1.0, seed=123)
    row = rand_logits(1, seed=3)
    alone = [sample(row, [p], gens=[make_generator(123)]).token_ids[0] for _ in range(2)]
    assert alone[0] == alone[1]
    others = rand_logits(4, seed=4)
    batch = torch.cat([others[:2], row, others[2:]])
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), p,
              SamplingParams(top_k=5, seed=9), SamplingParams(top_p=0.5)]
    gens = [None, None, make_generator(123), make_generator(9), None]
    out = sample(batch, params, gens=gens, sampler=Sampler(seed=77))
    assert out.token_ids[2] == alone[0]
    # a generator carries on: a sequence of draws is reproducible too
    g1, g2 = make_generator(5), make_generator(5)
    seq1 = [sample(row, [p], gens=[g1]).token_ids[0] for _ in range(5)]
    seq2 = [sample(batch, params, gens=[None, None, g2, None, None]).token_ids[2] for _ in range(5)]
    assert seq1 == seq2


def test_penalties_lower_generated_tokens_by_exact_amounts():
    logits = torch.zeros(1, 8)
    logits[0, 3] = 1.0
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25, logprobs=8)
    out = sample(logits, [p], outputs=[[3, 3, 5]])
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.25 + 0.5
    expected[0, 5] -= 1 * 0.25 + 0.5
    ref = torch.log_softmax(expected, -1)[0]
    got = {t.token_id: t.logprob for t in out.logprobs[0][1]}
    for t in range(8):
        assert got[t] == pytest.approx(ref[t].item(), abs=1e-6)
    assert out.token_ids == [0]                           # 3 fell from 1.0 to 0.0; ties -> first


def test_negative_penalties_raise_and_other_rows_are_untouched():
    logits = torch.zeros(2, 8)
    p = SamplingParams(temperature=0.0, frequency_penalty=-1.0, logprobs=0)
    out = sample(logits, [p, SamplingParams(temperature=0.0, logprobs=0)], outputs=[[6], [6]])
    assert out.token_ids == [6, 0]
    assert out.logprobs[1][0].logprob == pytest.approx(-math.log(8))


def test_banned_ids_are_never_sampled():
    logits = torch.zeros(3, 16)
    logits[:, 4] = 10.0
    logits[:, 9] = 9.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0),
              SamplingParams(temperature=1.0, top_k=1)]
    banned = [(4,), tuple(range(8)), (4,)]
    for s in range(50):
        out = sample(logits, params, banned=banned, sampler=Sampler(seed=s))
        assert out.token_ids[0] == 9 and out.token_ids[2] == 9
        assert out.token_ids[1] >= 8


def test_logprobs_are_log_softmax_sorted_and_include_the_sampled_token():
    logits = rand_logits(4, vocab=1000, seed=5)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.7, logprobs=3),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=50, logprobs=0)]
    out = sample(logits, params)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        chosen, top = out.logprobs[i]
        assert chosen.token_id == out.token_ids[i]
        assert chosen.logprob == pytest.approx(ref[i, chosen.token_id].item(), abs=1e-5)
        assert len(top) == params[i].logprobs
        vals = [t.logprob for t in top]
        assert vals == sorted(vals, reverse=True)
        want = ref[i].topk(params[i].logprobs)
        assert [t.token_id for t in top] == want.indices.tolist()
        assert vals == pytest.approx(want.values.tolist(), abs=1e-5)
    assert out.logprobs[0][0] == out.logprobs[0][1][0]    # greedy: sampled is the top-1
    assert isinstance(out.logprobs[0][0], TokenLogprob)


def test_temperature_sampling_matches_softmax_frequencies():
    base = torch.tensor([1.0, 0.0, -0.5, 2.0, -3.0])
    temperature = 0.7
    n = 20000
    logits = base.repeat(n, 1)
    out = sample(logits, [SamplingParams(temperature=temperature)] * n, sampler=Sampler(seed=2024))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    expected = torch.softmax(base / temperature, -1).double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 18.47                                   # df=4, p=0.001; fixed seed: no flakes
    # seeded per-row generators follow the same law
    gens = [make_generator(i) for i in range(2000)]
    out = sample(logits[:2000], [SamplingParams(temperature=temperature)] * 2000, gens=gens)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    chi2 = (((counts - expected / 10) ** 2) / (expected / 10)).sum().item()
    assert chi2 < 18.47


def test_unseeded_rows_use_the_samplers_generator():
    logits = rand_logits(4, vocab=100, seed=6)
    params = [SamplingParams(temperature=1.5)] * 4
    a = [sample(logits, params, sampler=Sampler(seed=1)).token_ids for _ in range(2)]
    assert a[0] == a[1]
    s = Sampler(seed=1)
    draws = {tuple(sample(logits, params, sampler=s).token_ids) for _ in range(10)}
    assert len(draws) > 1                                 # the generator advances


def test_bf16_logits_are_accepted_and_input_is_not_modified():
    logits = rand_logits(2, vocab=64, seed=7).bfloat16()
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=1.0)] * 2,
                 outputs=[[1], [2]], banned=[(3,), ()])
    assert torch.equal(logits, before) and len(out.token_ids) == 2


def _reference_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Plain full-sort reference: the token ids kept for one row."""
    order = logits.argsort(descending=True).tolist()
    if 0 < top_k < len(order):
        order = order[:top_k]
    if top_p >= 1.0:            # off (a float64 running sum can reach 1.0 before the end)
        return set(order)
    probs = torch.softmax(logits[order].double(), -1).tolist()
    kept, mass = [], 0.0
    for t, p in zip(order, probs):
        kept.append(t)
        mass += p
        if mass >= top_p:
            break
    return set(kept)


@pytest.mark.parametrize("scale", [0.3, 3.0])       # 0.3: flat, the nucleus spans thousands
def test_top_k_top_p_match_a_full_sort_reference(scale):
    from engine.sampler import _apply_top_k_top_p
    logits = rand_logits(6, vocab=5000, seed=8) * scale
    params = [SamplingParams(top_k=0, top_p=0.9), SamplingParams(top_k=40, top_p=1.0),
              SamplingParams(top_k=40, top_p=0.5), SamplingParams(top_k=0, top_p=0.999),
              SamplingParams(top_k=3000, top_p=0.95), SamplingParams(top_k=-1, top_p=1.0)]
    out = _apply_top_k_top_p(logits.clone(), params)
    for i, p in enumerate(params):
        kept = set(torch.isfinite(out[i]).nonzero()[:, 0].tolist())
        assert kept == _reference_top_k_top_p(logits[i], p.top_k, p.top_p), i


def test_repetition_penalty_demotes_prompt_and_output_tokens():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 2.0            # the favourite, seen in the prompt
    logits[:, 4] = 1.5
    logits[:, 5] = -1.0           # seen in the output: pushed further down
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0),
              SamplingParams(temperature=0.0)]
    out = Sampler(seed=0).sample(logits, params, [[5], [5]], [None, None],
                                 prompt_token_ids=[[3, 3], [3]])
    assert out.token_ids == [4, 3]
    params[0] = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=10)
    lp = Sampler(seed=0).sample(logits, params, [[5], [5]], [None, None],
                                prompt_token_ids=[[3], [3]]).logprobs[0][1]
    by_id = {t.token_id: t.logprob for t in lp}
    assert by_id[3] < by_id[4] and by_id[5] < by_id[0]      # 2 -> 1, -1 -> -2


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.full((1, V), -10.0)
    logits[0, :3] = torch.tensor([5.0, 4.5, 1.0])           # p1 / p0 = 0.61, p2 / p0 = 0.02
    gens = [make_generator(7)]
    seen = set()
    for _ in range(200):
        seen.update(Sampler(seed=0).sample(logits, [SamplingParams(temperature=1.0, min_p=0.1)],
                                           [[]], gens).token_ids)
    assert seen == {0, 1}


def test_allowed_token_ids_bound_greedy_and_random_rows_and_their_logprobs():
    logits = rand_logits(2)
    allowed = (5, 77, 40000)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed, logprobs=3),
              SamplingParams(temperature=1.5, allowed_token_ids=allowed, seed=1)]
    for _ in range(20):
        out = sample(logits, params, gens=[None, make_generator(_)])
        assert set(out.token_ids) <= set(allowed)
    assert out.token_ids[0] == max(allowed, key=lambda t: float(logits[0, t]))
    sampled, top = out.logprobs[0]
    assert {t.token_id for t in top} == set(allowed)          # the rest has probability 0
    assert math.isclose(sum(math.exp(t.logprob) for t in top), 1.0, rel_tol=1e-4)


def test_bad_word_bans_the_last_token_where_the_output_ends_with_the_rest():
    from engine.sampler import bad_word_bans
    words = ((7,), (1, 2, 3), (9, 3))
    assert bad_word_bans(words, []) == (7,)
    assert bad_word_bans(words, [5, 1, 2]) == (7, 3)
    assert bad_word_bans(words, [1, 2, 9]) == (7, 3)
    assert bad_word_bans(words, [2, 1]) == (7,)


def test_a_row_with_no_token_left_is_an_error_not_a_silent_token():
    logits = rand_logits(1)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=(5, 6))]
    with pytest.raises(ValueError, match="no token can be sampled"):
        sample(logits, params, banned=[(5, 6)])


def test_allowed_token_ids_of_two_requests_do_not_mix():
    logits = torch.zeros(2, 10)
    a, b = SamplingParams(temperature=0.0, allowed_token_ids=(3,)), \
        SamplingParams(temperature=0.0, allowed_token_ids=(7,))
    for _ in range(3):                       # the cached index of each request's own ids
        assert sample(logits, [a, b]).token_ids == [3, 7]
        assert sample(logits, [b, a]).token_ids == [7, 3]
