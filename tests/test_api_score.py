"""vLLM's score and rerank APIs (server/scoring.py) against a real server: a score is the
cosine similarity of the two texts' embeddings as /v1/embeddings gives them, 1:N and N:N;
rerank orders documents by that score (top_n, documents returned or not) on every path
RAG front ends call; mismatched lists are a 400."""
from __future__ import annotations

import pytest

from tests.server_helpers import MODEL

pytestmark = pytest.mark.slow

QUERY = "Where do ships unload their cargo?"
DOCS = ["The harbour has cranes for unloading cargo ships.", "Bread rises in a warm oven.",
        "Trains leave the station every hour.", "Ships dock at the pier to unload."]


def vectors(client, texts):
    return [d.embedding for d in client.embeddings.create(model=MODEL, input=texts,
                                                          encoding_format="float").data]


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b))


def test_a_score_is_the_cosine_of_the_two_embeddings(client, http):
    q, *docs = vectors(client, [QUERY, *DOCS])
    r = http.post("/v1/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    for d, v in zip(body["data"], docs):
        assert d["object"] == "score" and d["score"] == pytest.approx(cosine(q, v), abs=1e-5)
    want_tokens = sum(len(http.post("/tokenize", json={"prompt": t}).json()["tokens"])
                      for t in [QUERY, *DOCS])
    assert body["usage"]["prompt_tokens"] == want_tokens      # the query embedded once
    pairwise = http.post("/score", json={"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    want = [cosine(docs[0], docs[2]), cosine(docs[1], docs[3])]
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_their_score(http, path):
    scores = [d["score"] for d in http.post("/v1/score", json={
        "text_1": QUERY, "text_2": DOCS}).json()["data"]]
    r = http.post(path, json={"model": MODEL, "query": QUERY, "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:3]
    assert [x["index"] for x in results] == order
    assert [x["relevance_score"] for x in results] == pytest.approx([scores[i] for i in order],
                                                                   abs=1e-5)
    assert [x["document"]["text"] for x in results] == [DOCS[i] for i in order]
    bare = http.post(path, json={"query": QUERY, "documents": DOCS,
                                 "return_documents": False}).json()["results"]
    assert len(bare) == len(DOCS) and all(x.get("document") is None for x in bare)


@pytest.mark.parametrize("body, param", [
    ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ({"text_1": "a", "text_2": []}, "text_2"),
    ({"text_1": "", "text_2": "b"}, "text_1"),
    ({"text_1": "a", "text_2": ["b", ""]}, "text_2"),
])
def test_bad_score_requests_are_400s_naming_the_field(http, body, param):
    r = http.post("/v1/score", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_empty_query_is_a_400_naming_it(http):
    r = http.post("/v1/rerank", json={"query": "", "documents": ["d"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "query", r.text


def test_an_unknown_model_is_a_404(http):
    r = http.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]})
    assert r.status_code == 404
