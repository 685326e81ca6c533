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
        ctx = self.ctx
        ctx.check_model(request.model)
        tokenizer = ctx.require_ready()
        texts = [request.input] if isinstance(request.input, str) else request.input
        if isinstance(texts[0], str):
            self.check_prompt_text(texts, "input", request.truncate_prompt_tokens is not None)
        prompts = await anyio.to_thread.run_sync(prompt_token_ids, request.input, tokenizer,
                                                 "input")
        streams = self._streams(request, prompts)
        wave = max(1, ctx.max_waiting)

        async def answer() -> Response:
            for at in range(0, len(streams), wave):
                await self.collect(raw, Generation(streams[at:at + wave], ctx.metrics))
            return json_response(self._response(request, streams))
        return await self.answered(answer())

    def _streams(self, request: EmbeddingRequest, prompts: list[list[int]]) -> list:
        ctx, request_id = self.ctx, f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=self.pooling,
                                lora=ctx.lora_of(request.model),
                                client=(request.user or "")[:MAX_CLIENT_CHARS])
        streams = []
        for i, ids in enumerate(prompts):
            if request.truncate_prompt_tokens is not None:
                ids = ids[-request.truncate_prompt_tokens:]
            if not ids:
                raise invalid_request(f"Input {i} has no tokens.", param="input")
            if len(ids) > ctx.max_model_len:        # (no token follows: the whole context)
                raise context_length_exceeded(ctx.max_model_len, len(ids), None, "input")
            spec = ChoiceSpec(index=i, prompt_index=i, request_id=f"{request_id}-{i}",
                              prompt_token_ids=ids, params=params)
            streams.append(ChoiceStream(ctx.engine, ctx.tokenizer, ctx.metrics, spec))
        return streams

    def _response(self, request: EmbeddingRequest, streams: list) -> EmbeddingResponse:
        data = []
        for stream in streams:
            vector = stream.embedding
            if vector is None:
                raise RuntimeError(f"input {stream.spec.index} ended without an embedding")
            data.append(Embedding(index=stream.spec.index, embedding=(
                _base64(vector) if request.encoding_format == "base64" else list(vector))))
        tokens = sum(len(s.spec.prompt_token_ids) for s in streams)
        return EmbeddingResponse(data=data, model=self.ctx.model_name(request.model),
                                 usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _base64(vector: tuple[float, ...]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
