"""ModelRunner: turns a ScheduledBatch into tensors, runs the model forward, samples.

Owns the weights, the KV cache tensors, the attention backend and each step's sampling
(engine/request_sampling.py: each request's generator, grammar, Mirostat state). Knows
nothing of HTTP or of scheduling policy.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.lora import LoraAdapter, LoraBatch
from engine.model_config import ModelConfig
from engine.model_loader import load_model
from kvstore.lowrank import load_or_calibrate, projection_path
from engine.pooling import Pooler
from engine.request_sampling import RequestSampling, SampledToken
from engine.sampler import prompt_logprobs
from engine.weight_plan import WeightPlan
from kernels.packed_linear import DENSE
from kvstore.config import KVStoreConfig
from kvstore.step import SeqKV
from kvstore.store import TieredKVStore
from scheduler.batch import ScheduledBatch
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# a step of this many tokens (a prefill chunk) frees hundreds of MB of activations
_TRIM_AFTER_TOKENS = 1024
PROMPT_ROWS_AT_ONCE = 256   # prompt logprobs: LM head and log-softmax rows per block


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


class ModelRunner:
    def __init__(self, folder: Path, config: ModelConfig, plan: WeightPlan, kv: KVStoreConfig,
                 max_model_len: int, device: str = "cpu", gguf: Path | None = None,
                 model_id: str = "", lowrank_path: Path | None = None):
        """plan: the dtypes and weight formats (engine.weight_plan); gguf: load the weights
        from this GGUF file, quantized blocks as they are (else from the HF folder);
        model_id: names the weights in the prefix cache's namespace; lowrank_path: where the
        keys' low-rank projection is (--selector lowrank; calibrated there when absent)."""
        self.device = torch.device(device)
        self.dtype = plan.torch_dtype
        self.config = config
        self.model = load_model(folder, config, dtype=self.dtype, device=self.device,
                                max_model_len=max_model_len, gguf=gguf,
                                decode_format=plan.decode_format if plan.two_forms else None,
                                prefill_rows=plan.prefill_rows, keep_dense=plan.keep_dense)
        projection = None
        if kv.selector == "lowrank":
            projection = load_or_calibrate(self.model, folder / "tokenizer.json",
                                           lowrank_path or projection_path(folder, None,
                                                                           kv.lowrank_rank),
                                           kv.lowrank_rank)
            projection.check(config.num_hidden_layers, config.num_key_value_heads,
                             config.head_dim)
        self.store = TieredKVStore(kv, config.num_hidden_layers, config.num_key_value_heads,
                                   config.head_dim, DENSE[plan.kv_dtype], self.device,
                                   model_id=f"{model_id}|act={plan.dtype}"
                                   + ("|gemma-norm-f32" if config.gemma else ""),
                                   projection=projection, hidden_size=config.hidden_size,
                                   kv_from_inputs=self._recompute_fn(plan, kv),
                                   windows=config.layer_windows,
                                   softcap=config.attn_logit_softcapping)
        self.page_size = kv.page_size
        self.sampling = RequestSampling(folder / "tokenizer.json", config.vocab_size,
                                        tuple(config.eos_token_ids))
        self.grammars = self.sampling.grammars    # the constrained requests' matchers
        # prompt_logprobs requests' entries by prompt position, until their first output
        self._prompt_logprobs: dict[str, list] = {}
        self._prompt_logprobs_sent: set[str] = set()
        self.pooler = Pooler()             # embedding requests' pooled hidden states
        self.loras: dict[str, LoraAdapter] = {}     # LoRA adapters by name (--lora-modules)

    def _recompute_fn(self, plan: WeightPlan, kv: KVStoreConfig):
        """The model's K/V projection for KV recompute, or None where recomputing would not
        reproduce the K/V: decode steps that run other weights than the dense ones (a packed
        or lower-precision decode form) computed theirs with those. A fixed share (A/B runs)
        is given it anyway."""
        if plan.two_forms and kv.recompute == "auto":
            logger.info("KV recompute off: decode steps run %s weights, whose K/V a recompute "
                        "with the dense %s ones would not reproduce", plan.decode_format,
                        plan.dtype)
            return None
        return self.model.kv_from_inputs

    def release(self, request_id: str) -> None:
        """The request ended: its generator and its KV in every tier go."""
        self.sampling.release(request_id)
        self._prompt_logprobs.pop(request_id, None)
        self._prompt_logprobs_sent.discard(request_id)
        self.pooler.release(request_id)
        self.store.release(request_id)

    def read_lora(self, name: str, path) -> LoraAdapter:
        """The PEFT adapter at `path` for this model (engine/lora.py), not yet served."""
        return LoraAdapter.load(name, path, self.config, self.dtype, self.device,
                                self.model.qkv_rows())

    def prefix_salt(self, params: SamplingParams) -> str | None:
        """The salt a request's pages are cached under: its cache_salt and its adapter's
        digest, each tagged, so no cache_salt a client picks spells an adapter's salt
        (ValueError for an adapter this runner does not serve)."""
        user = None if params.cache_salt is None else f"user:{params.cache_salt}"
        if params.lora is None:
            return user
        adapter = self.loras.get(params.lora)
        if adapter is None:
            raise ValueError(f"no LoRA adapter named {params.lora!r} is served")
        return f"lora:{adapter.fingerprint}|{user or ''}"

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, requests: dict[str, Request]
                ) -> tuple[dict[str, list[SampledToken]], list[tuple[str, str]]]:
        """Run one step. Returns the tokens sampled for every request whose chunk ends its
        known tokens (one, or a decode's drafts kept and the token after them), and
        (request_id, error) for requests whose KV write to the backing store failed or whose
        sampling failed (those have no sampled token).
        Raises kvstore.store.RequestKVError when pages of some requests were lost."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        # rows whose next token is a prompt token, for prompt_logprobs: (request, its position)
        prompt_rows: list[int] = []
        prompt_at: list[tuple[str, int]] = []
        # embedding requests' rows to pool, and per request (id, rows, restart, final)
        pool_rows: list[int] = []
        pool_at: list[tuple[str, int, bool, bool]] = []
        seqs: list[SeqKV] = []
        prefilled: list[str] = []
        lora_spans: list = []          # (adapter or None, first row, rows) per request
        for r in batch.requests:
            n = len(r.token_ids)
            req = requests[r.request_id]
            lora_spans.append((self.loras[req.sampling_params.lora]
                               if req.sampling_params.lora else None, len(input_ids), n))
            if req.sampling_params.prompt_logprobs is not None \
                    and r.request_id not in self._prompt_logprobs_sent:   # (a preempted one)
                self._prompt_logprobs.setdefault(r.request_id, [None] * req.num_prompt_tokens)
                last = min(r.start_pos + n, req.num_prompt_tokens - 1)
                prompt_rows += range(len(input_ids), len(input_ids) + last - r.start_pos)
                prompt_at += ((r.request_id, p + 1) for p in range(r.start_pos, last))
            if req.sampling_params.pooling is not None and r.start_pos < req.num_prompt_tokens:
                rows = self.pooler.rows(req.sampling_params.pooling, len(input_ids), n, r.sample)
                pool_rows += rows
                pool_at.append((r.request_id, len(rows), r.start_pos == 0, r.sample))
            input_ids.extend(r.token_ids)
            positions.extend(range(r.start_pos, r.start_pos + n))
            seqs.append(SeqKV(r.request_id, r.page_ids, r.start_pos, n,
                              observe=r.sample and n > 1 and not r.drafts, drafts=r.drafts))
            if r.sample and req.sampling_params.samples:    # (a decode's drafts: every row)
                logits_rows.extend(range(len(input_ids) - 1 - r.drafts, len(input_ids)))
            prompt_len = requests[r.request_id].num_prompt_tokens
            if r.start_pos < prompt_len <= r.start_pos + n:
                prefilled.append(r.request_id)
        dev = self.device
        step = self.store.begin_step(seqs)
        hidden_rows = prompt_rows + pool_rows
        try:
            logits = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                                torch.tensor(positions, dtype=torch.int64, device=dev), step,
                                torch.tensor(logits_rows, dtype=torch.int64, device=dev),
                                torch.tensor(hidden_rows, dtype=torch.int64, device=dev)
                                if hidden_rows else None,
                                lora=LoraBatch.build(lora_spans, len(input_ids), dev))
        except BaseException:
            self.store.abort_step()     # no stage thread may outlive the failed step
            raise
        write_failures = self.store.end_step(step, prefilled)
        for rid in prefilled:        # their prompt's full pages join the prefix cache
            self.store.publish(rid, requests[rid].prompt_token_ids,
                               requests[rid].prefix_salt)
        if hidden_rows:
            logits, hidden = logits
            if prompt_rows:
                self._keep_prompt_logprobs(hidden[:len(prompt_rows)], prompt_at, requests)
            if pool_at:
                self._pool(hidden[len(prompt_rows):].cpu(), pool_at, requests)
        sampled, sample_failures = self.sampling.sample(batch, requests, logits)
        if len(input_ids) >= _TRIM_AFTER_TOKENS:
            release_free_heap()
        return sampled, write_failures + sample_failures

    def _keep_prompt_logprobs(self, hidden: torch.Tensor, at: list[tuple[str, int]],
                              requests: dict[str, Request]) -> None:
        """Record the prompt logprobs of the rows whose normed hidden states are `hidden`
        [P, hidden], row i predicting the prompt token at position at[i][1] of request
        at[i][0] (a recomputed prefill overwrites). The LM head runs PROMPT_ROWS_AT_ONCE rows
        at a time: a 2048-token chunk's logits at once would be [2048, vocab] float32."""
        targets = torch.tensor([requests[rid].prompt_token_ids[p] for rid, p in at])
        k = max(requests[rid].sampling_params.prompt_logprobs for rid, _ in at)
        for a in range(0, len(at), PROMPT_ROWS_AT_ONCE):
            logits = self.model.logits(hidden[a:a + PROMPT_ROWS_AT_ONCE])
            rows = prompt_logprobs(logits, targets[a:a + PROMPT_ROWS_AT_ONCE], k)
            for (rid, p), (tok, top) in zip(at[a:a + PROMPT_ROWS_AT_ONCE], rows):
                self._prompt_logprobs[rid][p] = (tok, top[:requests[rid].sampling_params
                                                      .prompt_logprobs])

    def _pool(self, hidden: torch.Tensor, at: list[tuple[str, int, bool, bool]],
              requests: dict[str, Request]) -> None:
        """Give each embedding request its rows' hidden states (in `at`'s order)."""
        row = 0
        for rid, count, restart, final in at:
            req = requests[rid]
            self.pooler.add(rid, hidden[row:row + count], req.sampling_params.pooling, restart,
                            final, req.num_prompt_tokens)
            row += count

    def take_prompt_logprobs(self, request_id: str) -> tuple | None:
        """A prompt_logprobs request's entries (None for the first token), once its prompt is
        computed; None otherwise, or once taken."""
        kept = self._prompt_logprobs.pop(request_id, None)
        if kept is None:
            return None
        self._prompt_logprobs_sent.add(request_id)
        return tuple(kept)
