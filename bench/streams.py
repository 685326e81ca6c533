"""The benchmark client's streams (bench/throughput.py): each streamed chat request's token
arrival times, the token count of a chunk (llama-server's or ours), and waits that wake when
tokens arrive rather than on a timer (a client polling every few ms steals the cores of a
server that uses them all, on a small machine)."""
from __future__ import annotations

import asyncio
import time
import weakref


class Stream:
    """One streamed chat completion: a timestamp per token."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.end: float | None = None       # when the stream ended (not when cancelled)
        self.error: str | None = None


class TokenCounter:
    """Tokens in each chunk of one stream: from `timings.predicted_n` (llama-server with
    `timings_per_token`: the tokens generated so far) when the chunk has it, else one per
    logprobs entry, else one per chunk with content."""

    def __init__(self) -> None:
        self.total = 0

    def add(self, chunk) -> int:
        timings = (getattr(chunk, "model_extra", None) or {}).get("timings")
        if isinstance(timings, dict) and "predicted_n" in timings:
            n = max(0, int(timings["predicted_n"]) - self.total)
        elif not chunk.choices:
            n = 0
        else:
            lp = chunk.choices[0].logprobs
            n = len(lp.content) if lp is not None and lp.content else \
                (1 if chunk.choices[0].delta.content else 0)
        self.total += n
        return n


async def consume(client, model: str, text: str, max_tokens: int, st: Stream,
                   extra_body: dict | None = None) -> None:
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
            temperature=0, stream=True, logprobs=True,
            extra_body=extra_body or {"ignore_eos": True})
        counter = TokenCounter()
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                st.times.extend([now] * counter.add(chunk))
                _tokens().set()
        st.end = time.perf_counter()
    except asyncio.CancelledError:
        raise
    except Exception as e:   # noqa: BLE001 (reported per request)
        st.error = f"{type(e).__name__}: {e}"
    finally:
        _tokens().set()


# set whenever a stream receives tokens or ends (one event per event loop): waits wake on it,
# not on a timer (a client polling every few ms steals the cores of a server that uses them
# all, on a small machine)
_EVENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tokens() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    if loop not in _EVENTS:
        _EVENTS[loop] = asyncio.Event()
    return _EVENTS[loop]


async def wait_for(pred, streams: list[Stream], timeout: float, poll: float = 0.5,
                on_tokens: bool = True) -> None:
    """Until pred() holds, checked as tokens arrive (`on_tokens`) and every `poll` seconds."""
    deadline = time.perf_counter() + timeout
    while not pred():
        errs = [s.error for s in streams if s.error]
        if errs:
            raise RuntimeError(f"request failed: {errs[0]}")
        if time.perf_counter() > deadline:
            raise TimeoutError("timed out waiting for the server")
        if not on_tokens:
            await asyncio.sleep(poll)
            continue
        event = _tokens()
        event.clear()
        try:
            await asyncio.wait_for(event.wait(), poll)
        except asyncio.TimeoutError:
            pass
