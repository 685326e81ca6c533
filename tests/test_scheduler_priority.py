"""The scheduler's priority policy (--scheduling-policy priority, vLLM's): the waiting order,
the request preempted when pages run out (even one scheduled earlier in the step), and the
fcfs policy's refusal of a priority."""
import pytest

from scheduler.request import RequestStatus
from scheduler.scheduler import SchedulerConfig
from tests.test_scheduler import FILLER, chunks, make_request, make_scheduler, step


def test_priority_policy_admits_the_lowest_value_first_then_fifo():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, prio in (("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", -1)):
        s.add_request(make_request(2, 1, rid=rid, priority=prio))
    order = []
    while s.has_unfinished():
        batch, _ = step(s)
        order += [r.request_id for r in batch.requests if r.request_id not in order]
    assert order == ["c", "e", "a", "b", "d"]


def test_fcfs_refuses_a_priority_and_an_unknown_policy_is_refused():
    s = make_scheduler()
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        s.add_request(make_request(2, priority=1))
    s.add_request(make_request(2, priority=0))
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


def test_priority_policy_preempts_the_lowest_priority_even_if_already_scheduled():
    s = make_scheduler(num_pages=4, page_size=4, policy="priority")
    low = make_request(2, 8, rid="low", priority=9)
    s.add_request(low)
    step(s)                                 # low runs alone first: the oldest running
    s.add_request(make_request(7, 8, rid="a", priority=0))
    s.add_request(make_request(4, 8, rid="b", priority=1))
    step(s)                                 # pages: low 1, a 2, b 1 -> pool full
    assert [r.request_id for r in s.running] == ["low", "a", "b"]
    assert s.allocator.num_free_pages == 0
    batch, _ = step(s)   # low's decode fits, then b needs a 2nd page: low goes, chunk and all
    assert batch.preempted_ids == ("low",)
    assert chunks(batch) == {"a": 1, "b": 1} and batch.num_tokens == 2
    assert low.status is RequestStatus.WAITING and s.allocator.pages("low") == ()
    assert low.output_token_ids == [FILLER, FILLER]          # the undone step added nothing
    owned = [p for r in s.running for p in s.allocator.pages(r.request_id)]
    assert len(owned) == len(set(owned)) == s.allocator.num_used_pages == 4


def test_fcfs_preempts_the_newest_whatever_its_priority_field():
    s = make_scheduler(num_pages=4, page_size=4)
    s.add_request(make_request(2, 8, rid="old"))
    step(s)
    s.add_request(make_request(7, 8, rid="a"))
    s.add_request(make_request(4, 8, rid="b"))
    step(s)
    batch, _ = step(s)
    assert batch.preempted_ids == ("b",) and chunks(batch) == {"old": 1, "a": 1}
