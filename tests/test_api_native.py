"""llama.cpp's native POST /completion (and /completions at the root) through the server: its
answer shape, the same text as /v1/completions for the same prompt, return_tokens, n_probs'
completion_probabilities, streamed chunks without [DONE], several prompts as an array, and
its 400s."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.server_helpers import REQUEST_TIMEOUT_S, openai_client, running_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
BODY = {"prompt": PROMPT, "n_predict": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def server():
    # float32: answers reached two ways (this route, /v1/completions) cross no bf16 near tie
    with running_server("--dtype", "fp32") as s:
        yield s


def complete(server, path: str = "/completion", **body):
    r = httpx.post(server.url + path, json={**BODY, **body}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_answer_in_llama_cpps_shape_with_the_v1_text(server):
    got = complete(server)
    assert got["stop"] is True and isinstance(got["content"], str) and got["content"]
    assert got["tokens_predicted"] == 8 and got["stop_type"] == "limit"
    assert got["tokens"] == [] and "completion_probabilities" not in got
    t = got["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == got["tokens_evaluated"]
    client = openai_client(server.url)
    v1 = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                   max_tokens=8, temperature=0.0)
    assert v1.choices[0].text == got["content"]
    assert v1.usage.prompt_tokens == got["tokens_evaluated"]
    assert complete(server, "/completions")["content"] == got["content"]     # the alias


def test_return_tokens_are_the_written_ids(server):
    got = complete(server, return_tokens=True)
    assert len(got["tokens"]) == got["tokens_predicted"] == 8
    text = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert text["prompt"] == got["content"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = complete(server, prompt=ids, return_tokens=True)      # token ids as the prompt
    assert by_ids["tokens"] == got["tokens"]


def test_n_probs_gives_each_tokens_alternatives(server):
    got = complete(server, n_probs=3, return_tokens=True)
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == got["tokens"]
    assert bytes(b for p in probs for b in p["bytes"]).decode() == got["content"]
    for p in probs:
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == p["id"]          # greedy: the likeliest
        assert top[0]["logprob"] == pytest.approx(p["logprob"])
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-4
    client = openai_client(server.url)
    v1 = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                   max_tokens=8, temperature=0.0, logprobs=1)
    assert v1.choices[0].logprobs.token_logprobs == pytest.approx(
        [p["logprob"] for p in probs], abs=1e-4)


def test_streamed_chunks_carry_their_tokens_and_end_with_the_stop_chunk(server):
    whole = complete(server, n_probs=2)
    with httpx.stream("POST", server.url + "/completion",
                      json={**BODY, "stream": True, "n_probs": 2},
                      timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines]          # no [DONE]: every line is JSON
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    streamed = [p for c in chunks[:-1] for p in c["completion_probabilities"]]
    assert [p["id"] for p in streamed] == [p["id"] for p in whole["completion_probabilities"]]
    assert chunks[-1]["tokens_predicted"] == 8 and chunks[-1]["timings"]["predicted_n"] == 8


def test_several_prompts_answer_as_an_array_in_their_order(server):
    other = "Water boils at"
    got = complete(server, prompt=[PROMPT, other])
    assert isinstance(got, list) and [a["index"] for a in got] == [0, 1]
    assert got[0]["content"] == complete(server)["content"]
    assert got[1]["content"] == complete(server, prompt=other)["content"]


def test_llama_cpps_grammar_and_json_schema_constrain_the_text(server):
    got = complete(server, grammar='root ::= "yes" | "no"', n_predict=5)
    assert got["content"] in ("yes", "no")
    got = complete(server, json_schema={"type": "string", "enum": ["red", "blue"]},
                   n_predict=8)
    assert json.loads(got["content"]) in ("red", "blue")


def test_more_stop_strings_than_openais_four(server):
    whole = complete(server)["content"]
    cut = whole.strip().split()[0]
    got = complete(server, stop=["zq1", "zq2", "zq3", "zq4", "zq5", cut])
    assert got["stop_type"] == "word" and got["stopping_word"] == cut
    assert got["content"] == whole[:whole.index(cut)]


def test_a_prompt_cut_by_truncate_prompt_tokens_says_truncated(server):
    assert complete(server)["truncated"] is False
    got = complete(server, truncate_prompt_tokens=2)
    assert got["truncated"] is True and got["tokens_evaluated"] == 2


def test_n_predict_zero_writes_one_token(server):
    got = complete(server, n_predict=0)
    assert got["tokens_predicted"] == 1


def test_bad_native_requests_are_400(server):
    for body, param in (({"n": 2}, "n"), ({"n_probs": 21}, "n_probs"),
                        ({"n_predict": -2}, "n_predict"), ({"logprobs": 2}, "logprobs"),
                        ({"prompt": [PROMPT, "x"], "stream": True}, "prompt"),
                        ({"prompt": []}, "prompt"), ({"post_sampling_probs": True},
                                                     "post_sampling_probs"),
                        ({"suffix": "x"}, "suffix")):
        r = httpx.post(server.url + "/completion", json={**BODY, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    ok = httpx.post(server.url + "/completion", json=BODY, timeout=REQUEST_TIMEOUT_S)
    assert ok.status_code == 200                            # and the server serves on
