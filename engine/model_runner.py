"""ModelRunner: turns a ScheduledBatch into tensors, runs the model forward, samples.

Owns the weights, the KV cache tensors, the attention backend, the sampler and each request's
random generator. Knows nothing of HTTP or of scheduling policy.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model_config import ModelConfig
from engine.model_loader import load_model
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, make_generator
from kernels.attention import AttentionBatch, make_attention_backend
from kernels.page_table import build_page_table
from kvstore.kv_cache import KVCache
from scheduler.batch import ScheduledBatch
from scheduler.request import Request

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: tuple[TokenLogprob, tuple[TokenLogprob, ...]] | None = None


class ModelRunner:
    def __init__(self, folder: Path, config: ModelConfig, dtype: str, page_size: int,
                 kv_budget_bytes: int, max_model_len: int, device: str = "cpu"):
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.config = config
        self.attention = make_attention_backend(self.device)
        self.model = load_model(folder, config, dtype=self.dtype, device=self.device,
                                max_model_len=max_model_len, attn_backend=self.attention)
        c = self.config
        num_pages = KVCache.num_pages_for_budget(kv_budget_bytes, c.num_hidden_layers, page_size,
                                                 c.num_key_value_heads, c.head_dim, self.dtype)
        if num_pages < 1:
            raise ValueError(f"--kv-device-gb {kv_budget_bytes / 2**30:.3f} holds no KV page "
                             f"of {page_size} tokens for this model; raise it")
        self.kv_cache = KVCache(c.num_hidden_layers, num_pages, page_size, c.num_key_value_heads,
                                c.head_dim, self.dtype, device=self.device)
        self.page_size = page_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator | None] = {}
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, page_size,
                    num_pages * self.kv_cache.page_bytes / 2**20)

    @property
    def num_pages(self) -> int:
        return self.kv_cache.num_pages

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, requests: dict[str, Request]) -> dict[str, SampledToken]:
        """Run one step. Returns the sampled token of every request whose chunk ends its known tokens."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qo_indptr = [0]
        kv_lens: list[int] = []
        logits_rows: list[int] = []
        ps = self.page_size
        for r in batch.requests:
            n = len(r.token_ids)
            input_ids.extend(r.token_ids)
            pos = range(r.start_pos, r.start_pos + n)
            positions.extend(pos)
            slots.extend(r.page_ids[p // ps] * ps + p % ps for p in pos)
            qo_indptr.append(qo_indptr[-1] + n)
            kv_lens.append(r.start_pos + n)
            if r.sample:
                logits_rows.append(qo_indptr[-1] - 1)
        dev = self.device
        attn = AttentionBatch(
            qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32, device=dev),
            page_table=build_page_table([r.page_ids for r in batch.requests], kv_lens, ps, dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )
        logits = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev),
                            attn, self.kv_cache,
                            torch.tensor(logits_rows, dtype=torch.int64, device=dev))
        sampled_reqs = [requests[r.request_id] for r in batch.requests if r.sample]
        if not sampled_reqs:
            return {}
        params = [q.sampling_params for q in sampled_reqs]
        banned = [self._banned(q) for q in sampled_reqs]
        gens = [self._generator(q) for q in sampled_reqs]
        out = self.sampler.sample(logits, params, [q.output_token_ids for q in sampled_reqs], gens,
                                  banned_token_ids=banned)
        result = {}
        for i, q in enumerate(sampled_reqs):
            lp = out.logprobs[i] if out.logprobs is not None else None
            result[q.request_id] = SampledToken(out.token_ids[i], lp)
        return result

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.request_id not in self._generators:
            seed = req.sampling_params.seed
            self._generators[req.request_id] = None if seed is None else make_generator(seed)
        return self._generators[req.request_id]

    @staticmethod
    def _banned(req: Request) -> tuple[int, ...]:
        p = req.sampling_params
        if len(req.output_token_ids) >= p.min_tokens:
            return ()
        return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(req.eos_token_ids))
