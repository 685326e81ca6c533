"""The three request APIs on one server, in turns: OpenAI chat completions, OpenAI responses
and Anthropic messages, each through its official SDK, streaming the same greedy answer to the
same prompt. Does answering as the chat request a Responses or Messages request means cost
anything? Per API: the median time to the first streamed token and the median whole request;
and a conversation's second turn continued by `previous_response_id` (the server rebuilds the
conversation from its store) against the same conversation resent whole through chat (both
find the first turn's pages in the prefix cache: what differs is the store's work).

    .venv/bin/python bench/api_shapes.py [--rounds 10] [--max-tokens 32]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_out_arg, cpu_line, machine, parser, result_header, result_path,
                          use_checkout_cache, write_json)
from bench.servers import server_or_url

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write two sentences about disks."


def timed(start, is_token) -> tuple[float, float]:
    """(seconds to the first token event, seconds to the end) of the stream `start()` opens
    (the server answers the request's headers once its first token is out)."""
    t0 = time.perf_counter()
    first = None
    for event in start():
        if first is None and is_token(event):
            first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0


def run_round(base: str, max_tokens: int) -> dict[str, tuple[float, float]]:
    import anthropic
    import openai
    oa = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    an = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]
    out = {
        "chat": timed(lambda: oa.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0, stream=True),
            lambda c: bool(c.choices and c.choices[0].delta.content)),
        "responses": timed(lambda: oa.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=max_tokens, temperature=0,
            stream=True, store=False), lambda e: e.type == "response.output_text.delta"),
        "messages": timed(lambda: an.messages.create(
            model=MODEL, messages=msgs, max_tokens=max_tokens, stream=True,
            extra_body={"temperature": 0}),
            lambda e: e.type == "content_block_delta"),
    }
    first = oa.responses.create(model=MODEL, input=PROMPT, max_output_tokens=max_tokens,
                                temperature=0)
    follow = "And one more sentence."
    out["responses-continued"] = timed(lambda: oa.responses.create(
        model=MODEL, input=follow, previous_response_id=first.id,
        max_output_tokens=max_tokens, temperature=0, stream=True),
        lambda e: e.type == "response.output_text.delta")
    out["chat-resent"] = timed(lambda: oa.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, temperature=0, stream=True, messages=[
            *msgs, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": follow}]),
        lambda c: bool(c.choices and c.choices[0].delta.content))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--url", default=None, help="a running server's base URL (no /v1)")
    add_out_arg(ap, "api_shapes")
    args = ap.parse_args(argv)
    use_checkout_cache()
    rows: dict[str, list[tuple[float, float]]] = {}
    with server_or_url(args.url, [], api="") as (_, base):
        run_round(base, args.max_tokens)                    # warm-up: core split, caches
        for _ in range(args.rounds):
            for api, t in run_round(base, args.max_tokens).items():
                rows.setdefault(api, []).append(t)
    m = machine()
    result = {**result_header("api_shapes"), "rounds": args.rounds,
              "max_tokens": args.max_tokens, "apis": {
                  api: {"ttft_ms": 1e3 * statistics.median(t[0] for t in ts),
                        "request_ms": 1e3 * statistics.median(t[1] for t in ts)}
                  for api, ts in rows.items()}}
    print(cpu_line(m))
    print("| API | TTFT ms (median) | request ms (median) |\n|---|---|---|")
    for api, r in result["apis"].items():
        print(f"| {api} | {r['ttft_ms']:.1f} | {r['request_ms']:.1f} |")
    print("wrote", write_json(result_path(args.out, "api_shapes"), result))


if __name__ == "__main__":
    main()
