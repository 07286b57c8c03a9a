"""ChargedWork (teacher_server/joining.py): CPU work charged to a job, run in threads.

Real threads and a real event loop; the work is a function that waits on events the test
sets, so what runs when is the test's to say.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from teacher_server.joining import ChargedWork

WAIT_S = 10.0


def _piece(started: list, name: str, release: threading.Event):
    def work() -> str:
        started.append(name)
        assert release.wait(WAIT_S), f"{name} was never released"
        return name
    return work


async def _until(predicate, what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_one_jobs_pieces_run_one_at_a_time_and_another_jobs_do_not_wait_behind_them():
    async def scenario():
        work = ChargedWork(workers=4)
        started: list[str] = []
        releases = {name: threading.Event() for name in ("a1", "a2", "a3", "b1")}
        try:
            a = [asyncio.create_task(work.run("a", _piece(started, name, releases[name])))
                 for name in ("a1", "a2", "a3")]
            await _until(lambda: started == ["a1"], "the attacker's first piece")
            b = asyncio.create_task(work.run("b", _piece(started, "b1", releases["b1"])))
            await _until(lambda: "b1" in started, "the other job's piece, while job a's first runs")
            assert started == ["a1", "b1"] and work.waiting("a") == 3
            releases["b1"].set()
            assert await asyncio.wait_for(b, WAIT_S) == "b1"
            for name in ("a1", "a2", "a3"):
                releases[name].set()
            assert await asyncio.wait_for(asyncio.gather(*a), WAIT_S) == ["a1", "a2", "a3"]
            assert started == ["a1", "b1", "a2", "a3"]  # in the order they came
            assert work.waiting("a") == work.waiting("b") == 0
        finally:
            for release in releases.values():
                release.set()
            work.close()

    asyncio.run(scenario())


def test_a_cancelled_pieces_job_keeps_its_turn_until_the_piece_ends():
    async def scenario():
        work = ChargedWork(workers=4)
        started: list[str] = []
        releases = {name: threading.Event() for name in ("first", "second")}
        try:
            first = asyncio.create_task(work.run("a", _piece(started, "first", releases["first"])))
            await _until(lambda: started == ["first"], "the first piece")
            first.cancel()
            second = asyncio.create_task(work.run("a", _piece(started, "second", releases["second"])))
            await asyncio.sleep(0.3)
            assert started == ["first"], "a cancelled call's piece still runs: the job's next must wait for it"
            releases["first"].set()
            await _until(lambda: "second" in started, "the second piece, once the first ended")
            releases["second"].set()
            assert await asyncio.wait_for(second, WAIT_S) == "second"
            with pytest.raises(asyncio.CancelledError):
                await first
        finally:
            for release in releases.values():
                release.set()
            work.close()

    asyncio.run(scenario())


def test_an_error_of_a_piece_reaches_its_caller_and_frees_the_jobs_turn():
    async def scenario():
        work = ChargedWork(workers=1)

        def fails() -> None:
            raise ValueError("the piece's own error")

        try:
            with pytest.raises(ValueError, match="the piece's own error"):
                await work.run("a", fails)
            assert await asyncio.wait_for(work.run("a", lambda: 7), WAIT_S) == 7
            assert work.waiting("a") == 0
        finally:
            work.close()

    asyncio.run(scenario())
