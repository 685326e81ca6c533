"""A sliding-window layer's pages before its window leave the KV memory (kvstore/window_trim.py):
the bookkeeping over a real allocator, then a Gemma 3-shaped model served past what whole pages
would fit, greedy tokens equal to transformers', with the prefix cache on."""
import pytest
import torch

from kvstore.page_allocator import PageAllocator
from kvstore.window_trim import WindowTrim, id_space, window_groups
from tests.model_helpers import hf_generate, save_tiny_hf

PS = 16
WINDOWS = (None, 20, 20)        # a full layer and two of a 20-token window


def _trim(whole_pages=8):
    alloc = PageAllocator(id_space(WINDOWS, whole_pages), PS)
    return alloc, WindowTrim(WINDOWS, PS, whole_pages, alloc)


def _grow(alloc, trim, rid, tokens):
    before = len(alloc.pages(rid))
    assert alloc.allocate(rid, tokens)
    trim.added(alloc.pages(rid)[before:], before)
    return alloc.pages(rid)


def _advance(trim, rid, start, pages):
    trim.moved(rid, start)
    return trim.advance(rid, pages)


def test_window_groups_and_the_id_space():
    assert window_groups((None, 20, 8, 20)) == [(8, (2,)), (20, (1, 3))]
    assert id_space(WINDOWS, 8) == 24             # the slots of 8 pages, over 1 full layer
    assert id_space((None,) * 3, 8) == 8
    assert id_space((20,) * 3, 8) == 24           # none full: a slot a page
    assert id_space((20,) * 32, 8) == 64          # at most ID_FACTOR x


def test_pages_before_the_window_lose_the_windowed_layers():
    alloc, trim = _trim()
    pages = _grow(alloc, trim, "a", 96)           # 6 pages, 18 slots
    assert trim.used_slots == 18
    # the next query at 96 reads keys from 77 on: pages 0-3 (keys up to 63) are dead; a page
    # of slack stays (a resent prompt matching 80 tokens reads from key 61 on)
    drops = _advance(trim, "a", 96, pages)
    assert drops == [(list(pages[:3]), (1, 2))]
    assert trim.used_slots == 18 - 3 * 2 and trim.cost(pages[:4]) == 3 + 3
    assert _advance(trim, "a", 98, pages) == []     # nothing new: a query at 82 reads key 63
    assert _advance(trim, "a", 99, pages) == [([pages[3]], (1, 2))]
    alloc.release("a")
    trim.gone(list(pages))
    assert trim.used_slots == 0 and not any(trim.trimmed(p) for p in pages)


def test_a_page_a_sharing_request_still_reads_stays():
    alloc, trim = _trim()
    pages = _grow(alloc, trim, "a", 96)
    alloc.share("b", pages[:3])                   # b starts after 48 tokens, no step yet
    assert _advance(trim, "a", 96, pages) == []     # b may read from page 0 on
    drops = _advance(trim, "b", 64, pages[:3])      # b at 64: page 0 is dead (and a page)
    assert drops == [([pages[0]], (1, 2))]
    assert _advance(trim, "a", 96, pages) == []     # b reads page 1 on
    alloc.release("b")
    trim.ended("b")
    assert _advance(trim, "a", 96, pages) == [(list(pages[1:3]), (1, 2))]


def test_cached_pages_are_retained_until_slots_run_short():
    alloc, trim = _trim()
    pages = _grow(alloc, trim, "a", 96)
    alloc.hold(pages[:2])                         # the prefix cache keeps pages 0 and 1
    assert _advance(trim, "a", 96, pages) == [([pages[2]], (1, 2))]
    assert trim.retained_slots() == 4 and not trim.trimmed(pages[0])
    assert trim.reclaim(1) == [([pages[0]], (1, 2))]     # oldest first, as many as asked
    assert trim.reclaim(10) == [([pages[1]], (1, 2))]
    assert trim.retained_slots() == 0 and trim.used_slots == 18 - 3 * 2


def test_a_page_the_cache_let_go_is_trimmed_once():
    """b moves past a shared cached page (retained), the cache lets it go, a moves past it
    too (trimmed now): nothing is counted twice, every slot comes back."""
    alloc, trim = _trim()
    pages = _grow(alloc, trim, "a", 96)
    alloc.hold(pages[:1])
    alloc.share("b", pages[:2])
    trim.moved("a", 96)
    assert _advance(trim, "b", 64, pages[:2]) == []          # page 0: retained (cached)
    assert trim.retained_slots() == 2
    trim.gone(alloc.unhold(pages[:1]))                       # a and b still hold it
    assert _advance(trim, "a", 96, pages) == [([pages[0]], (1, 2))]    # b is past 1: stop
    assert trim.retained_slots() == 0 and trim.reclaim(10) == []
    for rid in ("a", "b"):
        trim.gone(alloc.release(rid))
        trim.ended(rid)
    assert trim.used_slots == 0


def test_a_cached_prefix_is_usable_where_its_last_window_is_whole():
    alloc, trim = _trim()
    pages = _grow(alloc, trim, "a", 96)
    _advance(trim, "a", 96, pages)                  # pages 0-2 trimmed
    assert trim.usable(pages) == 6                # a query at 96 reads pages 4 and 5
    assert trim.usable(pages[:5]) == 5            # at 80: keys from 61 on, page 3's
    assert trim.usable(pages[:4]) == 0            # at 64: keys from 45 on, page 2's, trimmed
    assert trim.usable([]) == 0


def test_the_capacity_counts_a_window_and_a_step_of_the_windowed_layers():
    _, trim = _trim(whole_pages=8)                # 24 slots
    # pages of a 20-token window, a 32-token step and one of slack: (20 + 32 - 1) // 16 + 3
    assert trim.peak_slots(8 * PS, 32) == 8 + 2 * 6
    # 3P - 2 (P - 6) <= 24 slots: P <= 12 (whole pages alone: 8)
    assert trim.capacity_pages(32) == 12
    assert trim.capacity_pages(16) == 14          # a window, 16 tokens and one: 5 pages


GEMMA3 = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 20, "pad_token_id": 0,
          "num_hidden_layers": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
# 6 whole pages of 4 layers (16 tokens x 2 KV heads x 16 dims x K,V x fp32 = 4 KiB a layer)
WHOLE_6 = 6 * 4 * 4096 / 2**30


def _engine(folder, **kw):
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    kw = dict(dict(kv_device_gb=WHOLE_6, max_num_batched_tokens=16), **kw)
    return LLMEngine(EngineArgs(model=str(folder), dtype="fp32", weights="fp32", page_size=PS,
                                **kw))


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3-trim")
    return folder, save_tiny_hf("gemma3", GEMMA3, folder)


def test_a_context_past_the_whole_pages_is_served_as_transformers_generates(gemma):
    """6 whole pages hold 96 tokens of every layer; with the windowed layers' dead pages gone a
    120-token request fits (--swa-full refuses it) and its greedy tokens are transformers'."""
    from kvstore.errors import KVNeverFits
    from tests.engine_helpers import run_scored

    folder, hf = gemma
    prompt = _prompt(1, 90)
    full = _engine(folder, swa_full=True)
    assert full.store.capacity_tokens() == 96
    with pytest.raises(KVNeverFits):
        run_scored(full, [prompt], 30)
    engine = _engine(folder, prefix_cache="off")
    assert engine.store.capacity_tokens() == 144       # 4P - 3 (P - 5) <= 24 slots: P = 9
    got, _ = run_scored(engine, [prompt], 30)
    assert got["r0"] == hf_generate(hf, prompt, 30)
    # (strata_kv_window_dropped_pages): before the last step, whose query is at 118, the
    # pages before key 99 (the window's first), less one of slack, go: 0-4, in 3 layers
    assert engine.store.stats.snapshot().window_dropped == 5 * 3


def test_prefix_reuse_with_trimmed_pages_gives_transformers_tokens(gemma):
    """Three prompts sharing a prefix at once (the later two wait for the first's pages and
    reuse them), decoding well past the window; then prompts that resend the first's text:
    their cached prefix is reused where its last window is whole (a trimmed page inside it is
    fine), recomputed pages take the trimmed ones' place in the cache, and every greedy token
    is transformers'."""
    from tests.engine_helpers import run_scored

    folder, hf = gemma
    engine = _engine(folder, max_num_seqs=3, kv_device_gb=0.01)
    shared = _prompt(2, 40)
    prompts = [shared + _prompt(3 + i, 8 + 5 * i) for i in range(3)]
    got, _ = run_scored(engine, prompts, 60)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_generate(hf, p, 60), i
    assert engine.scheduler.prefix_hit_tokens == 2 * 32      # the later two reuse the first's
    store = engine.store
    used, _ = store.tier_usage()["device"]
    assert used < store.num_cached_pages * 4 * 4096         # some cached pages lost layers
    store.refresh_stats()           # the metrics: no page in use, all free or cached only
    assert store.num_used_pages == 0 and store.num_free_pages == store.num_pages

    def hits(prompt, steps):
        before = engine.scheduler.prefix_hit_tokens
        out, _ = run_scored(engine, [prompt], steps)
        assert out["r0"] == hf_generate(hf, prompt, steps)
        return engine.scheduler.prefix_hit_tokens - before

    # the first's 107 tokens are cached; its page 3 (tokens 48-63) lost the windowed layers
    part = prompts[0] + got["r0"][:36]       # 84 tokens: a query at 80 reads from key 61 on
    assert hits(part, 10) == 48              # the prompt's pages; 48-83 computed again
    assert hits(part, 10) == 80              # now cached whole
    turn = prompts[0] + got["r0"] + _prompt(9, 7)
    assert hits(turn, 10) == 96              # every full page of the first request


def test_a_resent_conversation_as_long_as_the_capacity_is_served(tmp_path):
    """Turn 2 resends turn 1's prompt and answer and asks more, up to the capacity exactly:
    the cached pages it starts with keep their windowed layers only while it may read them, so
    its pages fit (a shared page counted as read from position 0 would never let them);
    greedy tokens are transformers'."""
    from scheduler.sampling_params import SamplingParams

    hf = save_tiny_hf("gemma3", dict(GEMMA3, max_position_embeddings=512), tmp_path)
    # 4 layers x 11 whole pages: (P + 24 <= 44 slots with 64-token steps): 20 pages, 320 tokens
    engine = _engine(tmp_path, kv_device_gb=11 * 4 * 4096 / 2**30, max_num_batched_tokens=64)
    assert engine.store.capacity_tokens() == 320

    def run(prompt, steps):
        engine.add_request("r", prompt, SamplingParams(max_tokens=steps, temperature=0.0,
                                                       ignore_eos=True))
        out = []
        for _ in range(4 * steps):          # bounded: a request that never fits would spin
            for o in engine.step():
                assert o.finish_reason != "error", o.error
                out.extend(o.new_token_ids)
            if not engine.has_unfinished():
                break
        assert not engine.has_unfinished() and out == hf_generate(hf, prompt, steps)
        return out

    first = _prompt(11, 64)
    answer = run(first, 176)                               # 240 tokens
    before = engine.scheduler.prefix_hit_tokens
    run(first + answer + _prompt(12, 64), 16)              # 304 + 16 = 320
    assert engine.scheduler.prefix_hit_tokens - before >= 224


def test_drafts_past_the_window_keep_the_pages_they_may_roll_back_to(gemma):
    """N-gram drafts (--speculative-config, every draft) on a repeating prompt past the window:
    a step's rejected drafts roll the request back, so its pages go only up to where its next
    token is sure (a page dropped for a draft's position would be read again); the greedy
    tokens are transformers', some drafts kept and some not."""
    from tests.engine_helpers import run_logprobs

    folder, hf = gemma
    spec = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
            '"prompt_lookup_min": 2, "draft_p_min": 0}')
    engine = _engine(folder, kv_device_gb=0.01, speculative_config=spec, prefix_cache="off")
    prompt = _prompt(21, 12) * 6                    # 72 tokens, a 12-token phrase repeated
    got, _ = run_logprobs(engine, [prompt], 40)
    assert got["r0"] == hf_generate(hf, prompt, 40)
    stats = engine.spec
    assert 0 < stats.accepted_tokens < stats.draft_tokens, stats
    assert engine.store.stats.snapshot().window_dropped > 0
