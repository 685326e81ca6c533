"""Prefix reuse under the real engine: outputs with a cache hit equal those without, in every
placement and pipeline mode; shared pages outlive the request that computed them; a full
index never harms a request; another namespace never hits; the cache survives a restart."""
from __future__ import annotations

import errno

import pytest

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from kvstore.tiers import segment_log
from kvstore.tiers.disk_fault import DiskFault
from tests.engine_helpers import greedy, run

pytestmark = pytest.mark.slow

STEPS = 12
SPARSE = dict(sparse_budget=256)          # 16 pages of a ~40-page context: truly sparse
TIERS = dict(kv_host_pool="separate", kv_host_gb=0.05)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from server.tokenizer import Tokenizer
    return Tokenizer.from_folder(smollm2_dir)


def chat(tok, doc: str, question: str) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}])


@pytest.fixture(scope="module")
def doc() -> str:
    return ("The lighthouse keeper wrote in his log every night. " * 50
            + "The secret code is 4921. " + "Waves hit the rocks. " * 20)


@pytest.fixture(scope="module")
def prompts(tok, doc):
    return [chat(tok, doc, "What is the secret code?"), chat(tok, doc, "Who kept a log?")]


def make(folder, tmp_path=None, **kw) -> LLMEngine:
    if "kv_disk_gb" in kw:
        kw.setdefault("kv_disk_path", tmp_path / "kv")
    kw.setdefault("kv_device_gb", 0.1)
    kw.setdefault("page_size", 16)
    return LLMEngine(EngineArgs(model=str(folder), dtype="auto", **kw))


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts):
    """Outputs without the cache: dense, and sparse (each prompt alone)."""
    out = {}
    for name, kw in (("dense", {}), ("sparse", SPARSE)):
        got, errors = run(make(smollm2_dir, prefix_cache="off", **kw), prompts, STEPS)
        assert not errors
        out[name] = got
    return out


CASES = {
    "dense": ({}, None),
    "sparse": (SPARSE, None),
    "sparse-sfc": (dict(SPARSE, pipeline="sfc"), None),
    "sparse-layer-ahead": (dict(SPARSE, pipeline="layer-ahead"), None),
    "sparse-host": (dict(SPARSE, **TIERS, kv_force_tier="host"), "host"),
    "sparse-disk": (dict(SPARSE, **TIERS, kv_disk_gb=0.2, kv_force_tier="disk"), "disk"),
    "dense-disk": (dict(TIERS, kv_disk_gb=0.2, kv_force_tier="disk"), "disk"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_cache_hit_gives_the_outputs_of_no_cache(smollm2_dir, prompts, reference, tmp_path,
                                                   case):
    kw, tier = CASES[case]
    engine = make(smollm2_dir, tmp_path, **kw)
    first, errors = run(engine, prompts[:1], STEPS, ids=["a"])
    assert not errors
    before = engine.store.stats.snapshot()
    engine.add_request("b", prompts[1], greedy(STEPS))
    cached = []
    got = {"b": []}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got["b"].extend(out.new_token_ids)
            cached.append(out.num_cached_tokens)
    ref = reference["sparse" if "sparse" in case else "dense"]
    assert first["a"] == ref["r0"]
    assert got["b"] == ref["r1"]
    # the document's pages were reused: all but the last window and the question
    assert cached[-1] >= len(prompts[1]) - 64 - 32, (cached[-1], len(prompts[1]))
    if tier is not None:       # forced down after every step: the hits came from that tier
        after = engine.store.stats.snapshot()
        assert after.hits.get(tier, 0) > before.hits.get(tier, 0)
    engine.store.close()


def test_concurrent_requests_share_one_set_of_pages(smollm2_dir, tok):
    doc = "Ledger entry: the vault opened at dawn and closed at dusk. " * 230     # ~3K tokens
    a_ids, b_ids = chat(tok, doc, "When did the vault open?"), chat(tok, doc, "Why?")
    ref, errors = run(make(smollm2_dir, prefix_cache="off", kv_device_gb=0.2), [b_ids], 16)
    assert not errors and len(b_ids) > 3000
    engine = make(smollm2_dir, kv_device_gb=0.2)
    engine.add_request("a", a_ids, greedy(4))
    got = {"a": [], "b": []}
    while not got["a"]:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    engine.add_request("b", b_ids, greedy(16))
    shared, checked = None, False
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            got[out.request_id].extend(out.new_token_ids)
            if out.request_id == "b" and shared is None:
                pa, pb = engine.store.pages("a"), engine.store.pages("b")
                shared = [p for p, q in zip(pa, pb) if p == q]
                assert len(shared) >= (len(b_ids) - 64) // 16       # one set of pages
        if shared and not engine.scheduler.get_request("a") and engine.scheduler.get_request("b"):
            # a finished first: b still holds the pages it shares, and the cache too
            assert all(engine.store.refs(p) == 2 for p in shared)
            checked = True
    assert checked, "b finished before a"
    assert got["b"] == ref["r0"]
    assert engine.store.num_used_pages == 0 and engine.store.num_cached_pages > 0
    engine.store.clear_prefix_cache()
    assert engine.store.num_cached_pages == 0 and engine.store.num_free_pages == \
        engine.store.num_pages


def test_the_next_turn_reuses_the_answer_too(smollm2_dir, prompts):
    engine = make(smollm2_dir)
    got, errors = run(engine, prompts[:1], 40, ids=["a"])
    assert not errors
    computed = len(prompts[0]) + 39                 # the last token's KV was never computed
    follow = prompts[0] + got["a"] + prompts[1][-20:]
    engine.add_request("b", follow, greedy(2))
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            cached = out.num_cached_tokens
    assert cached == computed // 16 * 16 > len(prompts[0])


def test_a_salted_prompt_shares_pages_with_its_own_salt_alone(smollm2_dir, prompts, reference):
    from dataclasses import replace
    engine = make(smollm2_dir)
    full = (len(prompts[0]) - 1) // 16 * 16

    def cached(rid, salt):
        engine.add_request(rid, prompts[0], replace(greedy(STEPS), cache_salt=salt))
        got, hit = [], None
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                got += out.new_token_ids
                hit = out.num_cached_tokens
        assert got == reference["dense"]["r0"]
        return hit

    hits = [cached("a", "tenant-a"), cached("plain", None), cached("b", "tenant-b"),
            cached("a2", "tenant-a"), cached("plain2", None)]
    assert hits == [0, 0, 0, full, full]


def test_one_document_sent_by_several_clients_at_once_is_computed_once(smollm2_dir, tok, doc):
    # a prefill of several steps: the others wait for its pages instead of computing them
    engine = make(smollm2_dir, max_num_batched_tokens=256)
    questions = ["What is the code?", "Who wrote?", "Where?", "When?"]
    prompts = [chat(tok, doc, q) for q in questions]
    got, errors = run(engine, prompts, 2)
    assert not errors
    doc_tokens = min(len(p) for p in prompts) - 64
    assert engine.scheduler.prefix_hit_tokens >= 3 * doc_tokens
    assert engine.scheduler.prefix_queried_tokens == sum(len(p) for p in prompts)


def test_unused_cached_pages_make_room_least_recent_first(smollm2_dir, tok):
    # a KV pool of ~3 documents: eight documents all complete; the last ones stay cached
    docs = [f"Chapter {i}: " + f"the river number {i} flows east. " * 60 for i in range(8)]
    engine = make(smollm2_dir, kv_device_gb=0.03)
    pages = engine.store.num_pages
    for i, d in enumerate(docs):
        _, errors = run(engine, [chat(tok, d, "Which way?")], 2, ids=[f"d{i}"])
        assert not errors
        assert engine.store.num_used_pages <= pages
    _, errors = run(engine, [chat(tok, docs[-1], "And then?")], 2, ids=["again"])
    assert engine.scheduler.prefix_hit_tokens > 0
    hits = engine.scheduler.prefix_hit_tokens
    _, errors = run(engine, [chat(tok, docs[0], "And then?")], 2, ids=["first"])
    # the oldest document was evicted: only the chat template's first page, common to all
    assert engine.scheduler.prefix_hit_tokens - hits <= 32


def test_a_full_disk_under_the_index_harms_no_request(smollm2_dir, prompts, reference,
                                                      tmp_path):
    engine = make(smollm2_dir, tmp_path, kv_disk_gb=0.2, **TIERS)
    engine.store.tiers.disk_tier.fault = DiskFault(index_errno=errno.ENOSPC)
    got, errors = run(engine, prompts, STEPS)
    assert not errors and got == reference["dense"]
    engine.store.close()
    indexed = [segment_log.parse(p) for p in (tmp_path / "kv").glob("*.idx")]
    assert all(not parsed.pages for parsed in indexed)        # nothing indexed
    again = make(smollm2_dir, tmp_path, kv_disk_gb=0.2, **TIERS)
    assert again.store.prefix_pages() == {} or sum(again.store.prefix_pages().values()) == 0
    got, errors = run(again, prompts[:1], STEPS)
    assert not errors and got["r0"] == reference["dense"]["r0"]
    assert again.scheduler.prefix_hit_tokens == 0
    again.store.close()


def _restarted_hits(folder, tmp_path, prompt, **kw) -> tuple[list[int], int]:
    kw = {"dtype": "auto", **kw}
    engine = LLMEngine(EngineArgs(model=str(folder), kv_device_gb=0.1, kv_disk_gb=0.2,
                                  kv_disk_path=tmp_path / "kv", **TIERS,
                                  **{"page_size": 16, **kw}))
    got, errors = run(engine, [prompt], STEPS)
    assert not errors
    hits = engine.scheduler.prefix_hit_tokens
    engine.store.close()
    return got["r0"], hits


def test_the_cache_survives_a_restart_but_not_a_change_of_namespace(smollm2_dir, prompts,
                                                                    reference, tmp_path):
    out, hits = _restarted_hits(smollm2_dir, tmp_path, prompts[0])
    assert hits == 0 and out == reference["dense"]["r0"]
    out, hits = _restarted_hits(smollm2_dir, tmp_path, prompts[1])     # restart: hit
    assert hits > 0 and out == reference["dense"]["r1"]
    # another page size (another page shape and namespace): no hit; the files stay
    files = sorted(p.name for p in (tmp_path / "kv").iterdir())
    out, hits = _restarted_hits(smollm2_dir, tmp_path, prompts[1], page_size=32)
    assert hits == 0
    assert set(files) <= {p.name for p in (tmp_path / "kv").iterdir()}
    # another KV dtype: no hit either
    out, hits = _restarted_hits(smollm2_dir, tmp_path, prompts[1], dtype="fp32")
    assert hits == 0
    out, hits = _restarted_hits(smollm2_dir, tmp_path, prompts[1])     # the first again
    assert hits > 0 and out == reference["dense"]["r1"]


def test_a_page_damaged_while_stopped_is_dropped_and_recomputed(smollm2_dir, prompts,
                                                                reference, tmp_path, caplog):
    _restarted_hits(smollm2_dir, tmp_path, prompts[0])
    seg = min((tmp_path / "kv").glob("seg-*.kv"))
    head = segment_log.parse(seg.with_suffix(".idx")).header
    stride = -(-2 * 3 * 16 * 64 * 2 // 4096) * 4096          # one bf16 page, 4096-aligned
    with open(seg, "r+b") as f:                                # page 5 of layer 7
        f.seek((7 * head.capacity + 5) * stride + 100)
        f.write(b"\x55" * 64)
    out, hits = _restarted_hits(smollm2_dir, tmp_path, prompts[1])
    assert hits == 5 * 16                 # the match ends at the damaged page
    assert out == reference["dense"]["r1"]
    assert "failed their check" in caplog.text
