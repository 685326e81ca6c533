"""One layer's stages one after the other on the engine thread: select, resolve, fetch, the
batch as one unit (`--pipeline sequential`, and any layer sfc does not split into several
micro-batches). Modes and their scheduling: kvstore/pipeline.py."""
from __future__ import annotations

import time

import torch

from kvstore.stages import LayerPart, LayerStages


def run_sequential(pipe, stages: LayerStages, dense_idx: list[int], sparse_idx: list[int],
                   protect: torch.Tensor) -> list[LayerPart]:
    """Select, resolve and fill one layer's pages for `Pipeline.run` (its parts, filled: the
    dense sequences' and the sparse decodes'). pipe: the kvstore.pipeline.Pipeline (not
    imported: it imports this module)."""
    st = pipe.stats
    sel = None
    keys = dense_keys = stages.dense_keys(dense_idx)
    if sparse_idx:
        sel, sparse_keys = stages.select_keys(sparse_idx)
        reused = stages.reused(sparse_keys)
        keys = torch.cat([dense_keys, sparse_keys])
    t0 = time.perf_counter()
    res = stages.resolve(keys, torch.cat([keys, protect]))
    t1 = time.perf_counter()
    st.observe_stage("resolve", t1 - t0)
    try:
        stages.fill(res)
    except Exception:
        stages.step.fetcher.forget(res)
        raise
    pipe.fetcher.arrived(res)
    st.observe_stage("fetch", time.perf_counter() - t1)
    n = dense_keys.numel()
    parts = []
    if dense_idx:
        parts.append(LayerPart(dense_idx, None, dense_keys, res.slots[:n]))
    if sparse_idx:       # sfc's fetch ahead turns on by its misses (sequential: unread)
        misses = int(res.fills(res.slots[n:]).sum()) \
            if res.misses and pipe.ahead is not None else 0
        parts.append(LayerPart(sparse_idx, sel, keys[n:], res.slots[n:], misses,
                               reused=reused))
    return parts
