"""Hugging Face transformers `generate` as a benchmark peer (bench/throughput.py's
`transformers`, in bf16, and `transformers-fp32`, the same code in float32).

One batch per (context, concurrency) on the same prompts as Strata's ramp: batch size =
concurrency, prompts cut to the batch's shortest so there is no padding (a padded batch would
take SDPA's masked path); TTFT = the first step (the whole batch's prefill), decode tokens/s from
the later steps. bf16 is ~5x slower than float32 on CPUs without AVX-512 bf16 (AVX2 only), so
bench/throughput.py's default peer is transformers-fp32.
"""
from __future__ import annotations

import statistics
import time

DTYPES = {"transformers": "bfloat16", "transformers-fp32": "float32"}


def run(name: str, tok_ids: dict[int, list[list[int]]], levels: list[int], steps: int,
        bar) -> list[dict]:
    """Cells of peer `name` (a key of DTYPES): `steps` + 1 greedy tokens per batch."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
    from bench.common import model_folder, pct

    model = AutoModelForCausalLM.from_pretrained(model_folder(),
                                                 dtype=getattr(torch, DTYPES[name])).eval()

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    cells = []
    for context, prompts in tok_ids.items():
        for level in levels:
            bar.set_description(f"{name} {context // 1000}K c={level}")
            n = min(len(p) for p in prompts[:level])
            ids = torch.tensor([p[:n] for p in prompts[:level]])
            clock = Clock()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                               do_sample=False, pad_token_id=0,
                               stopping_criteria=StoppingCriteriaList([clock]))
            ts = clock.times
            itl = [b - a for a, b in zip(ts, ts[1:])]
            cells.append({"engine": name, "mode": "ramp", "context": context,
                          "concurrency": level,
                          "decode_tokens_per_s": level * (len(ts) - 1) / (ts[-1] - ts[0]),
                          "step_s": (ts[-1] - ts[0]) / (len(ts) - 1), "timed_tokens":
                          level * (len(ts) - 1),
                          "ttft_s": {"mean": ts[0] - t0, "p50": ts[0] - t0, "max": ts[0] - t0},
                          "itl_s": {"mean": statistics.fmean(itl), "p50": pct(itl, 50),
                                    "p99": pct(itl, 99)},
                          "prompt_tokens": n})
            bar.update(1)
    del model
    return cells
