"""POST /v1/embeddings: the OpenAI embeddings API over the served model, as vLLM and
llama.cpp serve a decoder model's embeddings: each input's final normed hidden state, of its
last token (`--embedding-pooling last`, vLLM's default for decoder models) or the mean of all
its tokens (`mean`), L2-normalized (engine/pooling.py).

Each input is one engine request that prefills its prompt (its pages join the prefix cache
like any prompt's: a document embedded and then asked about is prefilled once) and ends
there. A request of more inputs than a client may have waiting (--max-waiting) runs them in
waves of that many, one after the other. `encoding_format` "base64" gives the
little-endian float32 bytes, base64-encoded (what the openai SDK asks for by default and
decodes); `dimensions` is refused (no Matryoshka training here).
"""
from __future__ import annotations

import base64
import struct
import uuid
from typing import Annotated, Literal

import anyio
from fastapi import Request
from pydantic import Field, StrictInt
from starlette.responses import Response

from scheduler.sampling_params import SamplingParams
from server.choice_stream import ChoiceSpec, ChoiceStream
from server.errors import context_length_exceeded, invalid_request
from server.generation import Generation
from server.protocol import Text, TokenId
from server.protocol_tools import Unsupported, _Request, _Wire
from server.sampling import MAX_CLIENT_CHARS
from server.serving import OpenAIServing, json_response
from server.serving_completion import prompt_token_ids

MAX_INPUTS = 2048               # OpenAI's limit on the inputs of one request


class EmbeddingRequest(_Request):
    model: Text | None = None
    input: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
            | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                        Field(min_length=1, max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] | None = None
    user: Text | None = None
    dimensions: Unsupported = None        # Matryoshka sizes: not what this model learned
    truncate_prompt_tokens: Annotated[StrictInt | None, Field(ge=1)] = None   # vLLM's


class Embedding(_Wire):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(_Wire):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Wire):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class EmbeddingServing(OpenAIServing):
    def __init__(self, ctx, pooling: str = "last"):
        super().__init__(ctx)
        self.pooling = pooling

    async def create(self, request: EmbeddingRequest, raw: Request) -> Response:
        self.ctx.check_model(request.model)

        async def answer() -> Response:
            vectors, tokens = await self.embed(raw, request.input, model=request.model,
                                               user=request.user,
                                               truncate=request.truncate_prompt_tokens)
            return json_response(self._response(request, vectors, tokens))
        return await self.answered(answer())

    async def embed(self, raw: Request, inputs, *, model: str | None, user: str | None,
                    truncate: int | None, param: str = "input"
                    ) -> tuple[list[tuple[float, ...]], int]:
        """The embeddings of `inputs` (a text, texts, token ids or lists of them) in order,
        and their tokens; 400s name `param`. Runs in waves of --max-waiting inputs."""
        ctx = self.ctx
        tokenizer = ctx.require_ready()
        texts = [inputs] if isinstance(inputs, str) else inputs
        if isinstance(texts[0], str):
            self.check_prompt_text(texts, param, truncate is not None)
        prompts = await anyio.to_thread.run_sync(prompt_token_ids, inputs, tokenizer, param)
        streams = self._streams(prompts, model, user, truncate, param)
        wave = max(1, ctx.max_waiting)
        for at in range(0, len(streams), wave):
            await self.collect(raw, Generation(streams[at:at + wave], ctx.metrics))
        vectors = []
        for stream in streams:
            if stream.embedding is None:
                raise RuntimeError(f"input {stream.spec.index} ended without an embedding")
            vectors.append(stream.embedding)
        return vectors, sum(len(s.spec.prompt_token_ids) for s in streams)

    def _streams(self, prompts: list[list[int]], model: str | None, user: str | None,
                 truncate: int | None, param: str) -> list:
        ctx, request_id = self.ctx, f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=self.pooling,
                                lora=ctx.lora_of(model),
                                client=(user or "")[:MAX_CLIENT_CHARS])
        streams = []
        for i, ids in enumerate(prompts):
            if truncate is not None:
                ids = ids[-truncate:]
            if not ids:
                raise invalid_request(f"Input {i} has no tokens.", param=param)
            if len(ids) > ctx.max_model_len:        # (no token follows: the whole context)
                raise context_length_exceeded(ctx.max_model_len, len(ids), None, param)
            spec = ChoiceSpec(index=i, prompt_index=i, request_id=f"{request_id}-{i}",
                              prompt_token_ids=ids, params=params)
            streams.append(ChoiceStream(ctx.engine, ctx.tokenizer, ctx.metrics, spec))
        return streams

    def _response(self, request: EmbeddingRequest, vectors: list, tokens: int
                  ) -> EmbeddingResponse:
        data = [Embedding(index=i, embedding=(
            _base64(v) if request.encoding_format == "base64" else list(v)))
            for i, v in enumerate(vectors)]
        return EmbeddingResponse(data=data, model=self.ctx.model_name(request.model),
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _base64(vector: tuple[float, ...]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
