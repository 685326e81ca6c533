"""Fill-in-the-middle through the server (tests/fim_helpers.py's model): llama.cpp's /infill,
whole and streamed in its own shape, and OpenAI's `suffix` on /v1/completions, which mean the
same prompt; the tokens that end a middle stop it."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.fim_helpers import fim_model_folder
from tests.server_helpers import REQUEST_TIMEOUT_S, openai_client, running_server

pytestmark = pytest.mark.slow

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
BODY = {"input_prefix": "def add(a, b):\n", "prompt": "    ", "input_suffix": SUFFIX,
        "n_predict": 12, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    folder = fim_model_folder(smollm2_dir, tmp_path_factory.mktemp("fim-model"))
    with running_server("--model", str(folder), "--served-model-name", "coder") as s:
        yield s


def infill(server, **body) -> dict:
    r = httpx.post(server.url + "/infill", json={**BODY, **body}, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def count(server, text: str) -> int:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    return len(r.json()["tokens"])


def test_infill_answers_in_llama_cpps_shape(server):
    got = infill(server)
    assert got["stop"] is True and got["model"] == "coder" and isinstance(got["content"], str)
    assert 1 <= got["tokens_predicted"] <= 12
    assert got["stop_type"] in ("eos", "limit")
    t = got["timings"]                              # llama.cpp's, which llama.vscode shows
    assert t["predicted_n"] == got["tokens_predicted"] and t["prompt_ms"] > 0
    assert t["prompt_n"] + t["cache_n"] == got["tokens_evaluated"]
    assert t["cache_n"] == got["tokens_cached"]
    if t["predicted_n"] > 1:
        assert t["predicted_per_second"] == pytest.approx(
            1e3 * t["predicted_n"] / t["predicted_ms"])
    # the prompt: the three markers around the prefix (with the cursor line) and the suffix
    # (and the repo's header, as llama.cpp writes it: the model has <reponame>, <file_sep>)
    header = 1 + count(server, "myproject\n") + 1 + count(server, "filename\n")
    assert got["tokens_evaluated"] == header + 3 + count(server, PREFIX) + count(server, SUFFIX)
    extra = [{"filename": "math_util.py", "text": "PI = 3.14"}]
    more = infill(server, input_extra=extra)
    assert more["tokens_evaluated"] == got["tokens_evaluated"] + 1 + count(
        server, "math_util.py\n") + count(server, "PI = 3.14")


def test_streamed_chunks_end_with_the_stop_chunk_and_no_done(server):
    whole = infill(server)
    with httpx.stream("POST", server.url + "/infill", json={**BODY, "stream": True},
                      timeout=REQUEST_TIMEOUT_S) as r:
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines]          # no [DONE]: every line is JSON
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert chunks[-1]["tokens_predicted"] == whole["tokens_predicted"]
    assert chunks[-1]["timings"]["predicted_n"] == whole["tokens_predicted"]


def test_openai_suffix_is_the_same_prompt(server):
    whole = infill(server)
    c = openai_client(server.url).completions.create(
        model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0.0)
    assert c.choices[0].text == whole["content"]
    assert c.usage.prompt_tokens == whole["tokens_evaluated"]


def test_the_models_end_of_middle_stops_it(server):
    pad = httpx.post(server.url + "/tokenize", json={"prompt": "<fim_pad>",
                                                      "add_special_tokens": False})
    (pad_id,) = pad.json()["tokens"]
    got = infill(server, logit_bias={str(pad_id): 100})    # the model writes <fim_pad> first
    assert got["content"] == "" and got["tokens_predicted"] == 1 and got["stop_type"] == "eos"


def test_llama_vscodes_stops_end_the_middle(server):
    nl = httpx.post(server.url + "/tokenize", json={"prompt": "\n", "add_special_tokens": False})
    (nl_id,) = nl.json()["tokens"]
    newlines = {"logit_bias": {str(nl_id): 100}, "n_predict": 8}    # it writes blank lines
    ended = 'finished_reason="length"', 'finished_reason="abort"'
    before = [server.metric("strata_request_success_total", e) for e in ended]
    got = infill(server, n_indent=4, **newlines)      # the second (blank) line is less indented
    assert (got["content"], got["tokens_predicted"], got["stop_type"]) == ("\n", 2, "limit")
    after = [server.metric("strata_request_success_total", e) for e in ended]
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)     # a stop, not an abort
    got = infill(server, t_max_predict_ms=1, **newlines)   # a step takes more than 1 ms
    assert (got["content"], got["stop_type"]) == ("\n\n", "limit")
    assert infill(server, **newlines)["tokens_predicted"] == 8            # without them
    with httpx.stream("POST", server.url + "/infill", json={**BODY, **newlines, "n_indent": 4,
                                                          "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(c["content"] for c in chunks) == "\n" and chunks[-1]["stop_type"] == "limit"


def test_a_prefix_over_the_context_is_cut_as_llama_cpp_cuts_it(server):
    """~10K tokens of prefix against an 8192-token context: not a 400 but the prefix's last
    3/4 of a 2048-token batch (1536 tokens, the cursor line after them), `truncated`."""
    long = "x = 1\n" * 2500
    assert count(server, long + BODY["input_prefix"]) > 8192
    got = infill(server, input_prefix=long + BODY["input_prefix"], n_predict=2)
    header = 1 + count(server, "myproject\n") + 1 + count(server, "filename\n")
    assert got["truncated"] is True
    assert got["tokens_evaluated"] == header + 3 + 1536 + count(server, BODY["prompt"]) \
        + count(server, SUFFIX)
    assert infill(server)["truncated"] is False


def test_bad_infill_requests_are_400(server):
    for body, param in (({"n": 2}, "n"), ({"suffix": "x"}, "suffix"),
                        ({"n_predict": -2}, "n_predict"), ({"n_indent": -1}, "n_indent")):
        r = httpx.post(server.url + "/infill", json={**BODY, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
