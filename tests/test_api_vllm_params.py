"""vLLM's request extensions through the official openai SDK (extra_body) against a real server:
allowed_token_ids, bad_words, include_stop_str_in_output, skip_special_tokens,
truncate_prompt_tokens, and the chat template's switches (add_generation_prompt,
continue_final_message, chat_template_kwargs)."""
from __future__ import annotations

import pytest

from tests.server_helpers import MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
SAY_HI = [{"role": "user", "content": "Say hi."}]


def complete(client, prompt=PROMPT, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0,
                                     extra_body=extra or None).choices[0]


def token_ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_allowed_token_ids_are_the_only_tokens_sampled(client, http):
    allowed = sorted({t for w in (" yes", " no", " maybe") for t in token_ids(http, w)})
    texts = {http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=SAY_HI, max_tokens=6, temperature=1.0, seed=seed,
            logprobs=True, extra_body={"allowed_token_ids": allowed})
        tokens = [c.token for c in r.choices[0].logprobs.content]
        assert len(tokens) == 6 and set(tokens) <= texts, tokens


def test_bad_words_change_the_greedy_answer_where_the_word_came(client, http):
    free = complete(client).text
    word = next(w for w in (w.strip(".,") for w in free.split()) if w.isalpha())
    at = free.index(word)
    banned = complete(client, bad_words=[word]).text
    assert banned != free
    # greedy: the same text up to the banned word (whose token may carry the space before it)
    assert banned.startswith(free[:at].rstrip())


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    free = complete(client).text
    stop = free.split()[1]
    cut = complete(client, stop=[stop]).text
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0,
                                     stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert cut == free[:free.index(stop)]
    assert kept.text == cut + stop and kept.finish_reason == "stop"


def test_a_stop_token_is_counted_and_its_text_kept_only_when_asked(client, http):
    free = complete(client).text
    period = token_ids(http, ".")
    assert len(period) == 1 and "." in free
    left = complete(client, stop_token_ids=period)
    kept = complete(client, stop_token_ids=period, include_stop_str_in_output=True)
    assert left.finish_reason == kept.finish_reason == "stop"
    assert kept.text == left.text + "." and not left.text.endswith(".")


def test_skip_special_tokens_false_writes_the_end_of_turn_when_asked(client):
    def answer(**extra):
        r = client.chat.completions.create(model=MODEL, messages=SAY_HI, max_tokens=64,
                                           temperature=0.0, extra_body=extra or None)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    plain = answer()
    assert answer(skip_special_tokens=False) == plain        # the EOS ended it: not written
    assert answer(skip_special_tokens=False, include_stop_str_in_output=True) == \
        plain + "<|im_end|>"


def test_truncate_prompt_tokens_keeps_the_tail_of_a_prompt_over_the_context(client, http):
    limit = client.models.list().data[0].model_extra["max_model_len"]
    long = "the sea and the sky " * limit                      # several times the context
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=4,
                                  extra_body={"truncate_prompt_tokens": 64})
    assert r.usage.prompt_tokens == 64
    tail = token_ids(http, long)[-64:]
    r2 = client.completions.create(model=MODEL, prompt=tail, max_tokens=4, temperature=0.0)
    r1 = client.completions.create(model=MODEL, prompt=long, max_tokens=4, temperature=0.0,
                                   extra_body={"truncate_prompt_tokens": 64})
    assert r1.choices[0].text == r2.choices[0].text
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 4})
    assert r.status_code == 400                                # without it: too long


def test_continue_final_message_continues_the_assistants_text(client, http):
    messages = SAY_HI + [{"role": "assistant", "content": "Hello! The capital of France is"}]
    switches = {"add_generation_prompt": False, "continue_final_message": True}
    rendered = http.post("/v1/chat/completions/render",
                         json={"model": MODEL, "messages": messages, **switches}).json()
    text = http.post("/detokenize", json={"tokens": rendered["token_ids"]}).json()["prompt"]
    assert text.endswith("assistant\nHello! The capital of France is")
    tokenized = http.post("/tokenize", json={"messages": messages, **switches}).json()
    assert tokenized["tokens"] == rendered["token_ids"]       # /tokenize takes the switches too
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       temperature=0.0, extra_body=switches)
    same = client.completions.create(model=MODEL, prompt=rendered["token_ids"], max_tokens=8,
                                     temperature=0.0)
    assert r.choices[0].message.content == same.choices[0].text
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_chat_template_kwargs_are_passed_and_reserved_names_refused(http):
    body = {"model": MODEL, "messages": SAY_HI, "max_tokens": 1}
    ok = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"x": 1}})
    assert ok.status_code == 200, ok.text
    bad = http.post("/v1/chat/completions",
                    json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    bad = http.post("/tokenize", json={"messages": SAY_HI, "continue_final_message": True,
                                       "add_generation_prompt": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, api):
    # vLLM's stream_options.continuous_usage_stats (with include_usage)
    kw = dict(model=MODEL, max_tokens=12, temperature=0.0, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if api == "chat":
        chunks = list(client.chat.completions.create(messages=SAY_HI, **kw))
        whole = client.chat.completions.create(messages=SAY_HI, model=MODEL, max_tokens=12,
                                               temperature=0.0)
    else:
        chunks = list(client.completions.create(prompt="Once upon a time", **kw))
        whole = client.completions.create(prompt="Once upon a time", model=MODEL,
                                          max_tokens=12, temperature=0.0)
    used = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and used == sorted(used)
    last = chunks[-1].usage       # (the cached tokens differ: the second request hits)
    assert (last.completion_tokens, last.total_tokens) == (whole.usage.completion_tokens,
                                                           whole.usage.total_tokens)
    assert used[0] < used[-1]
    assert {c.usage.prompt_tokens for c in chunks} == {whole.usage.prompt_tokens}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_cache_salt_keeps_a_prompts_cached_pages_to_its_own_salt(client, http, api):
    # vLLM's cache_salt: a tenant's prompt pages are never read by a prompt without its salt
    doc = f"Salted lines of a {api} ledger, one after the other. " * 12 + "What was recorded?"

    def cached(salt):
        extra = {"cache_salt": salt} if salt else None
        if api == "chat":
            r = client.chat.completions.create(
                model=MODEL, max_tokens=2, temperature=0.0, extra_body=extra,
                messages=[{"role": "user", "content": doc}])
            return r.usage.prompt_tokens_details.cached_tokens
        r = client.responses.create(model=MODEL, input=doc, max_output_tokens=2,
                                    temperature=0.0, store=False, extra_body=extra)
        return r.usage.input_tokens_details.cached_tokens

    first = cached(f"{api}-a")
    hits = [cached(f"{api}-b"), cached(None), cached(f"{api}-a"), cached(None)]
    # (unsalted, the chat template's opening page may be cached by earlier tests' prompts)
    assert first == hits[0] == 0 and hits[1] < 100 and hits[2] == hits[3] > 100
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": SAY_HI,
                                                "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_llamacpp_samplers_reach_the_engine(client):
    # llama.cpp's fields that leave only the top token make a sampled answer the greedy one
    kw = dict(model=MODEL, messages=SAY_HI, max_tokens=16)
    greedy = client.chat.completions.create(temperature=0.0, **kw).choices[0].message.content

    def sampled(**extra):
        return client.chat.completions.create(temperature=1.5, seed=3, extra_body=extra or None,
                                              **kw).choices[0].message.content
    assert sampled() != greedy
    assert sampled(top_n_sigma=1e-4) == greedy
    assert sampled(mirostat=2, mirostat_tau=0.01) == greedy
    assert sampled(mirostat=1, mirostat_tau=0.01) == greedy


def test_dry_keeps_a_greedy_answer_from_repeating_the_prompt(client):
    # llama.cpp's DRY: the prompt's repeated stretch makes " 4" the greedy continuation; DRY
    # penalizes the token that would extend the repeat, unless a breaker splits the stretches
    prompt = "7, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0)
    plain = client.completions.create(**kw).choices[0].text
    assert plain.startswith(" 4")
    dry = dict(dry_multiplier=4.0, dry_allowed_length=2)
    assert not client.completions.create(**kw, extra_body=dry).choices[0].text.startswith(" 4")
    broken = client.completions.create(**kw, extra_body={**dry, "dry_sequence_breakers": [","]})
    assert broken.choices[0].text == plain
