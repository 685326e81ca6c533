import itertools
import random

import pytest

from kvstore.page_allocator import PageAllocator
from scheduler.batch import ScheduledBatch
from scheduler.errors import QueueFull
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 2
FILLER = 7          # the token fake sampling returns unless told otherwise
_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int = 4, rid: str | None = None, **params) -> Request:
    rid = rid if rid is not None else f"req-{next(_ids)}"
    prompt = [100 + (i % 50) for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def make_scheduler(num_pages: int = 64, page_size: int = 4, **config) -> Scheduler:
    cfg = SchedulerConfig(page_size=page_size, **config)
    return Scheduler(cfg, PageAllocator(num_pages, page_size))


def step(sched: Scheduler, token=FILLER) -> tuple[ScheduledBatch, list[Request]]:
    """schedule -> fake sampling -> update. `token` is an int or a function of the request."""
    batch = sched.schedule()
    sampled = {r.request_id: token(sched.get_request(r.request_id)) if callable(token) else token
               for r in batch.requests if r.sample}
    return batch, sched.update(batch, sampled)


def chunks(batch: ScheduledBatch) -> dict[str, int]:
    return {r.request_id: len(r.token_ids) for r in batch.requests}


def test_chunked_prefill_splits_prompt_under_the_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    req = make_request(20, rid="a")
    s.add_request(req)
    seen = []
    for _ in range(3):
        batch, _ = step(s)
        (r,) = batch.requests
        seen.append((r.start_pos, len(r.token_ids), r.sample))
        assert list(r.token_ids) == req.prompt_token_ids[r.start_pos:r.start_pos + len(r.token_ids)]
        assert len(r.page_ids) * 4 >= r.start_pos + len(r.token_ids)
    assert seen == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.output_token_ids == [FILLER] and req.num_computed_tokens == 20
    batch, _ = step(s)                                   # then a decode of the sampled token
    assert [(r.start_pos, r.token_ids, r.sample) for r in batch.requests] == [(20, (FILLER,), True)]


def test_long_prefill_chunk_caps_each_request():
    s = make_scheduler(max_num_batched_tokens=100, long_prefill_chunk=6)
    s.add_request(make_request(10, rid="a"))
    s.add_request(make_request(3, rid="b"))
    assert chunks(step(s)[0]) == {"a": 6, "b": 3}
    assert chunks(step(s)[0]) == {"a": 4, "b": 1}


def test_decodes_are_scheduled_before_new_prefills():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request(5, max_tokens=10, rid="old"))
    step(s)
    s.add_request(make_request(30, rid="new"))
    batch, _ = step(s)
    assert [r.request_id for r in batch.requests] == ["old", "new"]
    assert chunks(batch) == {"old": 1, "new": 9}
    assert batch.num_tokens == 10


def test_requests_join_and_leave_at_every_step():
    s = make_scheduler(max_num_batched_tokens=64)
    s.add_request(make_request(3, max_tokens=1, rid="a"))
    batch, done = step(s)
    assert chunks(batch) == {"a": 3} and [r.request_id for r in done] == ["a"]
    s.add_request(make_request(2, max_tokens=2, rid="b"))
    s.add_request(make_request(4, max_tokens=3, rid="c"))
    batch, done = step(s)
    assert chunks(batch) == {"b": 2, "c": 4} and done == []
    s.add_request(make_request(1, max_tokens=1, rid="d"))
    batch, done = step(s)
    assert chunks(batch) == {"b": 1, "c": 1, "d": 1}
    assert sorted(r.request_id for r in done) == ["b", "d"]
    batch, done = step(s)
    assert chunks(batch) == {"c": 1} and [r.request_id for r in done] == ["c"]
    assert not s.has_unfinished() and s.allocator.num_used_pages == 0


def test_max_num_seqs_limits_running_requests():
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(4, max_tokens=2, rid=rid))
    batch, _ = step(s)
    assert set(chunks(batch)) == {"a", "b"} and (s.num_running, s.num_waiting) == (2, 1)
    batch, done = step(s)                                 # a and b finish
    assert len(done) == 2 and set(chunks(batch)) == {"a", "b"}
    batch, _ = step(s)
    assert set(chunks(batch)) == {"c"}


def test_queue_limit_raises_queue_full():
    s = make_scheduler(max_waiting=2)
    s.add_request(make_request(4))
    s.add_request(make_request(4))
    with pytest.raises(QueueFull):
        s.add_request(make_request(4))
    step(s)                                               # both admitted: the queue drains
    s.add_request(make_request(4))


def test_request_that_can_never_fit_raises_value_error():
    s = make_scheduler(num_pages=4, page_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="context length"):
        s.add_request(make_request(60, max_tokens=5))
    with pytest.raises(ValueError, match="KV pool holds 16"):
        s.add_request(make_request(10, max_tokens=7))     # 17 tokens > 4 pages of 4
    s.add_request(make_request(10, max_tokens=6))         # exactly 16 tokens fits
    with pytest.raises(ValueError):
        s.add_request(make_request(0))
    assert s.num_waiting == 1


def test_newest_running_request_is_preempted_when_pages_run_out():
    s = make_scheduler(num_pages=4, page_size=4)
    a, b, c = make_request(7, 8, rid="a"), make_request(4, 8, rid="b"), make_request(4, 8, rid="c")
    for r in (a, b, c):
        s.add_request(r)
    step(s)                                               # pages: a 2, b 1, c 1 -> pool full
    assert s.allocator.num_free_pages == 0
    s.add_request(make_request(1, rid="d"))
    batch, _ = step(s)                                    # b needs a 2nd page: c (newest) goes
    assert batch.preempted_ids == ("c",)
    assert chunks(batch) == {"a": 1, "b": 1}              # and no admission in this step
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.waiting[0] is c and c.output_token_ids == [FILLER]
    assert s.allocator.pages("c") == ()


def test_request_preempts_itself_when_it_is_the_newest():
    s = make_scheduler(num_pages=3, page_size=4)
    s.add_request(make_request(4, 8, rid="a"))
    s.add_request(make_request(4, 8, rid="b"))
    step(s)
    batch, _ = step(s)                                    # a takes the last page; b has none
    assert chunks(batch) == {"a": 1} and batch.preempted_ids == ("b",)


def test_preempted_request_recomputes_prompt_and_outputs_then_resumes_sampling():
    s = make_scheduler(num_pages=3, page_size=4)
    a, b = make_request(4, 5, rid="a"), make_request(4, 3, rid="b")
    s.add_request(a)
    s.add_request(b)
    tok = lambda r: 10 + len(r.output_token_ids)          # noqa: E731
    step(s, tok)
    step(s, tok)                                          # b preempted with output [10]
    assert b.output_token_ids == [10]
    while a.status is RequestStatus.RUNNING:
        _, done = step(s, tok)
    batch, _ = step(s, tok)
    (r,) = batch.requests
    assert r.request_id == "b" and r.start_pos == 0 and r.sample
    assert list(r.token_ids) == b.prompt_token_ids + [10]
    while s.has_unfinished():
        step(s, tok)
    assert b.output_token_ids == [10, 11, 12] and b.status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(5))
def test_every_request_that_fits_alone_completes_under_tight_pages(seed, policy):
    rng = random.Random(seed)
    page_size, num_pages, budget = 4, 12, 16
    s = make_scheduler(num_pages=num_pages, page_size=page_size, max_num_batched_tokens=budget,
                       max_num_seqs=6, max_waiting=1000, long_prefill_chunk=rng.choice([0, 5]),
                       policy=policy)
    reqs = []
    pending = [make_request(rng.randint(1, 30), rng.randint(1, 15),
                            priority=rng.randint(-2, 2) if policy == "priority" else 0)
               for _ in range(40)]
    pending = [r for r in pending
               if s.allocator.pages_for_tokens(r.num_tokens + r.sampling_params.max_tokens) <= num_pages]
    steps = 0
    while pending or s.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                reqs.append(pending.pop())
                s.add_request(reqs[-1])
        batch = s.schedule()
        assert 0 < batch.num_tokens <= budget or not s.has_unfinished() or batch.preempted_ids
        assert s.num_running <= 6
        for r in batch.requests:
            req = s.get_request(r.request_id)
            assert len(r.token_ids) > 0 and r.start_pos == req.num_computed_tokens
            assert list(r.token_ids) == req.all_token_ids[r.start_pos:r.start_pos + len(r.token_ids)]
            assert len(r.page_ids) * page_size >= r.start_pos + len(r.token_ids)
        owned = [p for req in s.running for p in s.allocator.pages(req.request_id)]
        assert len(owned) == len(set(owned)) == s.allocator.num_used_pages
        s.update(batch, {r.request_id: FILLER for r in batch.requests if r.sample})
        steps += 1
        assert steps < 5000, "livelock"
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in reqs)
    assert s.allocator.num_free_pages == num_pages
    assert sum(r.num_preemptions for r in reqs) > 0        # the pool really was tight


def test_stop_token_finishes_and_is_kept():
    s = make_scheduler()
    req = make_request(3, max_tokens=10, stop_token_ids=(42,))
    s.add_request(req)
    step(s)
    _, done = step(s, 42)
    assert done == [req] and req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [FILLER, 42] and s.allocator.num_used_pages == 0


def test_eos_stops_unless_ignore_eos():
    s = make_scheduler()
    a = make_request(3, max_tokens=3, rid="a")
    b = make_request(3, max_tokens=3, rid="b", ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    _, done = step(s, EOS)
    assert done == [a] and a.status is RequestStatus.FINISHED_STOPPED
    step(s, EOS)
    _, done = step(s, EOS)
    assert done == [b] and b.status is RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [EOS] * 3


def test_eos_before_min_tokens_does_not_stop():
    s = make_scheduler()
    req = make_request(3, max_tokens=10, min_tokens=3, stop_token_ids=(42,))
    s.add_request(req)
    step(s, EOS)
    step(s, 42)
    _, done = step(s, EOS)                                # third output token: min_tokens reached
    assert done == [req] and req.status is RequestStatus.FINISHED_STOPPED
    assert len(req.output_token_ids) == 3


def test_max_tokens_and_max_model_len_finish_with_length():
    s = make_scheduler(max_model_len=6)
    a = make_request(2, max_tokens=2, rid="a")
    b = make_request(3, max_tokens=3, rid="b")
    s.add_request(a)
    s.add_request(b)
    step(s)
    _, done = step(s)
    assert done == [a] and a.status is RequestStatus.FINISHED_LENGTH
    _, done = step(s)
    assert done == [b] and b.num_tokens == 6 and b.status is RequestStatus.FINISHED_LENGTH


def test_abort_frees_pages_of_waiting_and_running_requests():
    s = make_scheduler(num_pages=8, max_num_seqs=1)
    run, wait = make_request(9, rid="run"), make_request(5, rid="wait")
    s.add_request(run)
    s.add_request(wait)
    step(s)
    assert s.allocator.num_used_pages == 3 and s.num_waiting == 1
    assert s.abort("wait") is wait and wait.status is RequestStatus.FINISHED_ABORTED
    assert s.abort("wait") is None                       # idempotent
    assert s.abort("run") is run and run.status is RequestStatus.FINISHED_ABORTED
    assert s.allocator.num_used_pages == 0 and not s.has_unfinished()
    assert s.get_request("run") is None


def test_abort_between_schedule_and_update_is_skipped():
    s = make_scheduler()
    a, b = make_request(4, rid="a"), make_request(4, rid="b")
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    s.abort("a")
    done = s.update(batch, {"a": FILLER, "b": FILLER})
    assert done == [] and a.output_token_ids == [] and b.output_token_ids == [FILLER]
    assert s.allocator.pages("a") == ()


def test_finish_with_error_sets_error_status():
    s = make_scheduler()
    s.add_request(make_request(4, rid="a"))
    step(s)
    req = s.finish_with_error("a", "boom")
    assert req.status is RequestStatus.FINISHED_ERROR and s.allocator.num_used_pages == 0
    assert s.finish_with_error("a", "boom") is None


def test_first_scheduled_time_is_recorded_once():
    s = make_scheduler(max_num_batched_tokens=4)
    req = make_request(10)
    s.add_request(req)
    step(s)
    t = req.first_scheduled_time
    assert t is not None and t >= req.arrival_time
    step(s)
    assert req.first_scheduled_time == t


def test_admission_never_takes_pages_it_would_need_to_preempt_for():
    s = make_scheduler(num_pages=4, page_size=4)
    s.add_request(make_request(11, 4, rid="a"))            # 3 pages, still 3 after a decode
    step(s)
    s.add_request(make_request(8, 4, rid="big"))           # first chunk needs 2 pages, 1 free
    s.add_request(make_request(1, 4, rid="small"))         # fits, but must not overtake (FIFO)
    batch, _ = step(s)
    assert chunks(batch) == {"a": 1} and batch.preempted_ids == ()
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    assert s.allocator.num_free_pages == 1


def test_a_burst_from_one_client_does_not_starve_another():
    # fair share: the next request admitted is the oldest of the client with the fewest running
    sched = make_scheduler(max_num_seqs=2)
    burst = [make_request(4, max_tokens=2, client="a") for _ in range(6)]
    for r in burst:
        sched.add_request(r)
    late = make_request(4, max_tokens=2, client="b")
    sched.add_request(late)
    batch, _ = step(sched)
    # one slot each: "a"'s oldest, then "b" (1 running for "a", 0 for "b")
    assert set(chunks(batch)) == {burst[0].request_id, late.request_id}
    order = []
    while sched.has_unfinished():
        batch, finished = step(sched)
        order += [r.request_id for r in finished]
    assert order.index(late.request_id) <= 1
    assert [r for r in order if r != late.request_id] == [r.request_id for r in burst]


def test_each_client_has_its_own_share_of_the_waiting_queue():
    sched = make_scheduler(max_num_seqs=1, max_waiting=2, max_waiting_total=5)
    for _ in range(2):
        sched.add_request(make_request(4, client="a"))
    with pytest.raises(QueueFull, match="of this client"):
        sched.add_request(make_request(4, client="a"))
    for c in ("b", "b", ""):
        sched.add_request(make_request(4, client=c))      # others still get in
    with pytest.raises(QueueFull, match="5 requests are already waiting"):
        sched.add_request(make_request(4, client="c"))
    assert (sched.num_waiting, sched.num_waiting_of("a"), sched.num_waiting_of("b")) == (5, 2, 2)
    while sched.has_unfinished():
        step(sched)
    assert sched.num_waiting == 0 and sched.num_waiting_of("a") == 0


def test_with_one_client_admission_stays_fifo_across_preemption():
    sched = make_scheduler(num_pages=6, page_size=4, max_num_seqs=3)
    reqs = [make_request(8, max_tokens=6) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    finished = []
    while sched.has_unfinished():
        finished += [r.request_id for r in step(sched)[1]]
    assert finished == [r.request_id for r in reqs]

