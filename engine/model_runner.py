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
from engine.weight_plan import WeightPlan
from kernels.packed_linear import DENSE
from kvstore.config import KVStoreConfig
from kvstore.step import SeqKV
from kvstore.store import TieredKVStore
from scheduler.batch import ScheduledBatch
from scheduler.request import Request

logger = logging.getLogger(__name__)

# a step of this many tokens (a prefill chunk) frees hundreds of MB of activations
_TRIM_AFTER_TOKENS = 1024


def _libc_malloc_trim():
    try:
        import ctypes
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):      # not glibc
        return None


_MALLOC_TRIM = _libc_malloc_trim()


def release_free_heap() -> None:
    """Give the heap glibc keeps after a large step back to the OS (malloc_trim): prefill
    activations are freed but otherwise stay in the process's RSS (measured: ~0.8 GB after
    8 prefills of 7K tokens), which a memory budget cannot afford. Costs ~1-10 ms, once per
    prefill chunk."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprobs: tuple[TokenLogprob, tuple[TokenLogprob, ...]] | None = None


class ModelRunner:
    def __init__(self, folder: Path, config: ModelConfig, plan: WeightPlan, kv: KVStoreConfig,
                 max_model_len: int, device: str = "cpu", gguf: Path | None = None):
        """plan: the dtypes and weight formats (engine.weight_plan); gguf: load the weights
        from this GGUF file, quantized blocks as they are (else from the HF folder)."""
        self.device = torch.device(device)
        self.dtype = plan.torch_dtype
        self.config = config
        self.model = load_model(folder, config, dtype=self.dtype, device=self.device,
                                max_model_len=max_model_len, gguf=gguf,
                                decode_format=plan.decode_format if plan.two_forms else None,
                                prefill_rows=plan.prefill_rows)
        self.store = TieredKVStore(kv, config.num_hidden_layers, config.num_key_value_heads,
                                   config.head_dim, DENSE[plan.kv_dtype], self.device)
        self.page_size = kv.page_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator | None] = {}

    def release(self, request_id: str) -> None:
        """The request ended: its generator and its KV in every tier go."""
        self._generators.pop(request_id, None)
        self.store.release(request_id)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, requests: dict[str, Request]
                ) -> tuple[dict[str, SampledToken], list[tuple[str, str]]]:
        """Run one step. Returns the sampled token of every request whose chunk ends its known
        tokens, and (request_id, error) for requests whose KV write to the backing store failed.
        Raises kvstore.store.RequestKVError when pages of some requests were lost."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        seqs: list[SeqKV] = []
        prefilled: list[str] = []
        for r in batch.requests:
            n = len(r.token_ids)
            input_ids.extend(r.token_ids)
            positions.extend(range(r.start_pos, r.start_pos + n))
            seqs.append(SeqKV(r.request_id, r.page_ids, r.start_pos, n, observe=r.sample and n > 1))
            if r.sample:
                logits_rows.append(len(input_ids) - 1)
            prompt_len = requests[r.request_id].num_prompt_tokens
            if r.start_pos < prompt_len <= r.start_pos + n:
                prefilled.append(r.request_id)
        dev = self.device
        step = self.store.begin_step(seqs)
        logits = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                            torch.tensor(positions, dtype=torch.int64, device=dev), step,
                            torch.tensor(logits_rows, dtype=torch.int64, device=dev))
        write_failures = self.store.end_step(step, prefilled)
        sampled = self._sample(batch, requests, logits)
        if len(input_ids) >= _TRIM_AFTER_TOKENS:
            release_free_heap()
        return sampled, write_failures

    def _sample(self, batch: ScheduledBatch, requests: dict[str, Request],
                logits: torch.Tensor) -> dict[str, SampledToken]:
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
