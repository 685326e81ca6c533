"""Serving benchmark: N concurrent OpenAI-SDK clients against a Strata server, and `transformers`
`generate` on the same prompts as the reference.

    .venv/bin/python bench/serving.py --num-prompts 32 --concurrency 8 --max-tokens 128
    .venv/bin/python bench/serving.py --url http://127.0.0.1:8000/v1   # an already running server

Prints requests/s, output tokens/s, TTFT and inter-token latency percentiles, and writes
bench/results/serving.json. Every request generates exactly --max-tokens tokens (ignore_eos), so
engines are compared on the same work.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from openai import AsyncOpenAI
from tqdm import tqdm

if not __package__:                     # run as a script: import from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import add_out_arg, model_folder, pct, write_json  # noqa: E402
from bench.servers import async_openai, server_or_url  # noqa: E402

TOPICS = ["the water cycle", "how a compiler works", "the history of the printing press",
          "why the sky is blue", "how vaccines train the immune system", "the rules of chess",
          "photosynthesis", "how bridges carry load", "the causes of inflation", "plate tectonics",
          "how a CPU cache works", "the life of a star", "how bees communicate",
          "TCP congestion control"]


def prompts(n: int) -> list[str]:
    return [f"Write a detailed explanation of {TOPICS[i % len(TOPICS)]} for a curious student "
            f"(request {i})." for i in range(n)]


def summary(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs) if xs else float("nan"),
            "p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99)}


async def one(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times = []
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    usage = None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    t1 = time.perf_counter()
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": (times[0] - t0) if times else float("nan"), "itl": itl, "e2e": t1 - t0,
            "output_tokens": usage.completion_tokens if usage else len(times),
            "prompt_tokens": usage.prompt_tokens if usage else 0}


async def run_clients(url: str, model: str, ps: list[str], concurrency: int,
                      max_tokens: int) -> dict:
    client = async_openai(url, timeout=3600, max_retries=2)     # the SDK's default retries
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(ps), desc=f"strata c={concurrency}", unit="req")

    async def guarded(p):
        async with sem:
            r = await one(client, model, p, max_tokens)
            bar.update(1)
            return r

    t0 = time.perf_counter()
    results = await asyncio.gather(*(guarded(p) for p in ps))
    wall = time.perf_counter() - t0
    bar.close()
    out_tokens = sum(r["output_tokens"] for r in results)
    return {"requests": len(ps), "concurrency": concurrency, "wall_s": wall,
            "requests_per_s": len(ps) / wall, "output_tokens_per_s": out_tokens / wall,
            "prompt_tokens": sum(r["prompt_tokens"] for r in results), "output_tokens": out_tokens,
            "ttft_s": summary([r["ttft"] for r in results]),
            "itl_s": summary([x for r in results for x in r["itl"]]),
            "e2e_s": summary([r["e2e"] for r in results])}


def run_transformers(folder: Path, ps: list[str], batch: int, max_tokens: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in ps]
    out_tokens = 0
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(texts), batch), desc=f"transformers b={batch}", unit="batch"):
        enc = tok(texts[i:i + batch], return_tensors="pt", padding=True)
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id or 0)
        out_tokens += (gen.shape[1] - enc["input_ids"].shape[1]) * gen.shape[0]
    wall = time.perf_counter() - t0
    return {"requests": len(ps), "batch": batch, "wall_s": wall, "requests_per_s": len(ps) / wall,
            "output_tokens_per_s": out_tokens / wall, "output_tokens": out_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="base URL of a running server (…/v1); default: start one")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--server-args", default="", help="extra flags for the started server")
    ap.add_argument("--skip-transformers", action="store_true")
    add_out_arg(ap, "serving")
    a = ap.parse_args()

    ps = prompts(a.num_prompts)
    result = {"config": vars(a), "machine": {"cpus": os.cpu_count(), "platform": sys.platform}}
    with server_or_url(a.url, ["--dtype", a.dtype, *a.server_args.split()]) as (_, url):
        result["strata"] = asyncio.run(run_clients(url, a.model, ps, a.concurrency, a.max_tokens))
    if not a.skip_transformers:
        result["transformers"] = run_transformers(model_folder(), ps, a.concurrency,
                                                  a.max_tokens, a.dtype)

    s = result["strata"]
    print(f"\nstrata       c={a.concurrency}: {s['requests_per_s']:.2f} req/s, "
          f"{s['output_tokens_per_s']:.1f} output tok/s, TTFT p50 {s['ttft_s']['p50']*1e3:.0f} ms "
          f"p99 {s['ttft_s']['p99']*1e3:.0f} ms, ITL p50 {s['itl_s']['p50']*1e3:.1f} ms "
          f"p99 {s['itl_s']['p99']*1e3:.1f} ms")
    if "transformers" in result:
        t = result["transformers"]
        print(f"transformers b={a.concurrency}: {t['requests_per_s']:.2f} req/s, "
              f"{t['output_tokens_per_s']:.1f} output tok/s  "
              f"(strata/transformers = {s['output_tokens_per_s'] / t['output_tokens_per_s']:.2f}x)")
    write_json(a.out, result, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
