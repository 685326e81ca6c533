"""A step's sampling, request by request: each request's generator (its seed), Mirostat state,
grammar matcher and the prompt ids its penalties read, and a decode's drafts sampled position
by position (scheduler/speculative.py). Held by ModelRunner, which hands it each step's
logits."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.grammar_table import GrammarTable
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, bad_word_bans, make_generator
from engine.sampler_llamacpp import MirostatState
from scheduler.batch import ScheduledBatch
from scheduler.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: tuple[TokenLogprob, tuple[TokenLogprob, ...]] | None = None


class RequestSampling:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator | None] = {}
        self._mirostat: dict[str, MirostatState] = {}   # Mirostat requests' mu
        # the distinct prompt token ids of repetition_penalty requests, made once per request
        self._prompt_vocab: dict[str, list[int]] = {}
        self.grammars = GrammarTable(tokenizer_json, vocab_size, eos_token_ids)

    def release(self, request_id: str) -> None:
        """The request ended: its generator, Mirostat state, prompt ids and grammar go."""
        self._generators.pop(request_id, None)
        self._mirostat.pop(request_id, None)
        self._prompt_vocab.pop(request_id, None)
        self.grammars.release(request_id)

    def sample(self, batch: ScheduledBatch, requests: dict[str, Request], logits: torch.Tensor
               ) -> tuple[dict[str, list[SampledToken]], list[tuple[str, str]]]:
        """The tokens each request that samples this step keeps, and (request_id, error) for
        those whose sampling failed. A decode with drafts samples its positions in turn, each
        as a decode step would with the tokens kept before it, while the token sampled
        equals the draft at its place: the drafts kept and the first token that differs (or
        the one after every draft), the same draws in the same order as without drafts."""
        live, row = [], 0       # (request, its first logits row, its drafts)
        for r in batch.requests:
            q = requests[r.request_id]
            if r.sample and q.sampling_params.samples:
                live.append((q, row, r.token_ids[len(r.token_ids) - r.drafts:]))
                row += 1 + r.drafts
        kept: dict[str, list[SampledToken]] = {q.request_id: [] for q, _, _ in live}
        failed: list[tuple[str, str]] = []
        k = 0
        while live:
            got, fails = self._sample_pass(logits, [(at + k, _with_outputs(q, kept[q.request_id]))
                                                    for q, at, _ in live])
            failed += fails
            for rid, _ in fails:
                del kept[rid]
            going = []
            for q, at, drafts in live:
                tok = got.get(q.request_id)
                if tok is not None:
                    kept[q.request_id].append(tok)
                    if k < len(drafts) and tok.token_id == drafts[k]:
                        going.append((q, at, drafts))
            live, k = going, k + 1
        return {rid: toks for rid, toks in kept.items() if toks}, failed

    def _sample_pass(self, logits: torch.Tensor, rows: list[tuple[int, Request]]
                     ) -> tuple[dict[str, SampledToken], list[tuple[str, str]]]:
        """The token sampled from each (logits row, request), and (request_id, error) for
        those whose sampling failed: one request's failure (its generator, its values) ends
        that request alone; the others' draws are the ones they would make without it."""
        failed: list[tuple[str, str]] = []
        ready = []
        for i, q in rows:
            try:
                ready.append((i, q, self._generator(q), self._banned(q), self._matcher(q)))
            except Exception as exc:  # noqa: BLE001 - this request's values, no one else's
                failed.append((q.request_id, f"sampling failed: {exc}"))
        restore = self._sampling_snapshot(ready)
        try:
            result = self._sample_rows(logits, ready)
        except Exception:  # noqa: BLE001 - find the row at fault, sample the rest
            logger.exception("sampling %d rows failed; sampling them one by one", len(ready))
            restore()       # the batch's draws and Mirostat updates, undone
            result = {}
            for row in ready:
                try:
                    result.update(self._sample_rows(logits, [row]))
                except Exception as exc:  # noqa: BLE001
                    failed.append((row[1].request_id, f"sampling failed: {exc}"))
        for _, q, _, _, matcher in ready:      # each grammar takes its request's token
            if matcher is not None and q.request_id in result \
                    and not self._opens_reasoning(q, result[q.request_id].token_id):
                try:
                    self.grammars.accept(q.request_id, result[q.request_id].token_id)
                except Exception as exc:  # noqa: BLE001 - this request's grammar alone
                    del result[q.request_id]
                    failed.append((q.request_id, f"constrained decoding failed: {exc}"))
        return result, failed

    def _sampling_snapshot(self, rows: list):
        """What sampling `rows` changes (their generators, the shared one, their Mirostat mu),
        as a function that puts it back: a batch that fails part-way is sampled again row by
        row, and each row must then draw what it would have drawn in the batch."""
        gens = [g for g in (row[2] for row in rows) if g is not None]
        gens.append(self.sampler.default_generator)
        states = [(g, g.get_state()) for g in gens]
        mus = [(s, s.mu) for s in (self._mirostat_state(row[1]) for row in rows) if s]

        def restore() -> None:
            for g, state in states:
                g.set_state(state)
            for s, mu in mus:
                s.mu = mu
        return restore

    def _sample_rows(self, logits: torch.Tensor, rows: list) -> dict[str, SampledToken]:
        """rows: (logits row, request, generator, banned ids, grammar matcher or None) ->
        sampled tokens by id (constrained rows only take tokens their grammar allows)."""
        if not rows:
            return {}
        reqs = [row[1] for row in rows]
        constrained = [(k, row[4]) for k, row in enumerate(rows) if row[4] is not None]
        allowed = self.grammars.fill(constrained, len(rows)) if constrained else None
        for k, _ in constrained:        # a first token may open the thinking span instead
            marks = reqs[k].sampling_params.reasoning
            if marks is not None and marks.open_id is not None and not reqs[k].output_token_ids:
                self.grammars.allow(allowed, k, marks.open_id)
        out = self.sampler.sample(logits[[row[0] for row in rows]],
                                  [q.sampling_params for q in reqs],
                                  [q.output_token_ids for q in reqs], [row[2] for row in rows],
                                  banned_token_ids=[row[3] for row in rows], allowed=allowed,
                                  prompt_token_ids=[self._seen_prompt(q) for q in reqs],
                                  states=[self._mirostat_state(q) for q in reqs],
                                  dry_prompts=[_dry_prompt(q) for q in reqs])
        return {q.request_id: SampledToken(out.token_ids[k],
                                           out.logprobs[k] if out.logprobs is not None else None)
                for k, q in enumerate(reqs)}

    def _mirostat_state(self, req: Request) -> MirostatState | None:
        p = req.sampling_params
        if not p.mirostat:
            return None
        state = self._mirostat.get(req.request_id)
        if state is None:
            state = self._mirostat[req.request_id] = MirostatState(2 * p.mirostat_tau)
        return state

    def _seen_prompt(self, req: Request) -> list[int]:
        """The prompt's distinct token ids where repetition_penalty reads them (else none): the
        penalty needs only which ids occur, not a 100K-token prompt re-read every step."""
        p = req.sampling_params
        if p.repetition_penalty == 1.0:
            return []
        if p.repetition_window:         # the last tokens alone (llama.cpp's repeat_last_n)
            return req.prompt_token_ids[-p.repetition_window:]
        seen = self._prompt_vocab.get(req.request_id)
        if seen is None:
            seen = self._prompt_vocab[req.request_id] = sorted(set(req.prompt_token_ids))
        return seen

    def _matcher(self, req: Request):
        """The request's grammar matcher, or None: no grammar, or the next token is inside
        the thinking span the grammar leaves free."""
        p = req.sampling_params
        if p.grammar is None or p.reasoning is not None \
                and p.reasoning.thinking(req.output_token_ids):
            return None
        return self.grammars.matcher(req.request_id, p.grammar)

    @staticmethod
    def _opens_reasoning(req: Request, token_id: int) -> bool:
        """`token_id`, sampled as the first output token, opens the thinking span (the
        grammar, which allowed it only for that, does not take it)."""
        marks = req.sampling_params.reasoning
        return (marks is not None and not req.output_token_ids
                and token_id == marks.open_id)

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.request_id not in self._generators:
            seed = req.sampling_params.seed
            self._generators[req.request_id] = None if seed is None else make_generator(seed)
        return self._generators[req.request_id]

    @staticmethod
    def _banned(req: Request) -> tuple[int, ...]:
        p = req.sampling_params
        banned = bad_word_bans(p.bad_words, req.output_token_ids) if p.bad_words else ()
        if len(req.output_token_ids) >= p.min_tokens:
            return banned
        return banned + tuple(p.stop_token_ids) + (
            () if p.ignore_eos else tuple(req.eos_token_ids))


def _with_outputs(req: Request, kept: list[SampledToken]) -> Request:
    """`req` as sampling sees it after the tokens `kept` this step (a decode's drafts)."""
    if not kept:
        return req
    return dataclasses.replace(req, output_token_ids=req.output_token_ids + [
        t.token_id for t in kept])


def _dry_prompt(req: Request) -> list[int]:
    """The prompt tokens DRY looks back over (none where it is off)."""
    p = req.sampling_params
    if p.dry_multiplier <= 0 or p.dry_penalty_last_n == 0:
        return []
    return req.prompt_token_ids[-p.dry_penalty_last_n:] if p.dry_penalty_last_n > 0 \
        else req.prompt_token_ids
