"""What the server writes to its log about the work it does, for people who watch a terminal
rather than Grafana (vLLM's and llama.cpp's habits):

- every `interval_s` while requests run or wait (vLLM's stats line; off with
  --disable-log-stats): prompt and generation throughput over the interval, running and
  waiting requests, the KV pages in use, the prefix cache's hit rate and the drafts kept;
- with --enable-log-requests, one line per finished engine request (as llama.cpp prints its
  timings): prompt tokens and how many came from the prefix cache, output tokens and why it
  ended, time to the first token, decode speed, and the whole time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("strata.stats")

INTERVAL_S = 10.0


@dataclass
class _Mark:
    at: float
    prompt: int = 0
    generated: int = 0
    queried: int = 0
    hit: int = 0
    drafted: int = 0
    kept: int = 0


class StatsLogger:
    """The periodic stats line: `line()` over the interval since the last one."""

    def __init__(self, metrics, engine, interval_s: float = INTERVAL_S):
        self._metrics, self._engine, self.interval_s = metrics, engine, interval_s
        self._last = _Mark(time.monotonic())

    def line(self) -> str | None:
        """The line for the interval just ended, None when nothing ran or waited in it."""
        try:
            stats = self._engine.stats()
        except Exception:                        # loading, or the engine is gone
            return None
        _, drafted, kept = stats.spec_decode
        now = _Mark(time.monotonic(), self._metrics.prompt_total, self._metrics.generated_total,
                    stats.prefix_queried_tokens, stats.prefix_hit_tokens, drafted, kept)
        last, self._last = self._last, now
        moved = (now.prompt, now.generated) != (last.prompt, last.generated)
        if not (moved or stats.num_running or stats.num_waiting):
            return None
        span = max(now.at - last.at, 1e-9)
        queried = now.queried - last.queried
        parts = [f"prompt throughput {(now.prompt - last.prompt) / span:.1f} tokens/s",
                 f"generation throughput {(now.generated - last.generated) / span:.1f} tokens/s",
                 f"running {stats.num_running} reqs", f"waiting {stats.num_waiting} reqs",
                 f"KV pages used {100 * stats.kv_pages_used / max(stats.kv_pages_total, 1):.1f}%",
                 f"prefix cache hit rate {100 * (now.hit - last.hit) / max(queried, 1):.1f}%"]
        if now.drafted > last.drafted:
            parts.append("drafts kept "
                         f"{100 * (now.kept - last.kept) / (now.drafted - last.drafted):.1f}%")
        return ", ".join(parts)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            text = self.line()
            if text is not None:
                logger.info("%s", text)


def request_line(request_id: str, reason: str, prompt: int, cached: int, output: int,
                 arrival: float, first: float | None, end: float) -> str:
    """A finished request's one line (--enable-log-requests)."""
    ttft = "-" if first is None else f"{first - arrival:.3f} s"
    decode = "-" if first is None or output < 2 or end <= first \
        else f"{(output - 1) / (end - first):.1f} tokens/s"
    return (f"{request_id}: {prompt} prompt tokens ({cached} cached), {output} output tokens "
            f"({reason}); first token {ttft}, decode {decode}, total {end - arrival:.3f} s")
