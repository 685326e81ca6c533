"""Fetches ahead across layers (kvstore/pipeline.py): pages of a later layer fetched on the stage
threads while the engine thread computes the layers before it.

`ReuseAhead` (sfc): once a layer's fetches are under way, the pages the previous step selected
in a later layer are resolved on the resolve thread and fetched.

Adjacent decode steps select mostly the same pages (KVDrive's temporal locality of critical
entries; KVSwap measures 75-81% overlap between adjacent steps, 83% on SmolLM2 at 7K tokens).
The later layer still selects exactly and fetches what the reuse missed; its compute waits for
the pages fetched ahead. Those are pinned while their fill runs and protected from eviction
until their layer, and may hold at most half of the device tier, leaving room for twice a
layer's working set, so an exact fetch always finds room.

The same job evicts ahead of need (`Fetcher.reserve`, with the demotion copies), in one pass
with the room its own fetch needs: it leaves the next layer about 1.5 times its sparse exact
misses in the last step in free slots, so the resolves on the engine thread rarely evict
(choosing victims and admitting them to the host took ~1.7 ms a layer there in torch; ~0.2 ms
in C now, kvstore/native_evict.py).

A layer whose pages all stay on the device (its last fetch ahead found every page there, and it
missed none since) gets no job while the reserve is free: with the KV resident the jobs only
cost the decode their hand-offs. A miss in that layer turns its fetch ahead back on. The recall
(`observe_lookahead`) counts the layers fetched ahead: a layer that got no job adds nothing.

`prefetch_predicted` (layer-ahead): the pages selected with the model's prediction of the next
layer's queries.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from kvstore.fetcher import DeviceTierTooSmall
from kvstore.stages import LayerPart, LayerStages, filled


logger = logging.getLogger(__name__)


class ReuseAhead:
    """The fetches ahead of one Pipeline, `layers` layers ahead."""

    def __init__(self, pipeline, layers: int):
        """pipeline: the kvstore.pipeline.Pipeline that owns this (not imported: it imports
        this module)."""
        self.pipe, self.layers = pipeline, layers
        self.reused: dict[int, torch.Tensor] = {}       # layer -> keys the last step selected
        self.misses: dict[int, int] = {}                # layer -> its sparse misses last step
        # layer -> whether its last fetch ahead found every page on the device already
        self.idle: dict[int, bool] = {}
        # (layer, resolve job -> (keys, fill job) or None) until `collect` has waited for
        # the resolve, then layer -> (keys, fill job)
        self.job: tuple[int, Future] | None = None
        self.fetched: dict[int, tuple[torch.Tensor, Future]] = {}

    def collect(self) -> None:
        """Wait for the resolve job (it mutates the tiers: always before the engine thread
        does); its fill goes on."""
        if self.job is None:
            return
        layer, job = self.job
        self.job = None
        try:
            got = job.result()
        except Exception as exc:   # noqa: BLE001 - a reuse is only a hint
            logger.debug("fetch ahead failed (an exact fetch retries): %s", exc)
            got = None
        if got is not None:
            self.fetched[layer] = got

    def fills(self) -> list[Future]:
        """Every fill in flight (after `collect`), for a step that ended (or failed): the
        caller settles them."""
        out = [f for _, f in self.fetched.values()]
        self.fetched.clear()
        return out

    def take(self, layer: int) -> tuple[torch.Tensor | None, Future | None]:
        """The keys and fill of `layer`'s pages fetched ahead (None, None if none)."""
        return self.fetched.pop(layer, (None, None))

    def held(self) -> list[torch.Tensor]:
        """Keys fetched ahead for later layers (kept resident until their layer)."""
        return [k for k, _ in self.fetched.values()]

    def resolving(self) -> Future | None:
        return self.job[1] if self.job else None

    def issue(self, stages: LayerStages, parts: list[LayerPart], protect: torch.Tensor,
              ahead_keys: torch.Tensor | None) -> None:
        """Once layer `stages.layer`'s fetches are under way: remember the pages its sparse
        decodes selected, and fetch the pages the last step selected `layers` layers on (those
        of this step's sparse decodes). `ahead_keys`, this layer's pages fetched so, give the
        recall (exact-selected pages fetched ahead). The engine thread only hands the job
        over: choosing the pages, resolving and reading them run on the resolve thread."""
        pipe, tiers = self.pipe, self.pipe.tiers
        step, layer = stages.step, stages.layer
        sparse = [p for p in parts if p.sel is not None]     # none in the dense first layers
        exact = torch.cat([p.keys for p in sparse]) if sparse else None
        if exact is not None:
            self.reused[layer] = exact
        elif layer in step.cut:     # a layer whose window cuts attends no selection
            self.reused.pop(layer, None)
        target = layer + self.layers
        last = None if target in step.cut else self.reused.get(target)
        if last is None and exact is None:
            return
        # the next layer's resolves on the engine thread find this many slots free: 1.5x the
        # misses that layer's sparse decodes had in the last step (this layer's on the first
        # step), and its pages being written. Never sized by a dense layer (its whole working
        # set flows through the device) nor by the first sparse one (not fetched ahead, it
        # misses ~6x more than the next): the surplus came out of the dense layers' share
        expect = 0
        if sparse:
            self.misses[layer] = sum(p.misses for p in sparse)
            expect = self.misses.get(layer + 1, self.misses[layer])
        job = _FetchAhead(self, stages, target, last, exact, ahead_keys,
                          reserve=3 * expect // 2 + step.t_pid.numel())
        # nothing to fetch (no layer there, or every page of it stayed on the device: its last
        # fetch ahead found them all there, and it missed none since) and the reserve is
        # free: a job would only cost the decode its hand-offs (1 sequence, 4K tokens, all
        # resident: 110 against 94 ms a step). A miss in that layer turns it back on.
        # NOTE: with resolve_thread this layer's resolves may still be queued on the resolve
        # thread, so num_free is read only without it
        if (last is None or (self.idle.get(target) and self.misses.get(target) == 0)) and \
                not pipe.resolve_thread and tiers.device_free >= job.reserve:
            job.observe()
            return
        working = sum(p.keys.numel() for p in parts) + step.t_pid.numel()
        # NOTE: no resolve job is left here: `drain` collected it before this layer ran
        held = sum(k.numel() for k in self.held())
        cap = tiers.device_capacity
        job.room = min(cap // 2, cap - 2 * working) - held
        job.protect = torch.cat([p.keys for p in parts] + [protect])
        resolver, _ = pipe.threads()
        self.job = (target, resolver.submit(job.run))


class _FetchAhead:
    """One fetch ahead (`ReuseAhead.issue`), run on the resolve thread while a layer computes:
    the recall of the layer's own fetch ahead, then the fetch of layer `target`'s reused pages
    and room for the next layer."""

    def __init__(self, ahead: ReuseAhead, stages: LayerStages, target: int,
                 last: torch.Tensor | None, exact: torch.Tensor | None,
                 ahead_keys: torch.Tensor | None, reserve: int):
        self.ahead, self.pipe, self.tiers = ahead, ahead.pipe, ahead.pipe.tiers
        self.step, self.target, self.last = stages.step, target, last
        self.exact, self.ahead_keys, self.reserve = exact, ahead_keys, reserve
        self.nxt = LayerStages(stages.step, target, None)
        self.room = 0
        self.protect = torch.empty(0, dtype=torch.int64)

    def run(self) -> tuple[torch.Tensor, Future] | None:
        """The fetch ahead, then room for the next layer (evictions and their demotion
        copies, off the engine thread)."""
        self.observe()
        got = self.fetch()
        if got is None:         # else its eviction left the reserve free
            self.make_room(self.protect)
        return got

    def observe(self) -> None:
        """Recall: this layer's exact pages that were fetched ahead."""
        if self.exact is not None and self.ahead_keys is not None:
            self.pipe.stats.observe_lookahead(int(torch.isin(self.exact, self.ahead_keys).sum()),
                                              self.exact.numel())

    def fetch(self) -> tuple[torch.Tensor, Future] | None:
        """Pick the reused pages, resolve them, start their disk reads, and queue their fill
        behind this layer's: (keys, fill job), or None when nothing is fetched."""
        last, step, tiers, target = self.last, self.step, self.tiers, self.target
        if last is None:
            return None
        # NOTE: only pages safely in the backing store (clean), of this step's sparse
        # decodes, and none written this step: a page id freed and reused since the last
        # step may be a page its new owner is writing, in no tier yet
        keys = last[torch.isin(last, step.sparse_keys(target)) & tiers.is_clean(last)
                    & ~torch.isin(last, target * tiers.max_pages + step.t_pid)]
        if keys.numel() == 0 or keys.numel() > self.room:
            return None
        # one eviction for these pages' misses and the next layer's reserve together: a
        # pass over the tiers' slots (victims, host admission) costs the same whatever it
        # evicts (torch: ~1.4 ms; README: two passes a layer were 2-12% slower then)
        keep = torch.cat([self.protect, keys])
        self.make_room(keep, int((tiers.device_slots(keys) < 0).sum()))
        t0 = time.perf_counter()
        try:
            res = self.nxt.resolve(keys, keep, count=False)
        except DeviceTierTooSmall:
            return None
        self.ahead.idle[target] = res.misses == 0
        try:
            # their last use: the last step selected them (`protect` keeps them resident
            # until their layer; if it does not select them again, they go first)
            tiers.touch(res.slots, tiers.clock_of(keys, step.now - 1))
            self.nxt.start_reads(res)
            self.pipe.stats.observe_stage("resolve", time.perf_counter() - t0)
            if res.misses == 0:
                return keys, filled(res, None)
            _, fetcher = self.pipe.threads()
            return keys, fetcher.submit(self.pipe.fill_job, self.nxt, res)
        except BaseException:   # no fill will run: its pins and slots must not leak
            step.fetcher.abandon(res)
            raise

    def make_room(self, keep: torch.Tensor, incoming: int = 0) -> None:
        """Evict ahead of need: the reserve free once `incoming` misses are resolved (their
        demotion copies made); what is short, the resolves evict."""
        t0 = time.perf_counter()
        try:
            self.step.fetcher.reserve(self.reserve, keep, incoming)
        except Exception as exc:   # noqa: BLE001 - the engine thread evicts instead
            logger.warning("evicting ahead failed: %s", exc)
        self.pipe.stats.add_busy("resolve", time.perf_counter() - t0)


def prefetch_predicted(pipe, stages: LayerStages, q_pred: torch.Tensor,
                       sparse_idx: list[int], protect: torch.Tensor) -> Future:
    """Layer-ahead: select layer `stages.layer`'s pages with the predicted queries `q_pred`,
    resolve them on the resolve thread and fill them on the fetch thread (`protect`: the pages
    of the layer computing meanwhile). Returns the fill job (`Pipeline.fill_job`)."""
    resolver, fetcher = pipe.threads()

    def resolve_job():
        _, keys = stages.select_keys(sparse_idx, q_pred, observe=False)
        t1 = time.perf_counter()
        res = stages.resolve(keys, torch.cat([protect, keys]), count=False)
        stages.start_reads(res)
        pipe.stats.observe_stage("resolve", time.perf_counter() - t1)
        return res

    return fetcher.submit(pipe.fill_job, stages, resolver.submit(resolve_job))
