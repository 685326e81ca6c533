"""Sampler: one token per row of a batch of logits, plus optional logprobs.

Order per row (as in vLLM):
  1. presence / frequency penalties over the row's generated tokens (OpenAI semantics), and
     vLLM's repetition_penalty over its prompt and generated tokens (a seen token's logit is
     divided by it when positive, multiplied when negative);
  2. logit_bias (OpenAI: token id -> bias added to its logit, -100 bans it in practice);
  3. banned token ids (EOS/stop ids until min_tokens, the last token of a bad word whose other
     tokens the output ends with: `bad_word_bans`) set to -inf, and so is every token outside
     a row's allowed_token_ids and every token a constrained row's grammar does not allow now
     (engine/grammar.py bitmasks);
  4. logprobs = log_softmax of the logits at this point, i.e. after penalties and bans but BEFORE
     temperature, top-k and top-p. NOTE: they describe the model's (penalized) distribution, not
     the truncated one sampled from, so they do not depend on sampling knobs and are never -inf
     for a token that top-k/top-p merely cut off;
  5. greedy rows (temperature 0) take the argmax;
  6. other rows: divide by temperature (llama.cpp's dynamic temperature where asked), apply
     llama.cpp's top-n-sigma and typical_p where asked, drop tokens under min_p x the top
     token's probability, keep top_k, keep the nucleus (top_p) of what is left, apply
     llama.cpp's XTC where asked, then sample by inverse CDF with one uniform drawn from the
     row's own generator (what torch.multinomial does, vectorized over rows); a Mirostat row
     draws by Mirostat instead of the truncations (engine/sampler_llamacpp.py). A seeded row
     draws only from its own generator, so its tokens do not depend on the other rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine import sampler_llamacpp as lcpp
from engine.grammar_table import unpack_bitmask
from engine.outputs import TokenLogprob
from scheduler.sampling_params import SamplingParams

BAN_BIAS = -100.0             # a logit_bias this low bans its token
RowLogprobs = tuple[TokenLogprob, tuple[TokenLogprob, ...]]   # (sampled token, top-k sorted)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with `seed` (any integer, taken modulo 2^64: the OpenAI edge allows
    64-bit signed seeds and adds the choice index), or from OS entropy when seed is None."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed % 2 ** 64)
    return g


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]                     # one per row
    logprobs: list[RowLogprobs | None]       # one per row; None where the row did not ask


class Sampler:
    def __init__(self, seed: int | None = None):
        # draws of rows without a generator of their own (unseeded requests)
        self.default_generator = make_generator(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_token_ids: list[list[int]],
               generators: list[torch.Generator | None],
               banned_token_ids: list[tuple[int, ...]] | None = None,
               allowed: torch.Tensor | None = None,
               prompt_token_ids: list[list[int]] | None = None,
               states: list[lcpp.MirostatState | None] | None = None,
               dry_prompts: list[list[int]] | None = None) -> SamplerOutput:
        """logits: [S, V] (any float dtype; computed in float32). One entry per row in every
        list; allowed: [S, ceil(V / 32)] int32 bitmasks of the tokens each row may take (rows
        without a grammar allow all), or None; prompt_token_ids: for repetition_penalty (the
        prompt's distinct ids, or its last repetition_window tokens); states: each Mirostat
        row's state, updated by its draw; dry_prompts: each DRY row's prompt (its tail of
        dry_penalty_last_n tokens)."""
        num_rows, vocab = logits.shape
        assert len(params) == len(output_token_ids) == len(generators) == num_rows
        logits = logits.float().clone()   # [S, V]
        _apply_penalties(logits, params, output_token_ids)
        _apply_repetition_penalty(logits, params, output_token_ids, prompt_token_ids)
        _apply_dry(logits, params, output_token_ids, dry_prompts)
        _apply_logit_bias(logits, params)
        _apply_allowed_token_ids(logits, params)
        if banned_token_ids is not None:
            for i, banned in enumerate(banned_token_ids):
                if banned:
                    logits[i, list(banned)] = float("-inf")
        if allowed is not None:
            logits.masked_fill_(~unpack_bitmask(allowed.to(logits.device), vocab),
                                float("-inf"))
        # NOTE: raised for the batch; ModelRunner then samples row by row and fails this one.
        # Only a ban, a bias or a mask can leave a row without a token (the plain step skips it)
        masked = allowed is not None or any(banned_token_ids or ()) or any(
            p.allowed_token_ids is not None or p.logit_bias for p in params)
        if masked and bool(torch.isneginf(logits.amax(dim=-1)).any()):
            raise ValueError("no token can be sampled: allowed_token_ids, bad_words, min_tokens "
                             "and the output's grammar leave none")

        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            token_ids[greedy] = _rows(logits, greedy).argmax(dim=-1)
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if rand:
            token_ids[rand] = self._sample_random(
                _rows(logits, rand), [params[i] for i in rand], [generators[i] for i in rand],
                [states[i] if states else None for i in rand])
        tokens = token_ids.tolist()
        return SamplerOutput(tokens, _logprobs(logits, params, tokens))

    def _sample_random(self, logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None],
                       states: list[lcpp.MirostatState | None]) -> torch.Tensor:
        """logits: [R, V] after penalties; returns [R] token ids."""
        dev = logits.device
        temps = torch.tensor([p.temperature if p.dynatemp_range <= 0 else
                              lcpp.dynamic_temperature(logits[i], p.temperature,
                                                       p.dynatemp_range, p.dynatemp_exponent)
                              for i, p in enumerate(params)], dtype=torch.float32, device=dev)
        logits = logits / temps[:, None]
        logits = self._truncate(logits, params, generators)
        cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)           # [R, V]
        # one uniform per row from the row's own generator (unseeded rows share the sampler's),
        # drawn on the generator's device (CPU by default) so the device does not change the draw
        num_shared = sum(g is None for g in generators)
        draws = iter(torch.rand(num_shared, generator=self.default_generator).tolist())
        u = torch.tensor([next(draws) if g is None else
                          float(torch.rand((), generator=g, device=g.device)) for g in generators],
                         dtype=torch.float32, device=dev)
        # NOTE: inverse-CDF sampling (what torch.multinomial does for one sample), vectorized:
        # the first token whose cdf exceeds u * total. A token with probability 0 never has a cdf
        # step, so it cannot be picked; scaling by the total absorbs float32 cumsum rounding.
        target = (u * cdf[:, -1])[:, None]
        tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
        for i, p in enumerate(params):
            if p.mirostat:
                tokens[i] = lcpp.mirostat(logits[i], p.mirostat, p.mirostat_tau, p.mirostat_eta,
                                          states[i], float(u[i]))
        return tokens

    def _truncate(self, logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
        """The tempered rows [R, V] truncated: top-n-sigma, typical, min_p, top_k, top_p,
        XTC (a Mirostat row keeps its whole distribution: Mirostat truncates it itself)."""
        for i, p in enumerate(params):
            if p.top_n_sigma > 0 and not p.mirostat:
                lcpp.top_n_sigma(logits[i], p.top_n_sigma)
            if p.typical_p < 1.0 and not p.mirostat:
                lcpp.typical(logits[i], p.typical_p)
        cut = [replace(p, min_p=0.0, top_k=0, top_p=1.0) if p.mirostat else p for p in params]
        logits = _apply_top_k_top_p(_apply_min_p(logits, cut), cut)
        for i, p in enumerate(params):
            if p.xtc_probability > 0 and not p.mirostat:
                lcpp.xtc(logits[i], p.xtc_probability, p.xtc_threshold,
                         generators[i] or self.default_generator)
        return logits


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without a copy when rows is every row."""
    return x if len(rows) == x.shape[0] else x[rows]


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                     output_token_ids: list[list[int]]) -> None:
    """In place: logits[t] -= count[t] * frequency + (count[t] > 0) * presence, counts over
    each row's generated tokens."""
    for i, p in enumerate(params):
        if not (p.presence_penalty or p.frequency_penalty) or not output_token_ids[i]:
            continue
        # NOTE: sparse, per row: only the generated tokens' logits change (a dense [S, V] count
        # matrix costs more than the whole sampler on CPU)
        ids, counts = torch.tensor(output_token_ids[i]).unique(return_counts=True)
        ids = ids.to(logits.device)
        penalty = counts.to(logits.device, torch.float32) * p.frequency_penalty + p.presence_penalty
        logits[i, ids] -= penalty


def _apply_repetition_penalty(logits: torch.Tensor, params: list[SamplingParams],
                              output_token_ids: list[list[int]],
                              prompt_token_ids: list[list[int]] | None) -> None:
    """In place, vLLM's (CTRL's) rule over each row's prompt and generated tokens (the last
    repetition_window of them where set: llama.cpp's repeat_penalty)."""
    for i, p in enumerate(params):
        if p.repetition_penalty == 1.0:
            continue
        seen = (prompt_token_ids[i] if prompt_token_ids is not None else []) + output_token_ids[i]
        if p.repetition_window:         # llama.cpp's repeat_last_n: the last tokens alone
            seen = seen[-p.repetition_window:]
        if not seen:
            continue
        ids = torch.tensor(seen).unique().to(logits.device)
        x = logits[i, ids]
        logits[i, ids] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)


def _apply_dry(logits: torch.Tensor, params: list[SamplingParams],
               output_token_ids: list[list[int]], prompts: list[list[int]] | None) -> None:
    """In place: llama.cpp's DRY penalty on each row that asks, over its last
    dry_penalty_last_n tokens of prompt and output (engine/sampler_llamacpp.py)."""
    for i, p in enumerate(params):
        if p.dry_multiplier <= 0 or p.dry_penalty_last_n == 0:
            continue
        context = (prompts[i] if prompts is not None else []) + output_token_ids[i]
        if p.dry_penalty_last_n > 0:
            context = context[-p.dry_penalty_last_n:]
        lcpp.dry(logits[i], context, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                 frozenset(p.dry_breakers))


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """In place on logits [R, V] (after temperature): tokens whose probability is below
    min_p x the most likely token's get -inf."""
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not rows:
        return logits
    x = _rows(logits, rows)
    floor = torch.tensor([params[i].min_p for i in rows], device=logits.device).log()
    # p_t < min_p * p_max  <=>  logit_t < logit_max + log(min_p)
    cutoff = x.max(dim=-1, keepdim=True).values + floor[:, None]
    if x is logits:
        return logits.masked_fill_(logits < cutoff, float("-inf"))
    logits[rows] = x.masked_fill_(x < cutoff, float("-inf"))
    return logits


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: logits[i, t] += bias for each (t, bias) of row i's logit_bias; a bias of
    -100 (the API's floor) bans the token outright, as OpenAI documents it ("should result in
    a ban"): a finite -100 would not beat a logit gap over 100."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32,
                                device=logits.device)
            logits[i, ids] += bias.masked_fill_(bias <= BAN_BIAS, float("-inf"))


# allowed_token_ids as index tensors, by the tuple's identity (a request's SamplingParams
# keep theirs for its life): not rebuilt every step from up to a vocabulary of ids
_ALLOWED_INDEX: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
_ALLOWED_INDEX_MAX = 256


def _allowed_index(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    hit = _ALLOWED_INDEX.get(id(ids))
    if hit is not None and hit[0] is ids and hit[1].device == device:
        return hit[1]
    if len(_ALLOWED_INDEX) >= _ALLOWED_INDEX_MAX:
        _ALLOWED_INDEX.pop(next(iter(_ALLOWED_INDEX)))
    index = torch.tensor(ids, dtype=torch.int64, device=device)
    _ALLOWED_INDEX[id(ids)] = (ids, index)      # holds the tuple: its id stays its own
    return index


def _apply_allowed_token_ids(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """In place: every token outside a row's allowed_token_ids gets -inf (vLLM's)."""
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            ids = _allowed_index(p.allowed_token_ids, logits.device)
            keep = logits[i, ids]
            logits[i] = float("-inf")
            logits[i, ids] = keep


def bad_word_bans(bad_words: tuple[tuple[int, ...], ...],
                  output_token_ids: list[int]) -> tuple[int, ...]:
    """vLLM's bad_words: for each banned token sequence, its last token where the output ends
    with the tokens before it (a one-token word is banned always)."""
    n = len(output_token_ids)
    return tuple(word[-1] for word in bad_words
                 if len(word) - 1 <= n
                 and tuple(output_token_ids[n - len(word) + 1:]) == word[:-1])


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """In place on logits [R, V] (after temperature), which it returns. Keeps the top_k tokens,
    then, of those (renormalized), the nucleus: the smallest set of top tokens whose probability
    sums to >= top_p (at least the top token). Others are set to -inf. Cuts are by value, so
    tokens tied with the last kept one are kept too: no dependence on how a sort orders ties."""
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    rows = [i for i, p in enumerate(params) if ks[i] < vocab or p.top_p < 1.0]
    if not rows:
        return logits
    dev = logits.device
    x = _rows(logits, rows)                                            # [T, V]
    k = torch.tensor([ks[i] for i in rows], device=dev)[:, None]       # [T, 1]
    top_p = torch.tensor([params[i].top_p for i in rows], device=dev)[:, None]
    has_k = k[:, 0] < vocab
    full_lse = None if bool(has_k.all()) else x.logsumexp(dim=-1)
    # NOTE: a full sort of the vocabulary is slow on CPU (~6 ms per 49k row); the nucleus usually
    # sits in the top few hundred tokens, so look at a sorted prefix and widen it only if needed.
    width = max([ks[i] for i in rows if ks[i] < vocab] + [256])
    while True:
        width = min(width, vocab)
        vals = x.topk(width, dim=-1).values                            # [T, W] descending
        ranks = torch.arange(width, device=dev)[None, :]
        vals = vals.masked_fill(ranks >= k, float("-inf"))
        lse = vals.logsumexp(dim=-1)                                   # top-k rows renormalize
        if full_lse is not None:
            lse = torch.where(has_k, lse, full_lse)
        probs = (vals - lse[:, None]).exp()
        cum = probs.cumsum(dim=-1)
        if width == vocab or bool(((k[:, 0] <= width) | (cum[:, -1] >= top_p[:, 0])).all()):
            break
        width *= 8
    # rank j is kept while the mass above it is < top_p (rank 0 always) and j < top_k
    keep = ((cum - probs) < top_p) & (ranks < k)
    keep[:, 0] = True
    cutoff = vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)        # [T, 1] last kept value
    if x is logits:
        return logits.masked_fill_(logits < cutoff, float("-inf"))
    logits[rows] = x.masked_fill_(x < cutoff, float("-inf"))
    return logits


def _logprobs(logits: torch.Tensor, params: list[SamplingParams],
              tokens: list[int]) -> list[RowLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[RowLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows], dim=-1)                       # [R, V]
    k_max = min(max(params[i].logprobs for i in rows), lp.shape[1])
    top_vals, top_ids = lp.topk(k_max, dim=-1) if k_max > 0 else (None, None)
    sampled = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))
    sampled = sampled[:, 0].tolist()
    top_vals = top_vals.tolist() if top_vals is not None else [[] for _ in rows]
    top_ids = top_ids.tolist() if top_ids is not None else [[] for _ in rows]
    for r, i in enumerate(rows):
        k = min(params[i].logprobs, k_max)
        top = tuple(TokenLogprob(t, v) for t, v in zip(top_ids[r][:k], top_vals[r][:k]))
        out[i] = (TokenLogprob(tokens[i], sampled[r]), top)
    return out


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[RowLogprobs]:
    """Per row of logits [R, V]: the logprob of the prompt token that follows (targets [R]),
    its rank and the top-k, from the raw distribution (no penalties, bias or temperature:
    vLLM's prompt_logprobs)."""
    out: list[RowLogprobs] = []
    if logits.shape[0]:
        lp = torch.log_softmax(logits.float(), dim=-1)
        tgt = targets.to(lp.device)
        chosen = lp.gather(1, tgt[:, None])
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        kk = min(k, lp.shape[1])
        vals, ids = lp.topk(kk, dim=-1) if kk else (lp[:, :0], tgt[:, None][:, :0])
        for t, c, r, vs, ts in zip(tgt.tolist(), chosen[:, 0].tolist(), ranks, vals.tolist(),
                                   ids.tolist()):
            out.append((TokenLogprob(t, c, r), tuple(TokenLogprob(i, v, j + 1)
                                                     for j, (i, v) in enumerate(zip(ts, vs)))))
    return out
