"""TorchPagedAttention against the dense float32 reference over awkward lengths."""
from __future__ import annotations

import random

import pytest
import torch

from kernels.attention import AttentionBatch, TorchPagedAttention, reference_paged_attention
from kernels.backends import make_attention_backend
from tests.kv_cache import KVCache

AWKWARD_KV_LENS = [1, 15, 16, 17, 27, 61, 113, 577]


def _random_step(kv_lens, q_lens, page_size, kv_heads, head_dim, group, dtype, seed=0):
    """A cache with shuffled (non-contiguous) pages, filled with random K/V, and a step batch."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(need) + 7
    ids = list(range(num_pages))
    rng.shuffle(ids)
    page_ids, at = [], 0
    for n in need:
        page_ids.append(ids[at:at + n])
        at += n
    cache = KVCache(1, num_pages, page_size, kv_heads, head_dim, dtype)
    cache.layer(0).copy_(torch.randn(cache.layer(0).shape, generator=gen))
    batch = AttentionBatch.build(page_ids, kv_lens, q_lens, page_size)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, cache, batch


def _check(kv_lens, q_lens, page_size=16, kv_heads=2, group=3, head_dim=32,
           dtype=torch.float32, atol=1e-5):
    q, cache, batch = _random_step(kv_lens, q_lens, page_size, kv_heads, head_dim, group, dtype)
    scale = head_dim ** -0.5
    out = TorchPagedAttention().forward(q, cache.layer(0), batch, scale)
    ref = reference_paged_attention(q, cache.layer(0), batch, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("kv_len", AWKWARD_KV_LENS)
def test_decode_matches_reference_for_awkward_lengths(kv_len, page_size):
    _check([kv_len], [1], page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 8])
def test_batched_decode_of_mixed_lengths_matches_reference(page_size):
    _check(AWKWARD_KV_LENS, [1] * len(AWKWARD_KV_LENS), page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("kv_len", [15, 16, 17, 27, 61, 113, 577])
def test_whole_prompt_prefill_is_causal(kv_len, page_size):
    _check([kv_len], [kv_len], page_size=page_size)


@pytest.mark.parametrize("page_size", [16, 8])
def test_mixed_prefill_chunks_and_decodes_in_one_batch(page_size):
    kv_lens = [1, 15, 16, 17, 27, 61, 113, 577]
    q_lens = [1, 15, 1, 5, 27, 1, 40, 100]   # whole prompts, later chunks and decodes
    _check(kv_lens, q_lens, page_size=page_size)


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (4, 1), (1, 8), (3, 3)])
def test_gqa_groups_match_reference(kv_heads, group):
    _check([17, 61, 113], [1, 20, 113], kv_heads=kv_heads, group=group)
    _check([17, 61, 113], [1, 1, 1], kv_heads=kv_heads, group=group)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_heads,group", [(3, 3), (2, 1)])
def test_later_prefill_chunk_matches_reference_with_any_scale(dtype, atol, kv_heads, group):
    # a chunk that sees a long prefix plus itself causally (the split flash path on CPU)
    kv_lens, q_lens = [700, 130], [300, 129]
    q, cache, batch = _random_step(kv_lens, q_lens, 16, kv_heads, 64, group, dtype)
    for scale in (0.3, 64 ** -0.5):
        out = TorchPagedAttention().forward(q, cache.layer(0), batch, scale)
        ref = reference_paged_attention(q, cache.layer(0), batch, scale)
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


def test_later_chunks_take_the_masked_path_where_the_flash_op_is_missing(monkeypatch):
    # torch without the CPU flash op (and the GPU fallback): one SDPA call with the mask
    import kernels.attention as attention
    monkeypatch.setattr(attention, "_FLASH_CPU", None)
    _check([700, 61, 130], [300, 20, 129], page_size=16)


def test_bf16_cache_is_close_to_float32_reference():
    _check([27, 577], [1, 1], dtype=torch.bfloat16, atol=2e-2)
    _check([27, 577], [27, 64], dtype=torch.bfloat16, atol=2e-2)


def test_plan_is_reused_across_layers_and_replaced_for_a_new_batch():
    attn = TorchPagedAttention()
    q, cache, batch = _random_step([61, 17], [3, 1], 16, 2, 32, 2, torch.float32)
    attn.plan(batch)
    a = attn.forward(q, cache.layer(0), batch, 0.2)
    q2, cache2, batch2 = _random_step([5], [1], 16, 2, 32, 2, torch.float32, seed=1)
    b = attn.forward(q2, cache2.layer(0), batch2, 0.2)   # new batch: planned lazily
    torch.testing.assert_close(a, reference_paged_attention(q, cache.layer(0), batch, 0.2),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(b, reference_paged_attention(q2, cache2.layer(0), batch2, 0.2),
                               atol=1e-5, rtol=0)


def test_kv_cache_write_places_tokens_at_their_slots():
    cache = KVCache(2, 5, 4, 2, 8, torch.float32)
    slots = torch.tensor([4 * 3 + 1, 4 * 0 + 3, 4 * 4 + 0])
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    cache.write(1, slots, k, v)
    layer = cache.layer(1)
    for t, s in enumerate(slots.tolist()):
        torch.testing.assert_close(layer[s // 4, 0, :, s % 4], k[t])   # HND: [2, KVH, ps, D]
        torch.testing.assert_close(layer[s // 4, 1, :, s % 4], v[t])
    assert cache.layer(0).abs().sum() == 0
    assert int((layer != 0).sum()) == 2 * 3 * 2 * 8   # nothing else was touched


def test_kv_cache_budget_sizing():
    per_page = KVCache.bytes_per_page(30, 16, 3, 64, torch.bfloat16)
    assert per_page == 30 * 2 * 16 * 3 * 64 * 2
    assert KVCache.num_pages_for_budget(10 * per_page + 5, 30, 16, 3, 64, torch.bfloat16) == 10
    cache = KVCache(30, 4, 16, 3, 64, torch.bfloat16)
    assert cache.page_bytes == per_page
    assert cache.layer(0).shape == (4, 2, 3, 16, 64)     # [pages, K/V, KVH, page_size, D]


def test_cpu_backend_is_torch():
    assert isinstance(make_attention_backend("cpu"), TorchPagedAttention)
