"""Decode-step latency of our model vs transformers' forward at a fixed context (CPU).

    python -m bench.decode_step --threads 1 --context 1024 --batch 1 8 --dtype bfloat16 float32

Our step: one new token per sequence over `context` cached tokens in shuffled pages.
transformers: one forward of [B, 1] tokens with a DynamicCache of `context - 1` random tokens.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import parser, time_calls  # noqa: E402
from engine.gguf_convert import ensure_hf_folder  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from kernels.attention import AttentionBatch  # noqa: E402
from tests.kv_cache import make_kv_cache  # noqa: E402 - the harness's dense KV cache


def ours_step_s(model, batch_size: int, context: int, page_size: int, steps: int) -> float:
    per_seq = -(-context // page_size)
    cache = make_kv_cache(model, batch_size * per_seq + 1, page_size)
    ids = torch.randperm(cache.num_pages)[:batch_size * per_seq].view(batch_size, per_seq)
    batch = AttentionBatch.build(ids.tolist(), [context] * batch_size, [1] * batch_size,
                                 page_size)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size,))
    positions = torch.full((batch_size,), context - 1, dtype=torch.int64)
    rows = torch.arange(batch_size)
    return statistics.fmean(time_calls(lambda: model(tokens, positions, batch, cache, rows), steps))


def hf_step_s(folder, dtype, batch_size: int, context: int, steps: int) -> float:
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    cfg = hf.config
    shape = (batch_size, cfg.num_key_value_heads, context - 1, cfg.head_dim)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, 1))
    pos = torch.full((batch_size, 1), context - 1)

    def step():
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            cache.update(kv[layer][0], kv[layer][1], layer)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(input_ids=tokens, position_ids=pos, past_key_values=cache, use_cache=True)
        return time.perf_counter() - t0

    kv = [(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype))
          for _ in range(cfg.num_hidden_layers)]
    step()
    return sum(step() for _ in range(steps)) / steps


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = ensure_hf_folder(args.model)
    print(f"threads={args.threads} context={args.context} page_size={args.page_size}")
    for name in args.dtype:
        dtype = getattr(torch, name)
        model = load_model(folder, dtype=dtype, max_model_len=max(args.context, 2048))
        for b in args.batch:
            ours = ours_step_s(model, b, args.context, args.page_size, args.steps)
            line = (f"{name:9s} batch={b:<3d} ours {ours * 1e3:7.1f} ms/step "
                    f"({b / ours:6.1f} tok/s)")
            if not args.no_hf:
                hf = hf_step_s(folder, dtype, b, args.context, args.steps)
                line += f" | transformers {hf * 1e3:7.1f} ms/step ({b / hf:6.1f} tok/s)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
