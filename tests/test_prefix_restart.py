"""The prefix cache across a crash, for real: `strata serve` with a disk tier, killed with
SIGKILL while it writes a request's pages, started again on the same --kv-disk-path, serves
the document it had cached without prefilling it again (usage.prompt_tokens_details)."""
from __future__ import annotations

import signal

import pytest

from tests.server_helpers import MODEL, openai_client, running_server

pytestmark = pytest.mark.slow

DOC = ("Minutes of the harbour board. The new crane arrives in March; the old pier closes in "
       "May; the ferry timetable changes in June. ") * 45
OTHER = "A recipe: knead the dough, let it rest, shape the loaves, bake them hot. " * 60


def ask(client, doc: str, question: str, **kw):
    return client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=kw.pop("max_tokens", 8),
        messages=[{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}], **kw)


def test_a_restart_after_sigkill_serves_the_cached_document(tmp_path):
    args = ("--kv-disk-gb", "0.3", "--kv-disk-path", str(tmp_path / "kv"))
    with running_server(*args) as server:
        client = openai_client(server.url)
        first = ask(client, DOC, "When does the pier close?")
        n = first.usage.prompt_tokens
        assert n > 1000
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        again = ask(client, DOC, "When does the pier close?")
        assert again.usage.prompt_tokens_details.cached_tokens >= n - 48    # all full pages
        assert again.choices[0].message.content == first.choices[0].message.content
        assert server.metric("strata_prefix_cache_hits_total") >= n - 48
        # another document is being computed and written when the server is killed
        stream = ask(client, OTHER, "What comes last?", stream=True, max_tokens=200)
        next(iter(stream))
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    with running_server(*args) as server:
        client = openai_client(server.url)
        after = ask(client, DOC, "When does the pier close?")
        assert after.usage.prompt_tokens_details.cached_tokens >= n - 48
        assert after.choices[0].message.content == first.choices[0].message.content
        assert server.metric("strata_prefix_cache_pages", 'tier="disk"') >= (n - 48) // 16
