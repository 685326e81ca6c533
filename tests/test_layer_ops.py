"""The decoder layer's small ops in C (kernels/layer_ops.py) against torch's: bit for bit in
bf16, to the last bit or within one ulp in float32; the model's forward the same either way in
float32, and as close to it in bf16."""
from __future__ import annotations

import pytest
import torch

from engine.rope import RotaryEmbedding
from kernels import layer_ops
from kernels.layer_ops import LayerOps

pytestmark = pytest.mark.skipif(layer_ops._layerops is None, reason="C extensions not built")

DTYPES = [torch.bfloat16, torch.float32]


def torch_norm(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * (xf.to(x.dtype) if x.dtype == torch.bfloat16 else xf)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """torch's results but for rounding: in bf16 the same bits but in rare values one ulp
    apart (torch sums RMSNorm's squares in an order that depends on the CPU's vector width);
    in float32 within float32 rounding."""
    if a.dtype == torch.bfloat16:
        diff = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3
    else:
        torch.testing.assert_close(a, b, rtol=3e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_torchs(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 576, generator=g) * 3).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    same(layer_ops.rms_norm(x, w, 1e-5), torch_norm(x, w, 1e-5))
    wide = torch.randn(9, 1000, generator=g).to(dtype)      # rows of a wider tensor
    same(layer_ops.rms_norm(wide[:, 100:676], w, 1e-5), torch_norm(wide[:, 100:676], w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place_first(dtype):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(5, 576, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(576, generator=g).to(dtype)
    total = x + r
    out = layer_ops.rms_norm(x, w, 1e-6, residual=r)
    assert torch.equal(x, total)
    same(out, torch_norm(total, w, 1e-6))


@pytest.mark.parametrize("d", [64, 24, 128])     # halves of 32, 12 (no whole vector), 64
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_heads_in_place_as_transformers(dtype, d):
    g = torch.Generator().manual_seed(2)
    t, h, kvh = 6, 9, 3
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype)
    rope = RotaryEmbedding(d, 4096, 10000.0, None, 4096)
    cos, sin = rope.cos_sin(torch.tensor([0, 1, 17, 500, 2000, 4095]), dtype)
    q = RotaryEmbedding.apply(qkv[:, :h * d].view(t, h, d), cos, sin)
    k = RotaryEmbedding.apply(qkv[:, h * d:(h + kvh) * d].view(t, kvh, d), cos, sin)
    v = qkv[:, (h + kvh) * d:].clone()
    layer_ops.rope_(qkv, h + kvh, d, cos, sin)
    assert torch.equal(qkv[:, :h * d].view(t, h, d), q)
    assert torch.equal(qkv[:, h * d:(h + kvh) * d].view(t, kvh, d), k)
    assert torch.equal(qkv[:, (h + kvh) * d:], v)         # V untouched


@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize("src_dtype", DTYPES)
def test_write_kv_equals_indexed_assignment(pool_dtype, src_dtype):
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 960, generator=g).to(src_dtype)
    k, v = qkv[:, 576:768].view(5, 3, 64), qkv[:, 768:].view(5, 3, 64)     # strided rows
    slots, offs = torch.tensor([1, 3, 3, 9, 0]), torch.tensor([0, 5, 6, 15, 2])
    pool = torch.randn(10, 2, 3, 16, 64, generator=g).to(pool_dtype)
    want = pool.clone()
    want[slots, 0, :, offs] = k.to(pool_dtype)
    want[slots, 1, :, offs] = v.to(pool_dtype)
    assert layer_ops.write_kv(pool, k, v, slots, offs)
    assert torch.equal(pool, want)


def test_write_kv_refuses_what_it_cannot_serve():
    pool = torch.zeros(4, 2, 3, 16, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    slots, offs = torch.tensor([0, 1]), torch.tensor([0, 1])
    assert not layer_ops.write_kv(pool, k.half(), k.half(), slots, offs)       # fp16
    assert not layer_ops.write_kv(pool, k, k, slots.int(), offs.int())          # int32 slots
    assert not layer_ops.write_kv(pool, k[:, :2], k[:, :2], slots, offs)        # 2 heads, not 3
    assert not pool.any()
    with pytest.raises(IndexError):
        layer_ops.write_kv(pool, k, k, torch.tensor([0, 4]), offs)
    with pytest.raises(IndexError):
        layer_ops.write_kv(pool, k, k, slots, torch.tensor([0, 16]))


def _prefill_and_greedy(model_dir, dtype, enabled):
    from engine.model_loader import load_model
    from tests.kv_cache import make_kv_cache
    from tests.model_helpers import PagedSequence, greedy, page_pool, step

    model = load_model(model_dir, dtype=dtype)
    prompt = list(range(100, 140))
    LayerOps.enabled = enabled
    try:
        cache = make_kv_cache(model, num_pages=32, page_size=16)
        (logits,) = step(model, cache, [(PagedSequence(list(prompt), page_pool(32)),
                                         len(prompt))])
        cache = make_kv_cache(model, num_pages=32, page_size=16)
        return logits.float(), greedy(model, cache, prompt, 12, page_pool(32))
    finally:
        LayerOps.enabled = True


def test_the_models_steps_are_the_same_with_torchs_ops(smollm2_dir):
    """float32: a prefill's logits within float32 rounding of torch's ops, and the same greedy
    tokens. bf16 cannot promise that on every CPU: torch sums RMSNorm's squares in an order
    that depends on the vector width, a rare one-ulp difference that 30 bf16 layers amplify
    (on an AVX2-only EPYC: 0.56 in a logit, and a near tie in the greedy tokens flips). There
    the C ops must be as close to the float32 model as torch's ops are."""
    torch_ops, torch_greedy = _prefill_and_greedy(smollm2_dir, torch.float32, False)
    ours, ours_greedy = _prefill_and_greedy(smollm2_dir, torch.float32, True)
    torch.testing.assert_close(ours, torch_ops, rtol=0, atol=1e-3)
    assert ours_greedy == torch_greedy
    err = {}
    for enabled in (False, True):
        logits, _ = _prefill_and_greedy(smollm2_dir, torch.bfloat16, enabled)
        e = (logits - torch_ops).abs()
        err[enabled] = (e.mean().item(), e.max().item())
    (t_mean, t_max), (o_mean, o_max) = err[False], err[True]
    assert o_mean <= 1.2 * t_mean and o_max <= 1.5 * t_max, err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (32, 64), (64, 64), (16, 48),
                                                (8, 16)])
def test_page_summaries_read_in_place_are_summarize_pages(dtype, page_size, head_dim):
    """The pages a step wrote, summarized from their pool slots: summarize_pages' min and max
    bit for bit, its mean to float32 rounding (torch adds the tokens in blocks, the C op in
    order: at most one ulp apart in bf16), for empty, partial and full pages, keys of any
    scale, NaN kept."""
    from kernels.page_summary import SUMMARY_MEAN, summarize_pages

    ps = page_size
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        pool = (torch.randn(12, 2, 3, ps, head_dim, generator=g)
                * 10.0 ** (seed % 5 - 2)).to(dtype)
        slots = torch.randint(0, 12, (5,), generator=g)
        valid = torch.tensor([0, 1, ps, ps // 2 - 1, int(torch.randint(0, ps + 1, (1,),
                                                                       generator=g))])
        if seed == 0:
            pool[slots[3], 0, 1, 2, 5] = float("nan")
        got = layer_ops.summarize_slots(pool, slots, valid)
        want = summarize_pages(pool[slots, 0], valid)
        assert torch.equal(got.isnan(), want.isnan())
        got, want = got.nan_to_num(7.0), want.nan_to_num(7.0)
        assert torch.equal(got[:, :, :SUMMARY_MEAN], want[:, :, :SUMMARY_MEAN])
        mean, ref = got[:, :, SUMMARY_MEAN].float(), want[:, :, SUMMARY_MEAN].float()
        # float32 sums in two orders: ps roundings of the largest key apart, then the
        # result's own rounding (one bf16 ulp is at most 2^-7 of the value)
        keys = pool[slots, 0].float().nan_to_num(0.0).abs().amax(dim=(2, 3))[..., None]
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
        assert bool(((mean - ref).abs() <= ulp * ref.abs() + ps * 2.0 ** -23 * keys).all())
        if seed == 0:                   # the NaN key's channel: min, max and mean
            assert bool(layer_ops.summarize_slots(pool, slots, valid)[3, 1, :, 5].isnan().all())
    with pytest.raises(IndexError):
        layer_ops.summarize_slots(pool, slots, torch.tensor([0, 1, ps + 1, 0, 0]))
    assert layer_ops.summarize_slots(pool.half(), slots, valid) is None    # torch's path
