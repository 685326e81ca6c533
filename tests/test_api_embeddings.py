"""/v1/embeddings through the official openai SDK against a real server: the vectors equal
transformers' final hidden state of each input's last token, normalized; base64 (the SDK's
default) and float encodings agree, token-id inputs equal their text, an embedded document's
pages serve a later chat about it, and the 400s name `input` / `dimensions`."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.server_helpers import openai_client, running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 512
DOC = "The harbour log lists ships, cargo and weather for each day of the week. " * 4
TEXTS = ["Disks are slow; memory is fast.", DOC, "Hi"]


@pytest.fixture(scope="module")
def server():
    with running_server("--max-model-len", str(CONTEXT), "--dtype", "fp32",
                        "--weights", "fp32") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def test_embeddings_are_the_last_tokens_normed_hidden_states(client, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    r = client.embeddings.create(model=MODEL, input=TEXTS)          # base64 on the wire
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    lengths = [len(tok(t)["input_ids"]) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(lengths)
    for text, d in zip(TEXTS, r.data):
        with torch.no_grad():
            hidden = hf(torch.tensor([tok(text)["input_ids"]]),
                        output_hidden_states=True).hidden_states[-1][0, -1]
        got = torch.tensor(d.embedding)
        assert got.shape == (576,) and abs(got.norm() - 1) < 1e-5
        assert torch.dot(got, hidden / hidden.norm()) > 0.9999


def test_float_and_base64_and_token_ids_agree(client, server):
    b64 = client.embeddings.create(model=MODEL, input=TEXTS[0])
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert torch.allclose(torch.tensor(b64.data[0].embedding),
                          torch.tensor(floats.data[0].embedding))
    ids = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": TEXTS[0]},
                     timeout=30).json()["tokens"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids], encoding_format="float")
    for d in by_ids.data:
        assert torch.allclose(torch.tensor(d.embedding),
                              torch.tensor(floats.data[0].embedding), atol=1e-5)


def test_an_input_may_fill_the_whole_context(client):
    # no token follows an input: one of exactly --max-model-len tokens is embedded
    ids = [504 + i % 100 for i in range(CONTEXT)]
    r = client.embeddings.create(model=MODEL, input=[ids, ids[:-1]])
    assert r.usage.prompt_tokens == 2 * CONTEXT - 1 and len(r.data[0].embedding) == 576


def test_an_embedded_document_is_prefilled_once(client):
    client.embeddings.create(model=MODEL, input=DOC)
    r = client.completions.create(model=MODEL, prompt=DOC + "The log is about", max_tokens=4,
                                  temperature=0.0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 32       # its full pages


@pytest.mark.parametrize("body, param", [
    ({"input": "word " * CONTEXT}, "input"),              # over the context
    ({"input": [[504] * (CONTEXT + 1)]}, "input"),        # one token over it
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ""}, "input"),                             # no tokens (no BOS here)
    ({"input": [10 ** 9]}, "input"),                      # outside the vocabulary
    ({"input": "hi", "dimensions": 64}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_inputs_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")


def test_more_inputs_than_a_client_may_have_waiting_run_in_waves(smollm2_dir):
    # --max-waiting 4: 10 inputs are three waves, not a 400
    with running_server("--max-model-len", str(CONTEXT), "--max-waiting", "4") as s:
        texts = [f"Item number {i} of the list." for i in range(10)]
        r = openai_client(s.url).embeddings.create(model=MODEL, input=texts,
                                                   encoding_format="float")
        assert [d.index for d in r.data] == list(range(10))
        alone = openai_client(s.url).embeddings.create(model=MODEL, input=texts[7],
                                                       encoding_format="float")
        assert torch.dot(torch.tensor(r.data[7].embedding),
                         torch.tensor(alone.data[0].embedding)) > 0.999


def test_embedding_requests_count_as_stopped_requests_and_generate_no_tokens(client, server):
    def metrics() -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(("strata_request_success_total", "strata_generation_tokens_total",
                                "strata_prompt_tokens_total")):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out
    before = metrics()
    client.embeddings.create(model=MODEL, input=["one text", "and another"])
    after = metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta['strata_request_success_total{finished_reason="stop"}'] == 2
    assert delta.get('strata_request_success_total{finished_reason="length"}', 0) == 0
    assert delta["strata_generation_tokens_total"] == 0
    assert delta["strata_prompt_tokens_total"] > 0
