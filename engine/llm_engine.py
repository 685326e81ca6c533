"""LLMEngine: the synchronous step loop. schedule -> execute -> update -> outputs."""
from __future__ import annotations

import logging
import time

import torch

from engine.args import EngineArgs
from engine.core_split import CoreSplit
from engine.devices import describe, resolve_device
from engine.gguf_convert import ensure_hf_folder, gguf_source, model_fingerprint
from engine.generation_defaults import sampling_defaults
from engine.gguf_weights import native_format
from engine.model_config import ModelConfig, rope_identity
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.weight_plan import plan_weights
from kernels.threads import share_torch_openmp
from kvstore.errors import RequestKVError
from kvstore.lowrank import projection_path
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.speculative import DraftCost, SpecStats, SpeculativeConfig

logger = logging.getLogger(__name__)


class DuplicateRequestId(KeyError):
    """An id that a running or waiting request already has."""

    def __str__(self) -> str:
        return str(self.args[0])


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_folder = ensure_hf_folder(args.model, args.resolved_cache_dir)
        cfg = ModelConfig.from_hf(self.model_folder, args.config_overrides())
        self.max_model_len = args.max_model_len or cfg.served_positions
        if self.max_model_len > cfg.positions:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's "
                             f"{cfg.positions} positions (a rope_scaling in --hf-overrides "
                             "serves more)")
        self.device = resolve_device(args.device)
        logger.info("device: %s", describe(self.device))
        if self.device.type == "cuda":      # code that takes "the current device" takes it
            torch.cuda.set_device(self.device)
        gguf = gguf_source(args.model)
        # a request's unset sampling fields take these (engine/generation_defaults.py)
        self.sampling_defaults = sampling_defaults(args.generation_config, self.model_folder,
                                                   gguf, args.override_generation_config)
        if self.sampling_defaults:
            logger.info("sampling defaults of requests that leave them unset: %s",
                        self.sampling_defaults)
        native = native_format(gguf) if gguf is not None else None
        self.weight_plan = plan_weights(cfg, args.dtype, args.weights, native,
                                        args.torch_threads(), self.device,
                                        prefill=args.prefill_weights)
        # NOTE: a GGUF model's weights come from the file itself (quantized blocks as they
        # are, dequantized exactly in float32); the converted folder gives config and tokenizer
        kv = args.kv_store_config()
        rope = rope_identity(cfg, args.config_overrides(), self.max_model_len)
        self.runner = ModelRunner(self.model_folder, cfg, self.weight_plan,
                                  kv, self.max_model_len,
                                  device=self.device, gguf=gguf,
                                  model_id=model_fingerprint(self.model_folder, gguf, rope),
                                  lowrank_path=projection_path(self.model_folder,
                                                               args.resolved_cache_dir,
                                                               args.lowrank_rank, rope))
        for name, path in args.lora_adapters().items():
            self.load_lora(name, path)
        self.eos_token_ids = tuple(cfg.eos_token_ids)
        self.store = self.runner.store
        # NOTE: the scheduler allocates through the store, so freed pages leave every tier
        self.allocator = self.store
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            max_waiting_total=args.max_waiting_total,
            policy=args.scheduling_policy,
            max_model_len=self.max_model_len,
            page_size=args.page_size,
            speculative=SpeculativeConfig.from_json(args.speculative_config),
            draft_context=kv.sparse_from_pages * kv.page_size,     # (0: decode is dense)
        ), self.allocator)
        # how many tokens/logprobs each request has already been told about
        self._emitted: dict[str, int] = {}
        self._pending_logprobs: dict[str, list] = {}
        self.num_preemptions = 0
        self.spec = SpecStats()             # drafts verified and kept (--speculative-config)
        self.draft_cost = DraftCost()       # what a draft row costs, from the decode steps
        # (prefill, decode-only) torch threads of each step (`use_threads`); None: the caller's
        self.threads: tuple[int, int] | None = None
        self.core_split: CoreSplit | None = None     # sequential decode: who gets the cores

    def use_threads(self, prefill: int, decode: int) -> None:
        """Run each step on `decode` torch threads when it only decodes, else on `prefill`
        (EngineArgs.torch_threads). Off unless called: callers that fork or manage torch's
        threads themselves (benches) keep them."""
        if prefill < 1 or decode < 1:
            raise ValueError(f"torch threads must be >= 1, got {prefill} and {decode}")
        self.threads = (prefill, decode)
        # the C kernels' threaded calls on torch's own OpenMP team where they can be
        # (kernels/threads.py), so the two do not spin beside each other
        shared = share_torch_openmp()
        # the C decode attention splits its rows over threads while torch's ops wait: in
        # sequential mode nothing else computes then, so it may take every core (pipelined
        # modes' stage threads run beside it: the decode count); how many cores torch's
        # matmuls and the attention get in a decode step is timed per step shape
        # (engine/core_split.py) unless --decode-threads fixes torch's
        sequential = self.store.pipeline.mode == "sequential"
        self.core_split = None
        self.store.attention_threads = prefill if sequential else decode
        if hasattr(self.store.sparse_attention, "threads") and sequential \
                and decode < prefill and not self.args.decode_threads:
            self.core_split = CoreSplit(prefill, decode, shared=shared)

    def read_lora(self, name: str, path):
        """The PEFT adapter at `path`, read for this model (any thread: it reads files and
        the model's shapes only); ValueError: the folder is no adapter of this model, or
        --kv-recompute is on (it rebuilds K/V from the base weights)."""
        if self.args.kv_recompute != "off":
            raise ValueError("--kv-recompute rebuilds K/V from the base model's weights: it "
                             "cannot serve LoRA adapters")
        return self.runner.read_lora(name, path)

    def add_lora(self, adapter) -> None:
        """Serve a read adapter from the next step on (the engine's thread; ValueError: its
        name is taken)."""
        if adapter.name in self.runner.loras:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        self.runner.loras[adapter.name] = adapter
        logger.info("LoRA adapter %s loaded: %s, rank %d", adapter.name, adapter.path,
                    adapter.rank)

    def load_lora(self, name: str, path) -> None:
        """read_lora then add_lora, on the engine's thread."""
        self.add_lora(self.read_lora(name, path))

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (KeyError: none is loaded; ValueError: a waiting or
        running request uses it)."""
        if name not in self.runner.loras:
            raise KeyError(name)
        if any(r.sampling_params.lora == name for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter {name!r} has requests in flight")
        del self.runner.loras[name]
        logger.info("LoRA adapter %s unloaded", name)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request. Raises scheduler QueueFull, KVFull, a ValueError when it can never
        fit (RequestTooLarge, KVNeverFits), DuplicateRequestId when the id is in use (before
        anything is touched: the request that has the id goes on unharmed)."""
        if request_id in self._emitted:
            raise DuplicateRequestId(f"request id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                      prefix_salt=self.runner.prefix_salt(params))
        total = min(len(prompt_token_ids) + params.max_new_tokens, self.max_model_len)
        self.store.add_request(request_id, total)       # KVFull / KVNeverFits
        try:
            self.scheduler.add_request(req)
        except Exception:
            self.store.release(request_id)
            raise
        self._emitted[request_id] = 0
        self._pending_logprobs[request_id] = []

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return self._finish(req)

    def _use_threads(self, batch) -> CoreSplit | None:
        """Set the step's torch (and C attention) threads; returns the CoreSplit timing this
        step, if any."""
        if self.threads is None:
            return None
        split = self.core_split if batch.decode_only else None
        store = self.store
        if split is not None:
            n, store.attention_threads = split.choose(
                len(batch.requests), sum(r.start_pos + 1 for r in batch.requests))
        else:
            n = self.threads[1 if batch.decode_only else 0]
            if self.core_split is not None:     # sequential mode: the attention's default
                store.attention_threads = self.threads[0]
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return split

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        fixed = self.scheduler.config.speculative.draft_p_min
        self.scheduler.draft_min_p = fixed if fixed is not None else \
            self.draft_cost.min_p(self.scheduler.num_running)
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted_ids)
        if batch.is_empty:
            return []
        if self.device.type == "cuda":      # the current device is per thread
            torch.cuda.set_device(self.device)
        split = self._use_threads(batch)
        requests = {r.request_id: self.scheduler.get_request(r.request_id) for r in batch.requests}
        try:
            t0 = time.perf_counter()
            sampled, write_failures = self.runner.execute(batch, requests)
            drafts = batch.num_tokens - len(batch.requests)     # (of a decode-only step)
            if split is not None and not drafts:    # (drafts' rows: not the shape it times)
                split.observe(time.perf_counter() - t0)
            if batch.decode_only:
                self.draft_cost.observe(len(batch.requests), drafts, time.perf_counter() - t0)
        except RequestKVError as exc:
            # pages of these requests were lost: they end with an error; the others were not
            # advanced and simply run this step again
            logger.error("KV lost for %s: %s", exc.request_ids, exc)
            return [o for rid in exc.request_ids if (o := self._fail(rid, str(exc))) is not None]
        except Exception as exc:  # noqa: BLE001 - one bad step fails its requests, not the server
            logger.exception("step failed; failing its %d requests", len(batch.requests))
            return [o for r in batch.requests
                    if (o := self._fail(r.request_id, f"internal error: {exc}")) is not None]
        failed = dict(write_failures)
        # requests that should have sampled and did not (their sampling failed) end first:
        # the scheduler's update then skips them
        unsampled = {r.request_id for r in batch.requests
                     if r.sample and requests[r.request_id].sampling_params.samples
                     } - sampled.keys()
        outputs = [o for rid in unsampled if rid in failed
                   and (o := self._fail(rid, failed.pop(rid))) is not None]
        for rid, toks in sampled.items():
            self._pending_logprobs[rid] += [t.logprobs for t in toks if t.logprobs is not None]
        self.spec.observe(batch, {rid: t for rid, t in sampled.items() if rid not in failed})
        finished = {r.request_id for r in self.scheduler.update(
            batch, {rid: tuple(t.token_id for t in toks) for rid, toks in sampled.items()})}
        for rid in (r.request_id for r in batch.requests):  # (embedding requests end unsampled)
            if rid in finished:
                outputs.append(self._finish(requests[rid]))
            elif rid in sampled and rid not in failed:
                outputs.append(self._output(requests[rid], finished=False))
        outputs += [o for rid, msg in failed.items() if (o := self._fail(rid, msg)) is not None]
        return outputs

    def _fail(self, request_id: str, message: str) -> RequestOutput | None:
        req = self.scheduler.finish_with_error(request_id, message)
        return None if req is None else self._finish(req, error=message)

    def _output(self, req: Request, finished: bool, error: str | None = None) -> RequestOutput:
        rid = req.request_id
        start = self._emitted.get(rid, 0)
        new = tuple(req.output_token_ids[start:])
        self._emitted[rid] = len(req.output_token_ids)
        # (one entry a token; defensive: a step's tokens after a stop would have none)
        lps = self._pending_logprobs.get(rid, [])[:len(new)]
        self._pending_logprobs[rid] = []
        reason = req.status.value if finished else None
        # NOTE: the prompt is computed once the first token is sampled
        prompt_lps = self.runner.take_prompt_logprobs(rid) if start == 0 and new else None
        return RequestOutput(
            request_id=rid, new_token_ids=new, new_logprobs=tuple(lps), finished=finished,
            prompt_logprobs=prompt_lps,
            embedding=self.runner.pooler.take(rid) if finished else None,
            finish_reason=reason, error=error, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            num_output_tokens=len(req.output_token_ids), arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time)

    def _finish(self, req: Request, error: str | None = None) -> RequestOutput:
        out = self._output(req, finished=True, error=error)
        self._emitted.pop(req.request_id, None)
        self._pending_logprobs.pop(req.request_id, None)
        self.runner.release(req.request_id)
        return out
