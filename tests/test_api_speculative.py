"""A server with n-gram speculation (--speculative-config) through the official openai SDK:
several tokens a step reach the client as they would one by one (streamed or whole, with
logprobs, max_tokens and stop strings), and /metrics counts the drafts."""
from __future__ import annotations

import pytest

from tests.server_helpers import fresh_salt

pytestmark = pytest.mark.slow

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, ' \
       '"prompt_lookup_min": 2, "draft_p_min": 0}'      # every draft verified
LIST = "\n".join(f"- item {i}: the {w} box" for i, w in enumerate(
    ["red", "green", "blue", "small", "large", "old", "new", "empty", "round", "square"]))
MESSAGES = [{"role": "user", "content": f"Copy this list exactly, one item a line:\n{LIST}"}]


@pytest.fixture(scope="module")
def server():
    from tests.server_helpers import running_server
    # NOTE: float32 activations: with bf16 (--dtype auto on a CPU with AVX512_BF16) the
    # bundled model stands at near ties these answers cross (docs/perf-notes.md, 2026-11-29)
    with running_server("--speculative-config", SPEC, "--dtype", "fp32") as proc:
        yield proc


def chat(client, **kw):
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                          temperature=0.0, extra_body=fresh_salt(), **kw)


def test_drafts_are_verified_and_the_answer_is_whole(client, server):
    before = server.metric("strata_spec_decode_num_accepted_tokens_total")
    whole = chat(client, max_tokens=80, logprobs=True)
    c = whole.choices[0]
    assert whole.usage.completion_tokens == 80 and c.finish_reason == "length"
    assert len(c.logprobs.content) == 80
    assert "item" in c.message.content
    drafts = server.metric("strata_spec_decode_num_drafts_total")
    kept = server.metric("strata_spec_decode_num_accepted_tokens_total") - before
    assert drafts > 0 and kept > 0
    assert kept <= server.metric("strata_spec_decode_num_draft_tokens_total")
    # streamed: the same text, every token's logprob once
    text, lps = "", 0
    for chunk in chat(client, max_tokens=80, logprobs=True, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            lps += len(chunk.choices[0].logprobs.content or []) if chunk.choices[0].logprobs \
                else 0
    assert text == c.message.content and lps == 80


def test_max_tokens_and_stop_strings_cut_where_they_would_one_token_a_step(client):
    full = chat(client, max_tokens=60).choices[0].message.content
    for n in (1, 2, 3, 7, 13):
        c = chat(client, max_tokens=n)
        assert c.usage.completion_tokens == n
        assert full.startswith(c.choices[0].message.content)
    # a stop string that the first token of a step of several tokens completes: the rest
    # of that step is neither written nor counted
    steps = [[t.token for t in chunk.choices[0].logprobs.content]
             for chunk in chat(client, max_tokens=60, logprobs=True, stream=True)
             if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content]
    before, stop, count = "", None, 0
    for step in steps:
        word = step[0].strip()
        if len(step) > 1 and len(word) >= 3 and word not in before + step[0][:-1]:
            stop, count = word, count + 1
            break
        before += "".join(step)
        count += len(step)
    assert stop is not None, steps
    r = chat(client, max_tokens=60, stop=[stop], logprobs=True)
    c = r.choices[0]
    assert c.message.content == full[:full.index(stop)] and c.finish_reason == "stop"
    assert r.usage.completion_tokens == count == len(c.logprobs.content)
