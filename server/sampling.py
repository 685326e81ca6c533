"""From a validated OpenAI request to engine SamplingParams (shared by chat and completions)."""
from __future__ import annotations

from scheduler.sampling_params import GrammarSpec, ReasoningMarks, SamplingParams
from server.errors import context_length_exceeded, invalid_request
from server.protocol import ChatCompletionRequest, CompletionRequest

Request = ChatCompletionRequest | CompletionRequest
# a temperature below this samples greedily (as vLLM's _SAMPLING_EPS): dividing logits by
# 1e-300 overflows them, and no one asks for that much sharpening on purpose
GREEDY_BELOW = 1e-5


# llama.cpp's sampler fields that map onto SamplingParams as they are, and its default window
LLAMACPP_SAMPLERS = ("typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold",
                     "dynatemp_range", "dynatemp_exponent", "mirostat", "mirostat_tau",
                     "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length",
                     "dry_penalty_last_n")
DRY_BREAKERS = ("\n", ":", "\"", "*")       # llama.cpp's default dry_sequence_breakers
LLAMACPP_REPEAT_LAST_N = 64


def resolve_max_tokens(requested: int | None, prompt_tokens: int, max_model_len: int,
                       param: str = "messages") -> int:
    """Tokens to generate at most; the rest of the context when the request does not say.

    Raises the 400 ``context_length_exceeded`` error when the prompt (plus the requested
    completion) does not fit in ``max_model_len``.
    """
    if prompt_tokens >= max_model_len:
        raise context_length_exceeded(max_model_len, prompt_tokens, requested, param)
    if requested is None:
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        raise context_length_exceeded(max_model_len, prompt_tokens, requested, param)
    return requested


def stop_strings(request: Request) -> tuple[str, ...]:
    if request.stop is None:
        return ()
    stops = [request.stop] if isinstance(request.stop, str) else request.stop
    return tuple(s for s in stops if s)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_request(f"Token id {bad} is out of range [0, {vocab_size}).", param=param)


def truncate_prompt(prompt_ids: list[int], keep: int | None, max_model_len: int,
                    max_tokens: int | None = None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as leave
    room for max_tokens, or for one token when the request does not say; None: all)."""
    if keep is None:
        return prompt_ids
    keep = max(1, max_model_len - (max_tokens or 1)) if keep == -1 else keep
    return prompt_ids[-keep:] if len(prompt_ids) > keep else prompt_ids


def dry_breaker_ids(request: Request, tokenizer) -> tuple[int, ...]:
    """DRY's sequence breakers as token ids (none where DRY is off): the last token of each
    breaker string (text-generation-webui's reading; llama.cpp also matches multi-token
    breakers whole)."""
    if not request.dry_multiplier:
        return ()
    breakers = DRY_BREAKERS if request.dry_sequence_breakers is None \
        else request.dry_sequence_breakers
    return tuple(sorted({ids[-1] for b in breakers
                         if (ids := tokenizer.encode(b, add_special_tokens=False))}))


def bad_words_token_ids(words, tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as its own tokens and, where a leading
    space changes its first token but not how many there are, as it would follow a space."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if bare and bare not in seqs:
            seqs.append(bare)
        if bare and len(spaced) == len(bare) and spaced[0] != bare[0] and spaced not in seqs:
            seqs.append(spaced)
    return tuple(seqs)


def prompt_logprobs_k(request: Request) -> int | None:
    """The prompt's top-k the engine computes: vLLM's prompt_logprobs, and on completions
    the legacy echo with logprobs (the echoed prompt's tokens carry logprobs too)."""
    k = request.prompt_logprobs
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        k = max(k or 0, request.logprobs)
    return k


MAX_CLIENT_CHARS = 256      # a `user` is a fair-share key, not data: longer ones are cut


def build_sampling_params(request: Request, *, max_tokens: int, seed_offset: int = 0,
                          vocab_size: int | None = None, grammar: GrammarSpec | None = None,
                          logit_bias: tuple[tuple[int, float], ...] = (),
                          bad_words: tuple[tuple[int, ...], ...] = (),
                          reasoning: ReasoningMarks | None = None,
                          lora: str | None = None,
                          dry_breakers: tuple[int, ...] = ()) -> SamplingParams:
    """SamplingParams for one choice; choice i of a seeded request uses seed + i;
    `reasoning`: the thinking span `grammar` leaves free."""
    min_tokens = request.min_tokens or 0
    if min_tokens > max_tokens:
        raise invalid_request(f"min_tokens ({min_tokens}) must not exceed max_tokens "
                              f"({max_tokens}).", param="min_tokens")
    stop_ids = tuple(request.stop_token_ids or ())
    allowed = request.allowed_token_ids
    if vocab_size is not None:
        check_token_ids(list(stop_ids), vocab_size, "stop_token_ids")
        check_token_ids(allowed or [], vocab_size, "allowed_token_ids")
    top_k = request.top_k or 0
    temperature = 1.0 if request.temperature is None else request.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if top_k < 0 else top_k,
        seed=None if request.seed is None else request.seed + seed_offset,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        min_p=request.min_p or 0.0,
        stop_token_ids=stop_ids,
        ignore_eos=bool(request.ignore_eos),
        logprobs=request.logprobs_k(),
        min_tokens=min_tokens,
        client=(getattr(request, "user", None) or "")[:MAX_CLIENT_CHARS],
        priority=request.priority or 0,
        logit_bias=logit_bias,
        grammar=grammar,
        allowed_token_ids=None if allowed is None else tuple(sorted(set(allowed))),
        prompt_logprobs=prompt_logprobs_k(request),
        bad_words=bad_words,
        reasoning=reasoning,
        cache_salt=request.cache_salt,
        lora=lora,
        dry_breakers=dry_breakers,
        **llamacpp_fields(request),
    )


def llamacpp_fields(request: Request) -> dict:
    """SamplingParams of the repetition penalty (vLLM's repetition_penalty over the prompt and
    output, or llama.cpp's repeat_penalty over the last repeat_last_n tokens, 64 unless given,
    -1 all, 0 none; one of the two: 400 for both) and of llama.cpp's other samplers."""
    penalty, window = request.repetition_penalty or 1.0, 0
    if request.repeat_penalty not in (None, 1.0):
        if penalty != 1.0:
            raise invalid_request("Give repetition_penalty (vLLM's, over the prompt and output) "
                                  "or repeat_penalty (llama.cpp's, over the last "
                                  "repeat_last_n tokens), not both.", param="repeat_penalty")
        last_n = LLAMACPP_REPEAT_LAST_N if request.repeat_last_n is None \
            else request.repeat_last_n
        if last_n != 0:
            penalty, window = request.repeat_penalty, max(last_n, 0)
    given = {name: getattr(request, name) for name in LLAMACPP_SAMPLERS}
    return dict(repetition_penalty=penalty, repetition_window=window,
                **{k: v for k, v in given.items() if v is not None})
