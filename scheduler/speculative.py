"""N-gram speculation (prompt lookup): the drafts a decode step verifies beside its token.

vLLM's `ngram` method and llama.cpp's lookup decoding: when the last n tokens of a request
(prompt and output so far) occurred earlier in it, the tokens that followed that occurrence
are a cheap guess at what comes next. A decode step then computes the pending token and k
drafted ones in one pass (their K/V and logits); the engine samples each position in turn,
as k + 1 decode steps would, and keeps the drafts up to the first that differs from the
token sampled at its place, plus that sampled token. What is kept is what sampling without
drafts gives (the same draws, in the same order), so the output does not change; only the
number of steps does. A repeated span (a document quoted back, code edited, a list
continued) takes one step for several tokens; free text finds few matches and drafts
nothing.

Plain Python and numpy: the scheduler owns the proposer (drafts are part of what it
schedules); `SpeculativeConfig` is `--speculative-config`, vLLM's JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "draft_p_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 0     # drafts a step verifies per request at most; 0: off
    prompt_lookup_min: int = 5          # the shortest n-gram matched
    prompt_lookup_max: int = 5          # the longest (the longest match wins)
    # the chance of being kept a draft needs to be verified (ours, not vLLM's); None: what a
    # draft row costs against a plain step, measured (DraftCost)
    draft_p_min: float | None = None

    def __post_init__(self):
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("1 <= prompt_lookup_min <= prompt_lookup_max must hold, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.draft_p_min is not None and not 0 <= self.draft_p_min <= 1:
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """--speculative-config: vLLM's JSON object ({"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}); as
        in vLLM, an n-gram size given alone is both, and neither means 5. Ours beside them:
        "draft_p_min" (see the field). "" is off. ValueError naming what is wrong."""
        if not text.strip():
            return cls()
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config takes a JSON object, got {text}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; this server "
                             f"reads {list(_KEYS)}")
        method = value.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not served (a "
                             "draft model's methods need a second model); use \"ngram\"")
        if "num_speculative_tokens" not in value:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        ints = {k: value[k] for k in _KEYS[1:4] if k in value}
        bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            raise ValueError(f"--speculative-config: {bad} must be integers")
        hi, lo = ints.get("prompt_lookup_max"), ints.get("prompt_lookup_min")
        hi, lo = (lo if hi is None else hi), (hi if lo is None else lo)
        hi, lo = (5 if hi is None else hi), (5 if lo is None else lo)
        p_min = value.get("draft_p_min")
        if p_min is not None and (not isinstance(p_min, (int, float)) or isinstance(p_min, bool)):
            raise ValueError(f"--speculative-config: draft_p_min must be a number, got {p_min!r}")
        return cls(ints["num_speculative_tokens"], lo, hi, p_min)


RATE_PRIOR = 0.5        # a request's first guess of how often a draft is kept
RATE_WEIGHT = 0.15      # the weight of each new outcome in that estimate


class NgramProposer:
    """Each request's tokens as a numpy buffer (grown as outputs arrive), the drafts its
    tail's longest earlier match gives, and how often its drafts are kept: `worth` keeps a
    draft only while the chance that it is reached and kept (the rate to the power of its
    place) stays above what a draft row costs (`DraftCost`). The rate learns from every
    proposal, verified or not: a proposal not verified is checked against the token the step
    samples instead, so a request whose matches stop paying drafts nothing, and one whose
    matches pay again resumes."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}     # id -> (buffer, length)
        self._rate: dict[str, float] = {}           # id -> share of its drafts kept (EMA)
        self._unverified: dict[str, int] = {}       # id -> a proposal's first token, to check

    def release(self, request_id: str) -> None:
        for table in (self._tokens, self._rate, self._unverified):
            table.pop(request_id, None)

    def worth(self, request_id: str, drafts: tuple[int, ...], min_p: float) -> tuple[int, ...]:
        """The leading drafts whose chance of being kept is at least `min_p`; a proposal
        left wholly unverified is remembered to be checked (`observe`)."""
        rate, chance, n = self._rate.get(request_id, RATE_PRIOR), 1.0, 0
        for _ in drafts:
            chance *= rate
            if chance < min_p:
                break
            n += 1
        if drafts and not n:
            self._unverified[request_id] = drafts[0]
        return drafts[:n]

    def observe(self, request_id: str, drafts: tuple[int, ...], tokens: tuple[int, ...]) -> None:
        """A step's outcome: the drafts it verified (or, none verified, the proposal kept
        aside) against the tokens it sampled; each draft up to the first one missed counts."""
        first = self._unverified.pop(request_id, None)
        if not drafts and first is not None:
            drafts = (first,)
        rate = self._rate.get(request_id, RATE_PRIOR)
        for draft, token in zip(drafts, tokens):
            rate += RATE_WEIGHT * ((draft == token) - rate)
            if draft != token:
                break
        self._rate[request_id] = rate

    def propose(self, request_id: str, prompt: list[int], outputs: list[int], limit: int,
                stop_ids: frozenset[int] = frozenset()) -> tuple[int, ...]:
        """At most `limit` tokens that followed the most recent earlier occurrence of the
        longest tail n-gram (prompt_lookup_max down to _min) of prompt + outputs; () where
        none occurs. Drafts end before a token of `stop_ids` (a stop ends the request: no
        token after it is sampled)."""
        if limit <= 0:
            return ()
        buf = self._buffer(request_id, prompt, outputs)
        n = buf.shape[0]
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        if n <= lo:
            return ()
        # candidates: earlier positions holding the last token, then the match extended back
        ends = np.flatnonzero(buf[:n - 1] == buf[n - 1])
        if ends.size == 0:
            return ()
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, hi):
            at = ends - back
            alive &= at >= 0
            alive[alive] = buf[at[alive]] == buf[n - 1 - back]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < lo:
            return ()
        end = int(ends[np.flatnonzero(length == best)[-1]])      # the most recent one
        # what followed it, repeated where it runs into the tail (a period shorter than
        # `limit`: "x y z x y" continues "z x y z ...")
        follow = buf[end + 1:end + 1 + limit].tolist()
        draft = [follow[i % len(follow)] for i in range(limit)]
        for i, tok in enumerate(draft):
            if tok in stop_ids:
                return tuple(draft[:i])
        return tuple(draft)

    def _buffer(self, request_id: str, prompt: list[int], outputs: list[int]) -> np.ndarray:
        n = len(prompt) + len(outputs)
        buf, have = self._tokens.get(request_id, (None, 0))
        if buf is None or have > n or have < len(prompt):
            buf = np.empty(n + n // 2 + 64, dtype=np.int32)     # (token ids fit)
            buf[:len(prompt)] = prompt
            have = len(prompt)
        if n > buf.shape[0]:
            grown = np.empty(n + n // 2 + 64, dtype=np.int32)
            grown[:have] = buf[:have]
            buf = grown
        if n > have:
            buf[have:n] = outputs[have - len(prompt):]
        self._tokens[request_id] = (buf, n)
        return buf[:n]


@dataclass
class SpecStats:
    """Counters of the drafts verified (vLLM's spec_decode_num_* metrics)."""
    drafts: int = 0             # decodes that verified drafts
    draft_tokens: int = 0       # tokens drafted
    accepted_tokens: int = 0    # of which kept

    def observe(self, batch, kept: dict) -> None:
        """A step's ScheduledBatch and each request's tokens kept (a list per request id)."""
        for r in batch.requests:
            if r.drafts and r.request_id in kept:
                self.drafts += 1
                self.draft_tokens += r.drafts
                self.accepted_tokens += len(kept[r.request_id]) - 1


class DraftCost:
    """What a draft row costs, against what a token costs without drafts, measured from the
    engine's decode steps: a draft is worth its row where the chance it is kept exceeds
    (seconds a row adds) x (requests in the step) / (seconds of a plain step of as many
    requests). Where a row costs most of a step (a small model on a CPU: its matmuls bound
    by arithmetic) that asks for likely drafts; where the weights' bytes bound the step, for
    few. `PRIOR` until a step with drafts and one without of the same size were timed."""
    PRIOR = 0.5
    WEIGHT = 0.1
    # at most: a request whose drafts hit (its rate nears 1) still verifies some, so a row
    # that once measured slow (a first step's set-up, a noisy neighbour) is measured again
    MOST = 0.9

    def __init__(self):
        self._plain: dict[int, float] = {}      # requests -> seconds of a plain decode step
        self._row: float | None = None          # seconds one draft row adds

    def observe(self, requests: int, rows: int, seconds: float) -> None:
        """A decode step of `requests` with `rows` draft rows in all took `seconds`."""
        plain = self._plain.get(requests)
        if not rows:
            self._plain[requests] = seconds if plain is None else \
                plain + self.WEIGHT * (seconds - plain)
        elif plain is not None:
            row = max(0.0, (seconds - plain) / rows)
            self._row = row if self._row is None else self._row + self.WEIGHT * (row - self._row)

    def min_p(self, requests: int) -> float:
        """The chance of being kept a draft needs, in a step of `requests`."""
        plain = self._plain.get(max(requests, 1))
        if self._row is None or not plain:
            return self.PRIOR
        return min(self.MOST, self._row * max(requests, 1) / plain)
