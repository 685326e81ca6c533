"""Per-request sampling parameters (plain data; built by the server, read by scheduler and
sampler)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
POOLINGS = ("last", "mean")          # an embedding request's pooling (engine/pooling.py)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (engine/grammar.py). ``source``: the JSON Schema as
    JSON text, the regular expression or the grammar, Lark or GBNF ("" for json_object)."""
    kind: GrammarKind
    source: str = ""


@dataclass(frozen=True)
class ReasoningMarks:
    """A reasoning model's thinking span, which a request's grammar leaves free (vLLM's
    structured outputs under a reasoning parser): the grammar constrains what follows
    `close_id` (</think>). `open_id` (<think>): the output may open the span with it as its
    first token, else the grammar holds from the start; None: the prompt opened it."""
    close_id: int
    open_id: int | None = None

    def thinking(self, output_token_ids: list[int]) -> bool:
        """Whether the next token is inside the span (no grammar on it)."""
        if self.close_id in output_token_ids:
            return False
        if self.open_id is None:
            return True
        return bool(output_token_ids) and output_token_ids[0] == self.open_id


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16                 # new tokens to generate at most (finish_reason "length")
    temperature: float = 1.0             # 0 means greedy
    top_p: float = 1.0                   # nucleus; 1.0 disables
    top_k: int = 0                       # 0 (or -1) disables
    seed: int | None = None              # per-request generator: same seed, same tokens
    presence_penalty: float = 0.0        # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0      # extension (vLLM, CTRL): over prompt and output tokens
    repetition_window: int = 0           # llama.cpp's repeat_last_n: only the last n of them
                                         # (0: all)
    min_p: float = 0.0                   # extension (vLLM): drop tokens below min_p x the top one
    stop_token_ids: tuple[int, ...] = () # finish with "stop" when one is sampled (an output
                                         # token; the server leaves its text out, as vLLM)
    ignore_eos: bool = False             # extension (vLLM): do not stop at the model's EOS tokens
    logprobs: int | None = None          # None: off; k >= 0: sampled token's logprob plus top-k
    min_tokens: int = 0                  # extension (vLLM): EOS/stop ids are masked until reached
    client: str = ""                     # who asked (OpenAI `user`; "": anonymous): fair share
    priority: int = 0                    # extension (vLLM): lower is sooner, under the
                                         # scheduler's "priority" policy (0 under "fcfs")
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    grammar: GrammarSpec | None = None   # constrained decoding: the output follows it
    allowed_token_ids: tuple[int, ...] | None = None  # extension (vLLM): only these are sampled
    # extension (vLLM): token sequences the output never ends with (its last token is banned
    # where the output ends with the others)
    bad_words: tuple[tuple[int, ...], ...] = ()
    # extension (vLLM): each prompt token's logprob (after the first) and the top-k there, from
    # the model's raw distribution; the prompt is then computed whole (no prefix-cache reuse)
    prompt_logprobs: int | None = None
    # the thinking span the grammar leaves free (None: the grammar constrains the whole output)
    reasoning: ReasoningMarks | None = None
    # llama.cpp's samplers (engine/sampler_llamacpp.py), each off at its default
    dynatemp_range: float = 0.0          # temperature +- this, by the row's entropy
    dynatemp_exponent: float = 1.0
    top_n_sigma: float = 0.0             # keep logits within n std devs of the top (<= 0: off)
    typical_p: float = 1.0               # locally typical sampling's mass
    xtc_probability: float = 0.0         # XTC: how often the top choices are excluded
    xtc_threshold: float = 0.1           # ... those at or above this probability
    mirostat: int = 0                    # 1 or 2: Mirostat's draw; mu starts at 2 tau
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0          # DRY: the penalty of a repeat at allowed_length
    dry_base: float = 1.75               # ... times base per token longer
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1         # the context it looks back over (-1: all)
    dry_breakers: tuple[int, ...] = ()   # token ids that end a repeated stretch
    # an embedding request (/v1/embeddings): the prompt's final hidden states pooled, of its
    # last token ("last") or all ("mean"), L2-normalized, on the output that ends it
    pooling: str | None = None
    # extension (vLLM): the prefix cache's pages this request reads and adds are those of its
    # salt alone (None: the shared ones), so a tenant's prompts are never probed by another's
    cache_salt: str | None = None
    # extension (vLLM): the LoRA adapter (--lora-modules name) the request runs with (None:
    # the base model); its prompt pages are cached under the adapter's own salt
    lora: str | None = None

    @property
    def needs_whole_prompt(self) -> bool:
        """Every prompt position is computed (no prefix-cache reuse): prompt logprobs read
        each position's logits, mean pooling each position's hidden state."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def samples(self) -> bool:
        """Whether the request samples tokens: an embedding request ends once its prompt is
        computed, with no token (finish_reason "stop")."""
        return self.pooling is None

    @property
    def max_new_tokens(self) -> int:
        """Tokens the request may add to its prompt: max_tokens, or 0 for an embedding
        request (its prompt may fill the whole context)."""
        return self.max_tokens if self.samples else 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
