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
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = 0     # drafts a step verifies per request at most; 0: off
    prompt_lookup_min: int = 5          # the shortest n-gram matched
    prompt_lookup_max: int = 5          # the longest (the longest match wins)

    def __post_init__(self):
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("1 <= prompt_lookup_min <= prompt_lookup_max must hold, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """--speculative-config: vLLM's JSON object ({"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}); as
        in vLLM, an n-gram size given alone is both, and neither means 5. "" is off.
        ValueError naming what is wrong."""
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
        ints = {k: value[k] for k in _KEYS[1:] if k in value}
        bad = [k for k, v in ints.items() if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            raise ValueError(f"--speculative-config: {bad} must be integers")
        hi, lo = ints.get("prompt_lookup_max"), ints.get("prompt_lookup_min")
        hi, lo = (hi or lo or 5), (lo or hi or 5)
        return cls(ints["num_speculative_tokens"], lo, hi)


class NgramProposer:
    """Each request's tokens as a numpy buffer (grown as outputs arrive) and the drafts its
    tail's longest earlier match gives."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}     # id -> (buffer, length)

    def release(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

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
        draft = buf[end + 1:end + 1 + limit].tolist()
        for i, tok in enumerate(draft):
            if tok in stop_ids:
                return tuple(draft[:i])
        return tuple(draft)

    def _buffer(self, request_id: str, prompt: list[int], outputs: list[int]) -> np.ndarray:
        n = len(prompt) + len(outputs)
        buf, have = self._tokens.get(request_id, (None, 0))
        if buf is None or have > n or have < len(prompt):
            buf = np.empty(max(2 * n, 64), dtype=np.int64)
            buf[:len(prompt)] = prompt
            have = len(prompt)
        if n > buf.shape[0]:
            grown = np.empty(2 * n, dtype=np.int64)
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
