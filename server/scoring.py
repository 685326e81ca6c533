"""vLLM's score and rerank APIs over the served model's embeddings: `POST /v1/score` (also
`/score`) scores text pairs, `POST /v1/rerank` (also `/rerank`, `/v2/rerank`: the Jina and
Cohere shape that RAG front ends call) orders documents by their score against a query.

A score is the cosine similarity of the two texts' embeddings (server/embeddings.py: the
pooled final hidden states, L2-normalized), which is what vLLM's score API gives for an
embedding model. A text sent twice in one request is embedded once. The bundled SmolLM2 is
a chat model: serve an embedding checkpoint of a supported family (Qwen3-Embedding is a
Qwen3 with last-token pooling, `--embedding-pooling last`) for scores worth ranking by.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

import numpy as np

from fastapi import Request
from pydantic import Field, StrictBool, StrictInt
from starlette.responses import Response

from server.embeddings import MAX_INPUTS, EmbeddingServing
from server.embeddings import EmbeddingUsage as Usage
from server.errors import invalid_request
from server.protocol import Text
from server.protocol_tools import _Request, _Wire
from server.serving import json_response

NonEmpty = Annotated[Text, Field(min_length=1)]
Texts = Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_INPUTS)]


class ScoreRequest(_Request):
    model: Text | None = None
    text_1: NonEmpty | Texts
    text_2: NonEmpty | Texts
    truncate_prompt_tokens: Annotated[StrictInt | None, Field(ge=1)] = None
    user: Text | None = None

    def pairs(self) -> list[tuple[str, str]]:
        """1:1, 1:N (text_1 against each of text_2) or N:N (pairwise)."""
        one = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        two = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(one) == 1:
            return [(one[0], t) for t in two]
        if len(one) != len(two):
            raise invalid_request(f"text_1 has {len(one)} texts and text_2 {len(two)}: give "
                                  "one text_1, or as many as text_2.", param="text_1")
        return list(zip(one, two))


class RerankRequest(_Request):
    model: Text | None = None
    query: NonEmpty
    documents: Texts
    top_n: Annotated[StrictInt | None, Field(ge=0)] = None     # 0 or none: all of them
    return_documents: StrictBool = True
    truncate_prompt_tokens: Annotated[StrictInt | None, Field(ge=1)] = None
    user: Text | None = None


class ScoreData(_Wire):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Wire):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class RerankDocument(_Wire):
    text: str


class RerankResult(_Wire):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankResponse(_Wire):
    id: str
    model: str
    usage: Usage
    results: list[RerankResult]


class ScoreServing:
    def __init__(self, embeddings: EmbeddingServing):
        self.embeddings = embeddings
        self.ctx = embeddings.ctx

    async def score(self, request: ScoreRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        pairs = request.pairs()

        async def answer() -> Response:
            scores, tokens = await self._scores(raw, request, pairs, "text_1")
            return json_response(ScoreResponse(
                id=f"score-{uuid.uuid4().hex}", created=int(time.time()),
                model=self.ctx.model_name(request.model),
                data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                usage=Usage(prompt_tokens=tokens, total_tokens=tokens)))
        return await self.embeddings.answered(answer())

    async def rerank(self, request: RerankRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)
        pairs = [(request.query, d) for d in request.documents]

        async def answer() -> Response:
            scores, tokens = await self._scores(raw, request, pairs, "documents")
            order = sorted(range(len(scores)), key=lambda i: -scores[i])
            if request.top_n:
                order = order[:request.top_n]
            return json_response(RerankResponse(
                id=f"rerank-{uuid.uuid4().hex}", model=self.ctx.model_name(request.model),
                usage=Usage(prompt_tokens=tokens, total_tokens=tokens),
                results=[RerankResult(index=i, relevance_score=scores[i], document=(
                    RerankDocument(text=request.documents[i])
                    if request.return_documents else None)) for i in order]))
        return await self.embeddings.answered(answer())

    async def _scores(self, raw: Request, request, pairs: list[tuple[str, str]],
                      param: str) -> tuple[list[float], int]:
        """Each pair's cosine similarity, every distinct text embedded once; and the tokens
        embedded."""
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        vectors, tokens = await self.embeddings.embed(
            raw, texts, model=request.model, user=request.user,
            truncate=request.truncate_prompt_tokens, param=param)
        at = {t: i for i, t in enumerate(texts)}
        m = np.asarray(vectors, dtype=np.float32)                  # (unit vectors)
        a = m[[at[x] for x, _ in pairs]]
        b = m[[at[y] for _, y in pairs]]
        return np.einsum("ij,ij->i", a, b).astype(float).tolist(), tokens
