"""OpenAI API wire models of requests (chat completions, completions) and their checks; the
responses are in server/protocol_responses.py.

Fields follow the order of the OpenAI API reference; the vLLM extensions (top_k, ignore_eos,
min_tokens, stop_token_ids, guided_*) come last. Unknown request fields that change nothing
(metadata, store, ...) are accepted and ignored; known ones that would change the output and
are not supported are ``Unsupported`` (400 naming the field: docs/api.md "Fields").
Constraints live in the shared ``Annotated`` aliases so both request models check the same way.
Integers and booleans are strict (``"2"`` is not 2, ``"yes"`` and ``1`` are not true); every
string must be encodable as UTF-8 (a lone UTF-16 surrogate such as ``"\ud800"`` is a 400); a
seed is a 64-bit signed integer, as in vLLM.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, ConfigDict, Field, StrictBool, StrictInt,
                      field_validator, model_validator)

# NOTE: the base models live in protocol_tools.py (imported here, not the other way round)
from server.protocol_tools import (ChatTool, LlamaCppOffAtOne,
                                   MessageToolCall, OnlyFalse, OnlyText,
                                   OnlyTrue, ResponseFormat, ToolChoice, Unsupported,
                                   _Request)

MAX_N = 16                 # choices per request (each choice is one engine request)
MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5

SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 63 - 1
MAX_LOGIT_BIAS = 1024      # token ids in one logit_bias
MAX_TOOLS = 128
MAX_GUIDED_CHOICES = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_PROMPT_LOGPROBS = 20
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_BREAKERS = 32          # DRY's sequence breakers
MAX_BREAKER_CHARS = 32
MAX_TEMPLATE_CHARS = 65536  # a request's own chat template (--trust-request-chat-template)
# chat_template_kwargs may not replace what the server passes the template itself
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt",
                                      "bos_token", "eos_token"})


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid Unicode (a lone UTF-16 surrogate?)") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
Temperature = Annotated[float | None, Field(ge=0.0, le=2.0)]
TopP = Annotated[float | None, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]
NumChoices = Annotated[StrictInt | None, Field(ge=1, le=MAX_N)]
MaxTokens = Annotated[StrictInt | None, Field(ge=1)]
Stop = Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None
TopK = Annotated[StrictInt | None, Field(ge=-1)]
MinTokens = Annotated[StrictInt | None, Field(ge=0)]
TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId] | None, Field(default=None)]
Seed = Annotated[StrictInt | None, Field(ge=SEED_MIN, le=SEED_MAX)]
# vLLM's cache_salt: the prefix cache pages a request reads and adds are its salt's alone
CacheSalt = Annotated[Text | None, Field(min_length=1, max_length=1024)]
Flag = StrictBool | None
RequestTemplate = Annotated[Text | None, Field(min_length=1, max_length=MAX_TEMPLATE_CHARS)]
# vLLM's priority: lower runs sooner (--scheduling-policy priority; else only 0)
Priority = Annotated[StrictInt | None, Field(ge=-2 ** 31, le=2 ** 31 - 1)]


def _logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    for key, bias in (value or {}).items():
        if not key.strip().isdigit():
            raise ValueError(f"the keys are token ids, got {key!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"a bias is between -100 and 100, got {bias} for token {key}")
    return value


LogitBias = Annotated[dict[str, float] | None,
                      Field(default=None, max_length=MAX_LOGIT_BIAS), AfterValidator(_logit_bias)]


class StreamOptions(_Request):
    include_usage: Flag = False
    continuous_usage_stats: Flag = False     # vLLM's: the usage so far on every chunk

    @property
    def usage_on_every_chunk(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)


class TextContentPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None     # an assistant's earlier calls
    tool_call_id: Text | None = None                     # the call a tool message answers

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        """The message content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def _check_continue_final_message(value: bool | None, info) -> bool | None:
    """continue_final_message (a field validator's check; add_generation_prompt and messages
    are fields before it): the answer continues the last message, the assistant's."""
    if value:
        if info.data.get("add_generation_prompt") is not False:      # null: its default
            raise ValueError("continue_final_message needs add_generation_prompt false: "
                             "the answer continues the last message, not a new turn")
        messages = info.data.get("messages") or []
        if messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
    return value


def _check_template_kwargs(value: dict | None) -> dict | None:
    reserved = RESERVED_TEMPLATE_KWARGS & set(value or ())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}")
    return value


# the chat template's switches, as chat requests and /tokenize take them (declared after
# `messages` and `add_generation_prompt`, which continue_final_message's check reads)
ContinueFinalMessage = Annotated[StrictBool | None, AfterValidator(_check_continue_final_message)]
TemplateKwargs = Annotated[dict[str, Any] | None, AfterValidator(_check_template_kwargs)]


def _check_top_logprobs(value: int | None, logprobs: bool | None) -> int | None:
    if value is not None and not logprobs:
        raise ValueError("top_logprobs requires logprobs to be true")
    return value


Choices = Annotated[list[Text] | None, Field(min_length=1, max_length=MAX_GUIDED_CHOICES)]


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` (its guided_* fields' successor since v0.12): exactly one
    constraint (json, regex, choice, grammar, json_object) and its options."""
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_schema: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Choices = None
    grammar: Text | None = None
    json_object: Flag = None
    # JSON objects closed where the schema leaves additionalProperties out
    disable_additional_properties: Flag = None
    disable_fallback: Flag = None           # one backend (llguidance): no fallback to turn off
    disable_any_whitespace: Flag = None     # our JSON has no free whitespace either way
    structural_tag: Unsupported = None
    whitespace_pattern: Unsupported = None

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in ("json_schema", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object")
        return self


class _Constrained(_Request):
    """What every generation request shares: structured outputs (OpenAI and vLLM's guided_*),
    logit_bias, and the output-changing fields Strata refuses rather than ignores."""
    logit_bias: LogitBias = None
    response_format: ResponseFormat | None = None
    # extensions (vLLM): sampling knobs; the output matches a JSON Schema, a regex, one of
    # some strings, or a Lark / GBNF grammar
    repetition_penalty: Annotated[float | None, Field(gt=0.0, le=10.0)] = None
    min_p: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Choices = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: Text | None = None     # ours is llguidance, whatever is asked
    # vLLM's token-level controls: only these tokens may be sampled; token sequences the
    # output never ends with; keep the last k prompt tokens (-1: as many as leave room for
    # the answer);
    # the matched stop string kept in the text; special tokens written into the text
    allowed_token_ids: Annotated[list[TokenId] | None,
                                 Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] = None
    bad_words: Annotated[list[Annotated[Text, Field(max_length=MAX_BAD_WORD_CHARS)]] | None,
                         Field(max_length=MAX_BAD_WORDS)] = None
    truncate_prompt_tokens: Annotated[StrictInt | None, Field(ge=-1)] = None
    include_stop_str_in_output: Flag = False
    skip_special_tokens: Flag = True
    # each prompt token's logprob (after the first) and the top k there (vLLM's); the prompt
    # is then computed whole, without the prefix cache
    prompt_logprobs: Annotated[StrictInt | None, Field(ge=0, le=MAX_PROMPT_LOGPROBS)] = None
    cache_salt: CacheSalt = None
    priority: Priority = None
    # refused: they would change the output and are not implemented
    use_beam_search: OnlyFalse = None
    length_penalty: Unsupported = None
    spaces_between_special_tokens: OnlyTrue = None
    # llama.cpp's samplers (its /v1 routes take them): engine/sampler_llamacpp.py
    repeat_penalty: Annotated[float | None, Field(gt=0.0, le=10.0)] = None
    repeat_last_n: Annotated[StrictInt | None, Field(ge=-1)] = None
    typical_p: Annotated[float | None, Field(gt=0.0, le=1.0)] = None
    top_n_sigma: Annotated[float | None, Field(ge=-1e6, le=1e6)] = None
    xtc_probability: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    xtc_threshold: Annotated[float | None, Field(ge=0.0, le=1.0)] = None
    dynatemp_range: Annotated[float | None, Field(ge=0.0, le=10.0)] = None
    dynatemp_exponent: Annotated[float | None, Field(ge=0.0, le=10.0)] = None
    mirostat: Annotated[StrictInt | None, Field(ge=0, le=2)] = None
    mirostat_tau: Annotated[float | None, Field(gt=0.0, le=100.0)] = None
    mirostat_eta: Annotated[float | None, Field(gt=0.0, le=10.0)] = None
    dry_multiplier: Annotated[float | None, Field(ge=0.0, le=100.0)] = None
    dry_base: Annotated[float | None, Field(ge=1.0, le=10.0)] = None
    dry_allowed_length: Annotated[StrictInt | None, Field(ge=0, le=1000)] = None
    dry_penalty_last_n: Annotated[StrictInt | None, Field(ge=-1)] = None
    dry_sequence_breakers: Annotated[list[Annotated[Text, Field(min_length=1,
                                                                max_length=MAX_BREAKER_CHARS)]]
                                     | None, Field(max_length=MAX_BREAKERS)] = None
    # ... refused unless off: not implemented (gone from llama.cpp too)
    tfs_z: LlamaCppOffAtOne = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_is_positive_or_all(cls, value):
        if value == 0:
            raise ValueError("truncate_prompt_tokens keeps the last k >= 1 prompt tokens, or "
                             "-1 for as many as leave room for the answer")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words_have_text(cls, value):
        if value is not None and any(not w.strip() for w in value):
            raise ValueError("a bad word must have a non-blank text")
        return value

    def guided_fields(self) -> dict[str, Any]:
        """The structured-output fields given (not None), by name."""
        return {k: v for k in ("response_format", "guided_json", "guided_regex",
                                "guided_choice", "guided_grammar", "structured_outputs")
                if (v := getattr(self, k)) is not None}


class ChatCompletionRequest(_Constrained):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    frequency_penalty: Penalty = 0.0
    logprobs: Flag = False
    max_completion_tokens: MaxTokens = None
    max_tokens: MaxTokens = None
    n: NumChoices = 1
    presence_penalty: Penalty = 0.0
    seed: Seed = None
    stop: Stop = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = None
    top_logprobs: Annotated[StrictInt | None, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] = None
    top_p: TopP = None
    user: Text | None = None
    tools: Annotated[list[ChatTool] | None, Field(max_length=MAX_TOOLS)] = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Flag = None
    # refused (OpenAI): other modalities, deprecated functions, reasoning and search knobs
    audio: Unsupported = None
    modalities: OnlyText = None
    functions: Unsupported = None
    function_call: Unsupported = None
    reasoning_effort: Unsupported = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    # extensions (vLLM)
    top_k: TopK = None
    ignore_eos: Flag = False
    min_tokens: MinTokens = 0
    stop_token_ids: TokenIds = None
    echo: OnlyFalse = None
    # the chat template's switches (vLLM): end with the assistant's turn opened (default), or
    # not; continue the last (assistant) message instead of starting a new one; more
    # variables for the template
    add_generation_prompt: Flag = True
    continue_final_message: ContinueFinalMessage = False
    chat_template_kwargs: TemplateKwargs = None
    # vLLM's: false leaves a reasoning model's <think> text out of the answer
    include_reasoning: Flag = True
    # vLLM's: a Jinja template instead of the model's (--trust-request-chat-template)
    chat_template: RequestTemplate = None
    documents: Unsupported = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value, info):
        return _check_top_logprobs(value, info.data.get("logprobs"))

    def requested_max_tokens(self) -> int | None:
        return (self.max_completion_tokens if self.max_completion_tokens is not None
                else self.max_tokens)

    def logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: None when off, else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


# A prompt is text, a batch of texts, one token-id list or a batch of token-id lists.
Prompt = Text | list[Text] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_Constrained):
    model: Text | None = None
    prompt: Prompt
    best_of: Annotated[StrictInt | None, Field(ge=1, le=MAX_N)] = None
    echo: Flag = False
    frequency_penalty: Penalty = 0.0
    logprobs: Annotated[StrictInt | None, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] = None
    max_tokens: MaxTokens = 16            # the legacy API defaults to 16
    n: NumChoices = 1
    presence_penalty: Penalty = 0.0
    seed: Seed = None
    stop: Stop = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    suffix: Text | None = None            # the text after the completion (server/fim.py)
    temperature: Temperature = None
    top_p: TopP = None
    user: Text | None = None
    # extensions (vLLM)
    top_k: TopK = None
    ignore_eos: Flag = False
    min_tokens: MinTokens = 0
    stop_token_ids: TokenIds = None

    @model_validator(mode="after")
    def _best_of_is_n(self):
        # NOTE: best_of > n would rank candidates by their total logprob: not implemented
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of equal to n is supported by this server")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_k(self) -> int | None:
        return self.logprobs
