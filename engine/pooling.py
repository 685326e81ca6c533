"""Pooler: the embeddings of embedding requests (`SamplingParams.pooling`, /v1/embeddings), as
vLLM pools a decoder model: the final normed hidden state of the prompt's last token ("last")
or the mean over all its tokens ("mean"), L2-normalized.

A prompt is prefilled in chunks, so the mean is summed chunk by chunk (a request preempted and
recomputed starts its sum again); the embedding is made on the chunk that ends the prompt and
handed out once (`take`). Owned by the ModelRunner, which asks `rows` which of a step's rows
to keep and gives their hidden states to `add`.
"""
from __future__ import annotations

import torch


class Pooler:
    def __init__(self):
        self._sums: dict[str, torch.Tensor] = {}
        self._done: dict[str, tuple[float, ...]] = {}

    @staticmethod
    def rows(pooling: str, first: int, n: int, final: bool) -> list[int]:
        """The step's rows a chunk of `n` prompt tokens (rows first .. first + n - 1) gives to
        the pooling; `final`: the chunk ends the prompt."""
        if pooling == "mean":
            return list(range(first, first + n))
        return [first + n - 1] if final else []

    def add(self, request_id: str, hidden: torch.Tensor, pooling: str, restart: bool,
            final: bool, num_prompt_tokens: int) -> None:
        """hidden [k, hidden_size]: this chunk's rows (`rows`); `restart`: the chunk starts the
        prompt; `final`: it ends it, and the embedding is made."""
        h = hidden.float()
        if restart or request_id not in self._sums:
            self._sums[request_id] = torch.zeros(h.shape[-1])
        if h.shape[0]:
            if pooling == "mean":
                self._sums[request_id] += h.sum(0)
            else:
                self._sums[request_id] = h[-1].clone()
        if final:
            v = self._sums.pop(request_id)
            if pooling == "mean":
                v = v / num_prompt_tokens
            self._done[request_id] = tuple((v / v.norm().clamp_min(1e-12)).tolist())

    def take(self, request_id: str) -> tuple[float, ...] | None:
        return self._done.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self._sums.pop(request_id, None)
        self._done.pop(request_id, None)
