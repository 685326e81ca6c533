"""GrammarTable: the llguidance matchers of one engine's constrained requests, and the token
bitmasks they fill for the sampler (engine/grammar.py says why llguidance and what a grammar
is)."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.grammar import GrammarError, llguidance_grammar
from scheduler.sampling_params import GrammarSpec

BITS = 32                    # tokens per bitmask word (int32)


class GrammarTable:
    """The matchers of the running constrained requests of one engine (its step thread only)."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 threads: int = 2):
        """tokenizer_file: the model's HF tokenizer.json; vocab_size: the logits' width."""
        self._tokenizer_file = tokenizer_file
        self._eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.words = (vocab_size + BITS - 1) // BITS
        self._threads = threads
        self._tokenizer = None
        self._executor = None
        self._matchers: dict[str, object] = {}

    def _library(self):
        # NOTE: building the tokenizer's trie takes ~0.5-1 s: once, on the first use
        if self._tokenizer is None:
            from llguidance import LLExecutor, LLTokenizer
            self._tokenizer = LLTokenizer(self._tokenizer_file.read_text(), n_vocab=self.vocab_size,
                                          eos_token=self._eos or None)
            self._executor = LLExecutor(num_threads=self._threads)
        return self._tokenizer

    def warm(self) -> None:
        self._library()

    def matcher(self, request_id: str, spec: GrammarSpec):
        """The request's matcher, made on first use. Raises GrammarError for a bad grammar."""
        m = self._matchers.get(request_id)
        if m is None:
            from llguidance import LLMatcher
            m = LLMatcher(self._library(), llguidance_grammar(spec), log_level=0)
            if m.is_error():
                raise GrammarError(m.get_error())
            self._matchers[request_id] = m
        return m

    def fill(self, rows: list[tuple[int, object]], num_rows: int) -> torch.Tensor:
        """Bitmasks [num_rows, words] int32 (bit t of row r: token t allowed); rows: (row,
        matcher) of the constrained rows; every other row allows everything."""
        mask = torch.full((num_rows, self.words), -1, dtype=torch.int32)
        if len(rows) == 1:
            row, m = rows[0]
            m.unsafe_compute_mask_ptr(mask[row].data_ptr(), self.words * 4)
        elif rows:
            self._executor.unsafe_compute_mask_ptr([(m, row) for row, m in rows],
                                                   mask.data_ptr(), self.words * 4, num_rows)
        return mask

    @staticmethod
    def allow(mask: torch.Tensor, row: int, token_id: int) -> None:
        """Set token `token_id`'s bit in row `row` of bitmasks made by `fill`."""
        word, bit = divmod(token_id, BITS)
        value = (int(mask[row, word]) | (1 << bit)) & 0xFFFFFFFF
        mask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def accept(self, request_id: str, token_id: int) -> None:
        """Advance the request's matcher by its sampled token (no-op without a matcher)."""
        m = self._matchers.get(request_id)
        if m is None or m.is_stopped():
            return
        if not m.consume_token(token_id):
            raise GrammarError(f"the grammar rejected token {token_id}: {m.get_error()}")

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)


def unpack_bitmask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 bitmasks -> [R, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1                      # [R, words, 32]
    return bits.view(mask.shape[0], -1)[:, :vocab_size].bool()
