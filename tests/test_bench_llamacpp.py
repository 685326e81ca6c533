"""The llama.cpp peer of bench/throughput.py (bench/peers/llamacpp.py). Without a build: the
command line for N slots, the token counter on both servers' chunk shapes, and the skip message
naming `make peers`. With the binary built (`make peers`, or $LLAMA_SERVER): a real llama-server
with two slots serves two concurrent streamed chat requests through the `openai` client, and the
bench counts every token of them, times a ramp of 1 then 2 requests, and a burst of 2 sent at
once without its prompt cache."""
from __future__ import annotations

import asyncio
import time

import pytest
from openai.types.chat import ChatCompletionChunk

from bench import common, servers, streams, throughput
from bench.peers import llamacpp
from server.tokenizer import Tokenizer


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_gives_each_slot_the_model_length_and_every_thread():
    cmd = llamacpp.command("/opt/llama-server", "/m/model.gguf", 4, 8192, 8123, threads=2)
    assert cmd[0] == "/opt/llama-server"
    assert _flag(cmd, "--model") == "/m/model.gguf"
    assert _flag(cmd, "--parallel") == "4"
    assert _flag(cmd, "--ctx-size") == str(4 * 8192)        # llama-server splits it per slot
    assert _flag(cmd, "--threads") == "2" and _flag(cmd, "--threads-batch") == "2"
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "8123"
    assert _flag(cmd, "--alias") == llamacpp.MODEL_NAME
    assert "--cont-batching" in cmd and "--no-webui" in cmd
    one = llamacpp.command("/opt/llama-server", "/m/model.gguf", 1, 8192, 8123, threads=2)
    assert _flag(one, "--parallel") == "1" and _flag(one, "--ctx-size") == "8192"
    with pytest.raises(ValueError):
        llamacpp.command("/opt/llama-server", "/m/model.gguf", 0, 8192, 8123)


def _chunk(content: str | None, logprobs: int | None = None, predicted_n: int | None = None):
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": None}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": "x", "logprob": -0.1, "top_logprobs": []}]
                              * logprobs}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [choice]}
    if predicted_n is not None:
        body["timings"] = {"predicted_n": predicted_n, "predicted_ms": 1.0}
    return ChatCompletionChunk.model_validate(body)


def test_token_counter_reads_llama_server_timings_and_strata_logprobs():
    # llama-server: a role-only first chunk, then a chunk per sent token with the cumulative
    # count; a held-back token (no chunk of its own) shows up in the next chunk's count
    counter = streams.TokenCounter()
    assert [counter.add(c) for c in (_chunk(None), _chunk("A", 1, 1), _chunk("B", 1, 2),
                                     _chunk("CD", 1, 4))] == [0, 1, 1, 2]
    assert counter.total == 4
    # Strata: one logprobs entry per token, no timings
    counter = streams.TokenCounter()
    assert [counter.add(c) for c in (_chunk("A", 1), _chunk("BC", 2), _chunk("D"))] == [1, 2, 1]


def test_a_missing_binary_is_skipped_with_a_message_naming_make_peers(monkeypatch, tmp_path):
    missing = tmp_path / "bin" / "llama-server"
    monkeypatch.setenv("LLAMA_SERVER", str(missing))
    assert llamacpp.binary_path() == missing and llamacpp.find_binary() is None
    msg = llamacpp.missing_message()
    assert "make peers" in msg and str(missing) in msg
    with pytest.raises(RuntimeError, match="make peers"):
        llamacpp.start(tmp_path / "llama.log", 2, 8192)
    args = throughput.build_parser().parse_args(
        ["--configs", "--contexts", "300", "--concurrency", "1", "--peers", "llama.cpp",
         "--log-dir", str(tmp_path / "logs")])
    args.peer_concurrency = args.concurrency
    report = throughput.run(args)
    assert report["skipped"] == {"llama.cpp": msg} and report["cells"] == []
    assert report["settings"]["peers"] == [] and "cpu_flags" in report["machine"]


needs_binary = pytest.mark.skipif(llamacpp.find_binary() is None,
                                  reason=llamacpp.missing_message())


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    srv = llamacpp.start(tmp_path_factory.mktemp("llamacpp") / "llama-server.log", 2,
                         throughput.MODEL_LEN)
    yield srv
    servers.stop(srv.proc)


async def _stream(client, text: str, max_tokens: int) -> tuple[int, str, list[float]]:
    stream = await client.chat.completions.create(
        model=llamacpp.MODEL_NAME, messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens, temperature=0, stream=True, logprobs=True,
        extra_body=llamacpp.REQUEST)
    counter, text_out, times = streams.TokenCounter(), "", []
    async for chunk in stream:
        if counter.add(chunk):
            times.append(time.perf_counter())
        if chunk.choices and chunk.choices[0].delta.content:
            text_out += chunk.choices[0].delta.content
    return counter.total, text_out, times


@needs_binary
def test_two_concurrent_streams_return_tokens_and_are_counted(llama_server):
    from openai import AsyncOpenAI
    assert llama_server.version and llama_server.cmd[0].endswith("llama-server")
    assert _flag(llama_server.cmd, "--parallel") == "2"

    async def both():
        async with AsyncOpenAI(base_url=llama_server.base + "/v1", api_key="none",
                               timeout=300, max_retries=0) as client:
            return await asyncio.gather(_stream(client, "Name three planets.", 24),
                                        _stream(client, "Write a haiku about disks.", 24))

    (n1, text1, t1), (n2, text2, t2) = asyncio.run(both())
    # ignore_eos: exactly max_tokens each, every one counted (timings.predicted_n)
    assert (n1, n2) == (24, 24), (text1, text2)
    assert text1.strip() and text2.strip()
    assert t2[0] < t1[-1] and t1[0] < t2[-1]      # the two were decoded together (two slots)


@needs_binary
def test_the_ramp_times_llama_server_at_one_then_two_in_flight(llama_server, smollm2_dir):
    tok = Tokenizer.from_folder(smollm2_dir)
    texts = common.essay_texts(tok, 2, 300)
    lens = [len(tok.encode_chat([{"role": "user", "content": t}])) for t in texts]
    rows = asyncio.run(throughput.ramp(llama_server.base, llamacpp.MODEL_NAME, texts, lens,
                                       [1, 2], steps=3, metrics=False,
                                       extra_body=llamacpp.REQUEST))
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["timed_tokens"] >= 3 * r["concurrency"]
        assert r["decode_tokens_per_s"] > 0 and r["ttft_s"]["mean"] > 0


@needs_binary
def test_a_burst_of_two_on_llama_server_without_its_prompt_cache(llama_server, smollm2_dir):
    tok = Tokenizer.from_folder(smollm2_dir)
    texts = common.essay_texts(tok, 2, 300)
    lens = [len(tok.encode_chat([{"role": "user", "content": t}])) for t in texts]
    body = {**llamacpp.REQUEST, "cache_prompt": False}
    row = asyncio.run(throughput.burst(llama_server.base, llamacpp.MODEL_NAME, texts, lens, 2, 4,
                                       extra_body=body))
    assert row["mode"] == "burst" and row["concurrency"] == 2 and row["burst_tokens"] == 4
    assert row["wall_s"] >= row["ttft_s"]["max"] > 0
    assert row["decode_tokens_per_s"] > 0 and row["window_tokens"] > 0
