"""The prompt's logprobs through the openai SDK against a real server: the legacy echo with
logprobs (what lm-evaluation-harness's loglikelihood tasks send), vLLM's prompt_logprobs on
completions and chat, chunked prefills, and the prefix cache (skipped for these requests)."""
from __future__ import annotations

import math

import pytest

from tests.server_helpers import MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is"


def prompt_ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_with_logprobs_scores_every_prompt_token_as_lm_eval_asks(client, http):
    # lm-evaluation-harness's local-completions loglikelihood request
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0,
                                  logprobs=1, echo=True, seed=1234)
    choice, ids = r.choices[0], prompt_ids(http, PROMPT)
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0.0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # the prompt's likeliest continuation ranks first where the prompt has it
    paris = lp.tokens.index(" Paris")
    assert lp.top_logprobs[paris][" Paris"] == lp.token_logprobs[paris]


def test_a_prompt_tokens_logprob_is_the_one_a_completion_of_its_prefix_gets(client):
    head = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0.0,
                                     logprobs=1)
    token, logprob = head.choices[0].logprobs.tokens[0], head.choices[0].logprobs.token_logprobs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT + token, max_tokens=1,
                                  temperature=0.0, logprobs=0, echo=True)
    lp = r.choices[0].logprobs
    at = len(lp.tokens) - 2                          # the last prompt token
    assert lp.tokens[at] == token
    assert math.isclose(lp.token_logprobs[at], logprob, abs_tol=0.05)


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_prompt_logprobs_give_each_tokens_entry_and_top_k(client, http, chat):
    k = 2
    if chat:
        r = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0.0,
                                           messages=[{"role": "user", "content": PROMPT}],
                                           extra_body={"prompt_logprobs": k})
        entries = r.model_extra["prompt_logprobs"]
        ids = http.post("/v1/chat/completions/render", json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}).json()["token_ids"]
    else:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                      temperature=0.0, extra_body={"prompt_logprobs": k})
        entries = r.choices[0].model_extra["prompt_logprobs"]
        ids = prompt_ids(http, PROMPT)
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:]):
        own = entry[str(token)]
        assert own["logprob"] <= 0.0 and own["rank"] >= 1
        top = sorted(e["rank"] for e in entry.values() if e["rank"] <= k)
        assert len(entry) <= k + 1 and top == list(range(1, k + 1))


def test_a_one_token_prompt_has_one_null_entry(client, http):
    r = client.completions.create(model=MODEL, prompt=prompt_ids(http, PROMPT)[:1], max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    assert r.choices[0].model_extra["prompt_logprobs"] == [None]


def test_prompt_logprobs_cover_a_chunked_prefill_and_skip_the_prefix_cache(client, http):
    text = "the sea and the sky " * 700               # ~3.5K tokens: more than one chunk
    ids = prompt_ids(http, text)
    first = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0.0)
    again = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0.0,
                                      extra_body={"prompt_logprobs": 0})
    entries = again.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    assert all(e is not None and str(t) in e for t, e in zip(ids[1:], entries[1:]))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 0    # computed whole
    # a repetitive text: its later tokens are near certain
    assert max(e[str(t)]["logprob"] for t, e in zip(ids[-50:], entries[-50:])) > -0.1


def test_streamed_completions_carry_prompt_logprobs_and_chat_streams_refuse_them(client, http):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                       temperature=0.0, stream=True, logprobs=1, echo=True,
                                       extra_body={"prompt_logprobs": 1})
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
    assert len(first.model_extra["prompt_logprobs"]) == len(prompt_ids(http, PROMPT))
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
