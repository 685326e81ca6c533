"""BackgroundRuns without a model: followers from any point see every later event once, in
order, while the run goes on; a cancelled run ends; ended runs beyond the kept number go."""
from __future__ import annotations

import asyncio

from server.background_runs import BackgroundRuns


def _event(n: int) -> dict:
    return {"type": "e", "sequence_number": n}


def test_followers_from_any_point_see_each_later_event_once():
    async def main():
        runs = BackgroundRuns()
        step = asyncio.Event()

        async def work(run):
            for n in range(6):
                run.add(_event(n))
                if n == 2:
                    await step.wait()           # the followers join while it is going
        run = runs.start("r", lambda: {"id": "r"}, work)
        await asyncio.sleep(0)
        seen = {}

        async def follow(name, after):
            seen[name] = [e["sequence_number"] async for e in run.follow(after)]
        followers = [asyncio.ensure_future(follow(n, a))
                     for n, a in (("all", None), ("late", 1), ("past", 9))]
        await asyncio.sleep(0.01)
        step.set()
        await asyncio.gather(*followers)
        assert seen == {"all": [0, 1, 2, 3, 4, 5], "late": [2, 3, 4, 5], "past": []}
        assert run.ended and runs.running() == 0
        assert [e["sequence_number"] async for e in run.follow(3)] == [4, 5]   # after its end
    asyncio.run(main())


def test_cancel_ends_a_run_and_its_followers():
    async def main():
        runs = BackgroundRuns()
        stopped = []

        async def work(run):
            run.add(_event(0))
            try:
                await asyncio.sleep(60)
            finally:
                stopped.append(True)
        run = runs.start("r", dict, work)
        follower = asyncio.ensure_future(_all(run))
        await asyncio.sleep(0.01)
        assert runs.running() == 1
        assert await runs.cancel("r") and stopped == [True] and run.ended
        assert await asyncio.wait_for(follower, 1) == [0]
        assert await runs.cancel("r")                 # again: nothing left to stop
        assert not await runs.cancel("nope")
    asyncio.run(main())


def test_only_the_last_ended_runs_are_kept():
    async def main():
        runs = BackgroundRuns(keep_ended=2)

        async def work(run):
            run.add(_event(0))
        for i in range(4):
            await runs.start(f"r{i}", dict, work).task
        assert [runs.get(f"r{i}") is not None for i in range(4)] == [False, False, True, True]
    asyncio.run(main())


async def _all(run) -> list[int]:
    return [e["sequence_number"] async for e in run.follow()]
