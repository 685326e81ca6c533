"""Test-only drivers for our model: run token chunks of several sequences through paged KV."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kernels.attention import AttentionBatch, TorchPagedAttention
from tests.kv_cache import DenseStep


@dataclass
class PagedSequence:
    """One sequence's tokens so far and the (shuffled) pages holding its KV."""
    tokens: list[int]
    pages: list[int]
    computed: int = 0                       # tokens whose K/V are in the cache
    logits: list[torch.Tensor] = field(default_factory=list)   # [n, vocab] per step


def page_pool(num_pages: int, seed: int = 0) -> list[int]:
    """Page ids in a shuffled order, so sequences get non-contiguous pages."""
    ids = list(range(num_pages))
    random.Random(seed).shuffle(ids)
    return ids


def step(model, cache, work: list[tuple[PagedSequence, int]], all_logits: bool = True):
    """Run `n` more tokens of each (sequence, n) in ONE batch; return [rows, vocab] per sequence
    (every new row when all_logits, else the last one)."""
    ids, pos, q_lens, kv_lens, pages, rows = [], [], [], [], [], []
    for seq, n in work:
        start = seq.computed
        ids += seq.tokens[start:start + n]
        pos += range(start, start + n)
        q_lens.append(n)
        kv_lens.append(start + n)
        pages.append(seq.pages)
        first = len(ids) - n
        rows += range(first, first + n) if all_logits else [first + n - 1]
    batch = AttentionBatch.build(pages, kv_lens, q_lens, cache.page_size)
    kv = DenseStep(cache, batch, TorchPagedAttention(), model.config.num_attention_heads,
                   model.dtype)
    logits = model(torch.tensor(ids), torch.tensor(pos), kv, torch.tensor(rows))
    out, at = [], 0
    for seq, n in work:
        k = n if all_logits else 1
        out.append(logits[at:at + k])
        seq.logits.append(logits[at:at + k])
        seq.computed += n
        at += k
    return out


def greedy(model, cache, prompt: list[int], max_new_tokens: int, pages: list[int],
           eos_ids: tuple[int, ...] = ()) -> list[int]:
    """Prefill the prompt, then decode one token at a time through the paged cache."""
    seq = PagedSequence(list(prompt), pages)
    out: list[int] = []
    n = len(prompt)
    for _ in range(max_new_tokens):
        (logits,) = step(model, cache, [(seq, n)], all_logits=False)
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        seq.tokens.append(token)
        n = 1
    return out


def greedy_logprobs(engine, prompts: list[list[int]], steps: int
                    ) -> dict[str, list[tuple[int, float]]]:
    """Greedy `steps` tokens of each prompt through an LLMEngine: request id ("r0", "r1",
    ...) -> [(token, its logprob)]; a request that ends in error fails the test."""
    from scheduler.sampling_params import SamplingParams

    got = {}
    for i, p in enumerate(prompts):
        got[f"r{i}"] = []
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=steps, temperature=0.0,
                                                      ignore_eos=True, logprobs=0))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            got[out.request_id] += [(t, lp[0].logprob) for t, lp in
                                    zip(out.new_token_ids, out.new_logprobs)]
    return got
