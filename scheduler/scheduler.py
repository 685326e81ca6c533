"""Scheduler: continuous batching under a per-step token budget (vLLM v1 style).

There are no prefill or decode modes. Each request has num_tokens (prompt + outputs so far) and
num_computed_tokens (tokens whose K/V are in the KV store); every step each scheduled request
computes a chunk of the tokens it still lacks. A decode is a chunk of 1; a long prompt is computed
in chunks (chunked prefill). When the last known token is computed, the engine samples one token.

Policy:
- running requests first, in arrival order, then waiting requests;
- fair share between clients (`SamplingParams.client`, the OpenAI `user`): each client's
  requests wait FIFO, and the next one admitted is the oldest of the client with the fewest
  running requests (ties: the oldest); with one client this is plain FIFO. No head-of-line
  skipping: when that request does not fit, nothing else is admitted this step;
- each client may have `max_waiting` requests waiting, all clients together
  `max_waiting_total` (QueueFull beyond: one client's burst leaves room for the others);
- when pages run out for a running request, the NEWEST running request is preempted (pages freed,
  recomputed later from prompt + outputs so far) and goes to the front of the waiting queue;
- `policy` "priority" (vLLM's): the waiting requests of the lowest `SamplingParams.priority`
  come first (the rules above among them); the newest of the highest value is preempted, even
  if scheduled earlier in the step (its chunk is taken back); admission never preempts;
- no admission in a step that preempted, and a waiting request is admitted only if its first chunk
  fits in the free pages (admission never preempts);
- a request that ends (but for an error) offers the full pages of every token it computed,
  its answer's too, to the allocator's prefix cache (`publish`);
- a request being admitted starts with the KV of its longest cached prefix (the allocator's
  `reuse_prefix`: shared pages of the KV store's prefix cache), so it computes only the rest;
  while a running request is computing the pages that follow that prefix (one document sent by
  several clients at once), it waits for them rather than computing them a second time.
The oldest running request is never preempted while others run, so every request that fits alone
completes eventually (under "priority": while no request of a higher priority keeps arriving).

Not thread-safe: only the engine's step loop calls it.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

from kvstore.page_allocator import PageAllocator
from scheduler.batch import ScheduledBatch, ScheduledRequest
from scheduler.errors import PriorityNotEnabled, QueueFull, RequestTooLarge
from scheduler.request import Request, RequestStatus
from scheduler.speculative import NgramProposer, SpeculativeConfig

logger = logging.getLogger(__name__)

POLICIES = ("fcfs", "priority")
PRIORITY_NOT_ENABLED = ("priority scheduling is not enabled (--scheduling-policy priority); "
                        "send priority 0 or none")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16               # running requests at most
    max_num_batched_tokens: int = 2048   # tokens computed per step, over all requests
    max_waiting: int = 256               # waiting requests per client at most (QueueFull beyond)
    max_waiting_total: int = 0           # waiting requests of all clients at most;
                                         # 0: 4 x max_waiting
    max_model_len: int = 8192            # prompt + max_tokens at most
    long_prefill_chunk: int = 0          # tokens per request per step at most; 0: only the budget
                                         # caps
    page_size: int = 16                  # tokens per KV page (must match the allocator)
    speculative: SpeculativeConfig = SpeculativeConfig()    # n-gram drafts (off by default)
    policy: str = "fcfs"                 # admission, preemption: by arrival, or priority
    draft_context: int = 0               # drafts only while a request's tokens and drafts
                                         # stay within this many (decodes past it attend
                                         # sparsely, which a step of several tokens does not);
                                         # 0: any

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0 or self.long_prefill_chunk < 0 or self.max_waiting_total < 0:
            raise ValueError("SchedulerConfig.max_waiting, max_waiting_total and "
                             "long_prefill_chunk must be >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, "
                             f"got {self.policy!r}")

    @property
    def waiting_total(self) -> int:
        return self.max_waiting_total or 4 * self.max_waiting


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator):
        if allocator.page_size != config.page_size:
            raise ValueError(f"allocator page_size {allocator.page_size} != "
                             f"scheduler page_size {config.page_size}")
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self._waiting_of: Counter[str] = Counter()      # client -> its waiting requests
        self._running_of: Counter[str] = Counter()      # client -> its running requests
        self.running: list[Request] = []     # in arrival order: the last one is the newest
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.prefix_queried_tokens = 0     # prompt tokens of requests admitted (first time)
        self.prefix_hit_tokens = 0         # of which the prefix cache held the KV
        spec = config.speculative
        self.proposer = NgramProposer(spec) if spec.enabled else None
        # the chance of being kept a draft needs (the engine's DraftCost sets it each step)
        self.draft_min_p = 0.0

    # ---- queries ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_waiting_of(self, client: str) -> int:
        return self._waiting_of[client]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ---- admission --------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request. Raises RequestTooLarge (a ValueError) if it can never fit, QueueFull
        if max_waiting requests are already waiting, ValueError on a duplicate id."""
        p = req.sampling_params
        if req.num_prompt_tokens < 1:
            raise ValueError("the prompt must hold at least one token")
        if p.samples and p.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        total = req.num_prompt_tokens + p.max_new_tokens
        if total > self.config.max_model_len:
            raise RequestTooLarge(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({p.max_new_tokens}) = "
                f"{total} exceeds the maximum context length of {self.config.max_model_len} "
                "tokens")
        if total > self.allocator.capacity_tokens():
            raise RequestTooLarge(
                f"prompt + max_tokens = {total} tokens but the KV pool holds "
                f"{self.allocator.capacity_tokens()}; lower max_tokens or raise the KV memory "
                "budget")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already queued")
        if p.priority and self.config.policy != "priority":
            raise PriorityNotEnabled(PRIORITY_NOT_ENABLED)
        client = p.client
        if self._waiting_of[client] >= self.config.max_waiting:
            raise QueueFull(f"{self._waiting_of[client]} requests of this client are already "
                            "waiting; retry later")
        if len(self.waiting) >= self.config.waiting_total:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry later")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self._waiting_of[client] += 1
        self.requests[req.request_id] = req

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's chunks. Allocates the pages they need; may preempt."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk_len(req, budget)
            if n == 0:       # nothing to compute (update() not called yet): leave it be
                i += 1
                continue
            drafts = self._drafts(req, budget - n) if n == 1 else ()
            while not self.allocator.allocate(req.request_id,
                                              req.num_computed_tokens + n + len(drafts)):
                at = self._victim()
                victim = self.running.pop(at)
                if at < i:      # before this one in the step: its chunk (if any) goes too
                    i -= 1
                    undone = next((s for s in scheduled if s.request_id == victim.request_id),
                                  None)
                    if undone is not None:
                        scheduled.remove(undone)
                        budget += len(undone.token_ids)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._schedule_chunk(req, n, drafts))
                budget -= n + len(drafts)
                i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self._next_waiting()
            # NOTE: prompt logprobs (mean pooling) need every prompt position's logits (hidden
            # state): no cached prefix
            hit, reused = 0, (req.num_computed_tokens == 0
                              and not req.sampling_params.needs_whole_prompt)
            if reused:
                hit = self.allocator.reuse_prefix(req.request_id, req.all_token_ids,
                                                  req.prefix_salt)
                if hit is None:
                    break    # admitted once the running request has cached the pages it needs
                req.num_computed_tokens = hit
            n = self._chunk_len(req, budget)
            if n == 0 or not self.allocator.allocate(req.request_id, req.num_computed_tokens + n):
                if reused:   # waits without holding cached pages (they stay evictable)
                    self.allocator.free(req.request_id)
                    req.num_computed_tokens = 0
                break        # no skipping: a later request does not overtake the chosen one
            if req.num_cached_tokens is None:
                req.num_cached_tokens = hit
                self.prefix_queried_tokens += req.num_prompt_tokens
                self.prefix_hit_tokens += hit
            self._unwait(req)
            self._running_of[req.sampling_params.client] += 1
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled.append(self._schedule_chunk(req, n))
            budget -= n

        return ScheduledBatch(tuple(scheduled), tuple(preempted))

    def update(self, batch: ScheduledBatch, sampled: dict[str, int | tuple[int, ...]]
               ) -> list[Request]:
        """Record a step's results: advance progress, append sampled tokens (a decode with
        drafts: the drafts kept and the token sampled after them, in order), finish requests
        that stopped. Returns the requests that finished in this update (pages already freed).
        Requests aborted between schedule() and update() are skipped."""
        finished: list[Request] = []
        for sr in batch.requests:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            # (with drafts: only the pending token's K/V is sure; the kept ones add below)
            req.num_computed_tokens = sr.start_pos + (1 if sr.drafts else len(sr.token_ids))
            if not sr.sample:
                continue
            if not req.sampling_params.samples:     # an embedding request: its prompt is done
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                finished.append(req)
                continue
            tokens = sampled[sr.request_id]
            tokens = (tokens,) if isinstance(tokens, int) else tokens
            if self.proposer is not None:
                self.proposer.observe(sr.request_id, sr.token_ids[1:] if sr.drafts else (),
                                      tokens)
            for k, token in enumerate(tokens):
                if sr.drafts:   # the K/V of the pending token and the drafts kept so far
                    req.num_computed_tokens = sr.start_pos + k + 1
                req.output_token_ids.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    self._finish(req, status)
                    finished.append(req)
                    break
        return finished

    def abort(self, request_id: str,
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """Finish a waiting or running request with `status` and free its pages. Returns the
        request, or None when it is unknown or already finished (idempotent)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, status)
        return req

    def finish_with_error(self, request_id: str, message: str) -> Request | None:
        logger.warning("request %s failed: %s", request_id, message)
        return self.abort(request_id, RequestStatus.FINISHED_ERROR)

    # ---- internals --------------------------------------------------------------------------

    def _chunk_len(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.long_prefill_chunk:
            n = min(n, self.config.long_prefill_chunk)
        return max(n, 0)

    def _schedule_chunk(self, req: Request, n: int, drafts: tuple[int, ...] = ()
                        ) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + n
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_slice(start, end) + drafts,
            start_pos=start,
            page_ids=self.allocator.pages(req.request_id),
            sample=end == req.num_tokens,
            drafts=len(drafts),
        )

    def _drafts(self, req: Request, budget: int) -> tuple[int, ...]:
        """The n-gram drafts a decode of `req` verifies this step (scheduler/speculative.py):
        no more than could be kept, all in the pending token's page short of its last slot (a
        page fills, and is cached, only with kept tokens; rejected drafts' K/V is overwritten)."""
        p = req.sampling_params
        if self.proposer is None or not p.samples or req.num_computed_tokens + 1 != req.num_tokens:
            return ()
        ps, cfg = self.config.page_size, self.config
        limit = min(cfg.speculative.num_speculative_tokens, budget,
                    p.max_tokens - len(req.output_token_ids) - 1,
                    cfg.max_model_len - req.num_tokens - 1,
                    ps - 2 - req.num_computed_tokens % ps)
        if cfg.draft_context:
            limit = min(limit, cfg.draft_context - req.num_tokens)
        if limit <= 0:
            return ()
        stops = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else frozenset(req.eos_token_ids))
        drafts = self.proposer.propose(req.request_id, req.prompt_token_ids,
                                       req.output_token_ids, limit, stops)
        return self.proposer.worth(req.request_id, drafts, self.draft_min_p)

    def _victim(self) -> int:
        """Where in `running` the request to preempt is: the newest (fcfs), or the newest of
        the lowest priority (the largest value: vLLM's order)."""
        if self.config.policy == "fcfs":
            return len(self.running) - 1
        return max(range(len(self.running)), key=lambda k: (
            self.running[k].sampling_params.priority, self.running[k].arrival_time, k))

    def _next_waiting(self) -> Request:
        """The oldest waiting request of the client with the fewest running requests (under
        the priority policy, among those of the lowest priority value alone)."""
        waiting = self.waiting
        if self.config.policy == "priority":
            top = min(r.sampling_params.priority for r in waiting)
            waiting = [r for r in waiting if r.sampling_params.priority == top]
        head = waiting[0]
        if len(self._waiting_of) == 1:
            return head
        best = min(self._running_of[r.sampling_params.client] for r in waiting)
        if self._running_of[head.sampling_params.client] == best:
            return head
        return next(r for r in waiting
                    if self._running_of[r.sampling_params.client] == best)

    def _unwait(self, req: Request) -> None:
        if req is self.waiting[0]:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        client = req.sampling_params.client
        self._waiting_of[client] -= 1
        if not self._waiting_of[client]:
            del self._waiting_of[client]

    def _not_running(self, client: str) -> None:
        self._running_of[client] -= 1
        if not self._running_of[client]:        # one entry per client in flight, no more
            del self._running_of[client]

    def _preempt(self, req: Request) -> None:
        self._not_running(req.sampling_params.client)
        self._waiting_of[req.sampling_params.client] += 1
        self.allocator.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (%d tokens to recompute)", req.request_id, req.num_tokens)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids)):
            return RequestStatus.FINISHED_STOPPED
        if n_out >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._not_running(req.sampling_params.client)
            if status is not RequestStatus.FINISHED_ERROR:
                # the next turn of a conversation resends this answer: its full pages too
                self.allocator.publish(req.request_id,
                                       req.token_slice(0, req.num_computed_tokens),
                                       req.prefix_salt)
        else:
            self._unwait(req)
        self.allocator.free(req.request_id)
        if self.proposer is not None:
            self.proposer.release(req.request_id)
        req.status = status
        del self.requests[req.request_id]

