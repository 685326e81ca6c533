"""llama.cpp's own request fields and answer shape, shared by its native routes: POST
/completion (server/serving_native.py) and /infill (server/serving_infill.py).

Requests are text completions underneath (server/protocol.py's CompletionRequest: the same
sampling fields, llama.cpp's samplers among them, and checks) with llama.cpp's names:
`n_predict` is max_tokens (-1 or absent: until the model ends or the context is full; 0: one
token, as llama.vim's cache warm-ups ask), `n_probs` the top tokens' log-probabilities of each
written token (`completion_probabilities`), `return_tokens` the written token ids (`tokens`).
llama.cpp's two stops for editors apply as there (`EditorStops`): `n_indent` ends the text
where a line starts less indented than that, `t_max_predict_ms` at the end of a line once that
long has passed since the first token (`stop_type` "limit" either way). The fields that tune
llama.cpp's own slots and timing (`cache_prompt`, `id_slot`, `samplers`, `t_max_prompt_ms`,
`response_fields`) are accepted and ignored (docs/api-other.md); `grammar` and `json_schema`
are guided_grammar and guided_json, `seed` -1 a random one, as in llama.cpp.

Answers: `content`, `stop`, `stop_type` (eos | word | limit), token counts and llama.cpp's
`timings`; streamed as `data:` chunks of `content` whose last has `stop: true` and the rest.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, AsyncIterator, Callable, Sequence

from pydantic import Field, StrictBool, StrictInt, model_validator

from server.generation import ChoiceResult, Generation
from server.protocol import MAX_CHAT_TOP_LOGPROBS, CompletionRequest, MaxTokens, Text
from server.protocol_tools import OnlyFalse, Unsupported, _Wire

RANDOM_SEEDS = (-1, 0xFFFFFFFF)     # llama.cpp's "a random seed" (LLAMA_DEFAULT_SEED)
MAX_STOPS = 64                      # stop strings (OpenAI's 4 is /v1's; llama.cpp has none)


class NativeRequest(CompletionRequest):
    n_predict: Annotated[StrictInt | None, Field(ge=-1)] = None
    max_tokens: MaxTokens = None          # llama.cpp's alias of n_predict
    n_indent: Annotated[StrictInt, Field(ge=0)] = 0
    t_max_predict_ms: Annotated[StrictInt, Field(ge=0)] = 0
    n_probs: Annotated[StrictInt, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] = 0
    return_tokens: StrictBool = False
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOPS)] | None = None
    grammar: Text | None = None           # llama.cpp's GBNF: guided_grammar
    json_schema: dict[str, Any] | None = None       # guided_json
    post_sampling_probs: OnlyFalse = None     # probabilities after the samplers: not kept
    echo: Unsupported = None              # not in llama.cpp's answer; n_probs is its
    logprobs: Unsupported = None          # log-probabilities
    prompt_logprobs: Unsupported = None
    suffix: Unsupported = None            # /infill's input_suffix

    @model_validator(mode="after")
    def _llama_cpp_names(self):
        if self.grammar is not None or self.json_schema is not None:
            if self.guided_fields():
                raise ValueError("grammar and json_schema replace the guided_* fields and "
                                 "response_format; send one")
            self.guided_grammar, self.guided_json = self.grammar, self.json_schema
        if self.seed in RANDOM_SEEDS:
            self.seed = None
        if self.n_predict is not None and self.n_predict >= 0:
            # 0 (llama.vim warms its cache so): the prompt and the one token sampled after it
            self.max_tokens = max(self.n_predict, 1)
        elif self.n_predict is not None:
            self.max_tokens = None        # -1: until the text ends or the context is full
        return self

    def logprobs_k(self) -> int | None:
        return self.n_probs or None


class NativeTimings(_Wire):
    """llama.cpp's `timings` (llama.vscode shows them): the prompt tokens computed (not
    cached) and the tokens written, their milliseconds and rates."""
    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    prompt_per_token_ms: float = 0.0
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    predicted_per_token_ms: float = 0.0
    predicted_per_second: float = 0.0

    @classmethod
    def of(cls, cached: int, prompt: int, predicted: int, seconds: tuple[float, float]
           ) -> NativeTimings:
        (p_ms, g_ms) = (1e3 * s for s in seconds)
        return cls(cache_n=cached, prompt_n=prompt, prompt_ms=p_ms,
                   prompt_per_token_ms=p_ms / prompt if prompt else 0.0,
                   prompt_per_second=1e3 * prompt / p_ms if p_ms else 0.0,
                   predicted_n=predicted, predicted_ms=g_ms,
                   predicted_per_token_ms=g_ms / predicted if predicted else 0.0,
                   predicted_per_second=1e3 * predicted / g_ms if g_ms else 0.0)


class TokenProb(_Wire):
    """A token of llama.cpp's `completion_probabilities`: id, text, UTF-8 bytes, log-prob."""
    id: int
    token: str
    bytes: list[int]
    logprob: float


class TokenProbs(TokenProb):
    """A written token and the `n_probs` most likely ones at its position."""
    top_logprobs: list[TokenProb]


class NativeResponse(_Wire):
    """llama.cpp's /completion answer (the fields clients and editors read); `tokens` with
    return_tokens, `completion_probabilities` with n_probs."""
    index: int = 0
    content: str
    tokens: list[int] = []                # the written ids with return_tokens, as llama.cpp
    stop: bool
    model: str
    tokens_predicted: int = 0
    tokens_evaluated: int = 0
    tokens_cached: int = 0
    truncated: bool = False
    stop_type: str = "none"               # eos | word | limit (none: not stopped yet)
    stopping_word: str = ""
    completion_probabilities: list[TokenProbs] | None = None
    timings: NativeTimings | None = None


class EditorStops:
    """llama.cpp's n_indent and t_max_predict_ms over a middle's text as it grows: a line
    after the first whose indentation is less than n_indent (a blank one included) ends the
    middle, cut after that indentation; so does a piece of text that ends a line once
    t_max_predict_ms have passed since the first token (never half a line)."""

    def __init__(self, n_indent: int, t_max_predict_ms: int,
                 clock: Callable[[], float] = time.monotonic):
        self._indent, self._max_s, self._clock = n_indent, t_max_predict_ms / 1000, clock
        self._text = ""
        self._line = -1                      # where the last line starts (-1: still the first)
        self._start: float | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """(the part of `text` kept, whether the middle ends here)."""
        if self._start is None:
            self._start = self._clock()
        done = len(self._text)
        self._text += text
        while True:
            if self._indent and self._line >= 0:
                rest = self._text[self._line:]
                indent = len(rest) - len(rest.lstrip(" \t"))
                if indent < len(rest) and indent < self._indent:
                    return self._text[done:self._line + indent], True
            at = self._text.find("\n", max(self._line, 0))
            if at < 0:
                break
            self._line = at + 1
        late = self._max_s and "\n" in text and self._clock() - self._start > self._max_s
        return text, bool(late)


async def native_deltas(generation: Generation, stops: EditorStops,
                        result: ChoiceResult) -> AsyncIterator[tuple[str, tuple]]:
    """The text as it comes, (text, its tokens' log-probability entries), recording in
    `result` how it ended; a stop ends the iteration (the caller closes the generation)."""
    async for delta in generation.deltas():
        text, stopped = stops.push(delta.text)
        if stopped:
            result.finish_reason, result.stop_string = "length", None
            await generation.end("length")
            yield text, delta.logprobs
            return
        result.finish_reason = delta.finish_reason or result.finish_reason
        result.stop_string = delta.stop_string or result.stop_string
        yield text, delta.logprobs


def native_answer(generation: Generation, model: str, result: ChoiceResult, truncated: bool,
                  probs: list[TokenProbs] | None = None, tokens: Sequence[int] = (),
                  index: int = 0) -> NativeResponse:
    """The last (or only) answer of a one-stream generation, in llama.cpp's shape; `index`:
    its prompt's in the request."""
    stream = generation.streams[0]
    cached = stream.num_cached_tokens
    prompt, written = len(stream.spec.prompt_token_ids), stream.num_output_tokens
    kind = {"stop": "word" if result.stop_string else "eos", "length": "limit"}
    return NativeResponse(
        index=index, content=result.text, tokens=list(tokens), stop=True, model=model,
        truncated=truncated, tokens_predicted=written, tokens_evaluated=prompt,
        tokens_cached=cached, stop_type=kind.get(result.finish_reason, "none"),
        stopping_word=result.stop_string or "", completion_probabilities=probs,
        timings=NativeTimings.of(cached, prompt - cached, written, stream.timings()))
