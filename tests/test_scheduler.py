"""The scheduler alone: fair share by weight, admission, bounds, shared work.

No server, no threads, no torch: sessions and batches are small stand-ins with the
fields the scheduler reads, and a simulated forward is one `plan()` whose sends
complete before the next (`sent()` at once) unless a test holds them.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass

import pytest

from teacher_server.errors import InvalidArgument, ResourceExhausted
from teacher_server.scheduler import Scheduler

ROWS, SEQ = 1, 64  # the default batch: 64 tokens
TOLERANCE = 0.02

_keys = itertools.count()


@dataclass
class FakeSession:
    session_id: str
    job_id: str
    weight: float = 1.0
    max_inflight: int = 4


@dataclass
class FakeBatch:
    key: bytes
    rows: int = ROWS
    seq_len: int = SEQ
    output_bytes: int = 0
    alone: bool = False

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


def batch(rows: int = ROWS, seq_len: int = SEQ, key: bytes | None = None) -> FakeBatch:
    """A batch of its own content unless `key` says it is identical to another."""
    return FakeBatch(key if key is not None else f"batch-{next(_keys)}".encode(), rows, seq_len)


def joined(scheduler: Scheduler, *sessions: FakeSession) -> list[FakeSession]:
    for session in sessions:
        scheduler.admit(session)
        scheduler.ready(session)
    return list(sessions)


def fill(scheduler: Scheduler, sessions: list[FakeSession]) -> None:
    for session in sessions:
        while scheduler.queued(session) < session.max_inflight:
            scheduler.submit(session, batch())


def forwards(scheduler: Scheduler, sessions: list[FakeSession], count: int) -> list[list]:
    """`count` forwards while `sessions` keep their queues full: each submits its next
    batches while the last ones are being sent (so it is never idle), and the sends
    complete before the next forward."""
    plans = []
    for _ in range(count):
        fill(scheduler, sessions)
        plan = scheduler.plan()
        fill(scheduler, sessions)
        for planned in plan:
            scheduler.sent(planned.session)
        plans.append(plan)
    return plans


def tokens_by(plans: list[list], key) -> dict[str, int]:
    tokens: dict[str, int] = defaultdict(int)
    for plan in plans:
        for planned in plan:
            tokens[key(planned.session)] += planned.batch.tokens
    return tokens


def by_job(plans):
    return tokens_by(plans, lambda s: s.job_id)


def test_the_scheduler_imports_without_torch():
    code = "import sys, teacher_server.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "teacher_server.scheduler imports torch"


# ---- fair share ------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0), (3.0, 1.0)])
def test_jobs_share_by_weight(weights):
    scheduler = Scheduler(max_batch_tokens=4 * ROWS * SEQ, max_sessions=8)
    sessions = joined(scheduler, *(FakeSession(f"s{i}", f"job-{i}", weight) for i, weight in enumerate(weights)))
    tokens = by_job(forwards(scheduler, sessions, 1000))
    ratio = tokens["job-1"] / tokens["job-0"]
    expected = weights[1] / weights[0]
    assert abs(ratio - expected) / expected < TOLERANCE, (dict(tokens), expected)


def test_a_job_of_two_ranks_gets_the_share_of_its_weight_split_between_its_ranks():
    scheduler = Scheduler(max_batch_tokens=4 * ROWS * SEQ, max_sessions=8)
    sessions = joined(scheduler, FakeSession("a", "job-a"), FakeSession("b0", "job-b"), FakeSession("b1", "job-b"),
                      FakeSession("c", "job-c", weight=2.0))
    plans = forwards(scheduler, sessions, 1000)
    jobs, ranks = by_job(plans), tokens_by(plans, lambda s: s.session_id)
    for job, share in (("job-b", 1.0), ("job-c", 2.0)):
        assert abs(jobs[job] / jobs["job-a"] - share) / share < TOLERANCE, dict(jobs)
    assert abs(ranks["b1"] / ranks["b0"] - 1) < TOLERANCE, dict(ranks)


@pytest.mark.parametrize("others_idle", [False, True], ids=["others-busy", "others-idle"])
def test_a_job_joining_late_gets_its_share_from_then_on_not_a_burst(others_idle):
    scheduler = Scheduler(max_batch_tokens=4 * ROWS * SEQ, max_sessions=8)
    early = joined(scheduler, FakeSession("a", "job-a"))
    forwards(scheduler, early, 500)
    if others_idle:  # job-a's queue runs dry before job-b joins: no busy job to start level with
        forwards(scheduler, [], 1)
    sessions = joined(scheduler, FakeSession("b", "job-b")) + early  # job-b submits first
    plans = forwards(scheduler, sessions, 500)
    # From its first forward on, the newcomer is never more than one batch ahead...
    seen: dict[str, int] = defaultdict(int)
    for plan in plans:
        for job, tokens in by_job([plan]).items():
            seen[job] += tokens
        assert seen["job-b"] <= seen["job-a"] + ROWS * SEQ, dict(seen)
    # ...and gets its fair share over the whole time.
    assert abs(seen["job-b"] / seen["job-a"] - 1) < TOLERANCE, dict(seen)


def test_a_job_idle_for_a_while_comes_back_at_the_busy_jobs_clock():
    scheduler = Scheduler(max_batch_tokens=4 * ROWS * SEQ, max_sessions=8)
    a, b = joined(scheduler, FakeSession("a", "job-a"), FakeSession("b", "job-b"))
    forwards(scheduler, [a, b], 100)
    forwards(scheduler, [a], 500)  # b submits nothing: its queue empties, it is idle
    seen: dict[str, int] = defaultdict(int)
    for plan in forwards(scheduler, [a, b], 100):
        for job, tokens in by_job([plan]).items():
            seen[job] += tokens
        assert seen["job-b"] <= seen["job-a"] + ROWS * SEQ, dict(seen)


def test_a_job_still_busy_keeps_its_clock_when_it_submits_again():
    # One batch per forward. job-a's first batch stays unsent while job-b gets ten
    # forwards: job-a was busy all along, behind rather than idle, so it gets the next ones
    # until it is level. (job-b, waking while job-a's first batch was served, started where
    # that batch started: job-a is nine behind, and at the tie job-b, served longest ago, goes.)
    scheduler = Scheduler(max_batch_tokens=ROWS * SEQ, max_sessions=8)
    b, a = joined(scheduler, FakeSession("b", "job-b"), FakeSession("a", "job-a", max_inflight=1))
    scheduler.submit(a, batch())
    [planned] = scheduler.plan()
    assert planned.session is a
    forwards(scheduler, [b], 10)
    scheduler.submit(a, batch())  # while its first batch is still being sent
    scheduler.sent(a)
    plans = forwards(scheduler, [a, b], 10)
    assert [[p.session.session_id for p in plan] for plan in plans] == [["a"]] * 9 + [["b"]]


# ---- no starvation ---------------------------------------------------------------------


def longest_wait(plans: list[list], session: FakeSession) -> int:
    """The most forwards in a row, from the first, that did not plan `session`."""
    longest = waiting = 0
    for plan in plans:
        waiting = 0 if any(p.session is session for p in plan) else waiting + 1
        longest = max(longest, waiting)
    return longest


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 100.0), (100.0, 1.0)])
def test_every_session_with_work_is_planned_within_a_bounded_number_of_forwards(weights):
    batches_per_forward = 4
    scheduler = Scheduler(max_batch_tokens=batches_per_forward * ROWS * SEQ, max_sessions=8)
    sessions = joined(scheduler, FakeSession("low-0", "job-0", weights[0]), FakeSession("low-1", "job-0", weights[0]),
                      FakeSession("high", "job-1", weights[1]))
    plans = forwards(scheduler, sessions, 2000)
    # A rank of a job whose share is w of W (weights) and who has R ranks gets a batch
    # every (W / w) * R batches; one forward more for rounding.
    total = sum(weights)
    bounds = {"low-0": total / weights[0] * 2, "low-1": total / weights[0] * 2, "high": total / weights[1]}
    for session in sessions:
        assert longest_wait(plans, session) <= bounds[session.session_id] / batches_per_forward + 1, session


def test_a_batch_larger_than_the_budget_runs_alone_and_is_not_starved_by_small_ones():
    scheduler = Scheduler(max_batch_tokens=4 * ROWS * SEQ, max_sessions=8)
    small, large = joined(scheduler, FakeSession("small", "job-small"), FakeSession("large", "job-large"))
    for _ in range(4):
        scheduler.submit(large, batch(rows=2, seq_len=5 * SEQ))
    plans = forwards(scheduler, [small], 40)
    with_large = [plan for plan in plans if any(p.session is large for p in plan)]
    assert len(with_large) == 4
    assert all(len(plan) == 1 for plan in with_large), "a batch over the budget shares its forward"


def test_a_job_that_sends_one_batch_at_a_time_waits_for_the_batch_being_served_not_another_turn():
    # A busy job of one-batch forwards (the HTTP API's chunks), and a job that submits one batch
    # now and then (a student between its steps): its batch goes next, and over a long run the
    # shares stay fair (it asks for less than its share, so it gets all it asks).
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8)
    api, student = joined(scheduler, FakeSession("api", "job-api", max_inflight=2), FakeSession("s", "job-s"))
    waits = []
    for step in range(200):
        while scheduler.queued(api) < 2:
            scheduler.submit(api, FakeBatch(f"api-{next(_keys)}".encode(), 1, 2 * SEQ, alone=True))
        if step % 3 == 0:
            scheduler.submit(student, batch(rows=4, seq_len=SEQ))
            submitted = step
        plan = scheduler.plan()
        if any(p.session is student for p in plan):
            waits.append(step - submitted)
        for planned in plan:
            scheduler.sent(planned.session)
    assert len(waits) > 60 and max(waits[1:]) == 0, waits  # planned in the next forward (the first: level)


def test_batches_marked_alone_share_no_forward_and_alternate_with_other_jobs_by_share():
    # The HTTP API's batches: a forward each (identical ones still share it); a student's job
    # with a batch waiting gets the next forward whenever its clock is behind.
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8)
    api, student = joined(scheduler, FakeSession("api", "job-api", max_inflight=8), FakeSession("s", "job-s"))
    for _ in range(8):
        scheduler.submit(api, FakeBatch(f"api-{next(_keys)}".encode(), 1, 4 * SEQ, alone=True))
    scheduler.submit(api, FakeBatch(b"twin", 1, 4 * SEQ, alone=True))
    scheduler.submit(api, FakeBatch(b"twin", 1, 4 * SEQ, alone=True))
    plans = forwards(scheduler, [student], 20)
    for plan in plans:
        computed = [p for p in plan if p.computed]
        if any(p.batch.alone for p in computed):
            assert len(computed) == 1, "an alone batch shared its forward"
    twins = [plan for plan in plans if any(p.batch.key == b"twin" for p in plan)]
    assert len(twins) == 1 and len(twins[0]) == 2, "identical alone batches did not share their forward"
    # 4 x SEQ tokens a forward for each job (the student's 4 batches packed): they take turns.
    order = ["api" if any(p.session is api for p in plan) else "s" for plan in plans[:16]]
    assert order == ["api", "s"] * 8, order


# ---- bounds ---------------------------------------------------------------------------


def test_a_session_has_at_most_max_inflight_batches_planned_or_sending():
    scheduler = Scheduler(max_batch_tokens=100 * ROWS * SEQ, max_sessions=8)
    [session] = joined(scheduler, FakeSession("s", "job", max_inflight=2))
    for _ in range(5):
        scheduler.submit(session, batch())
    assert len(scheduler.plan()) == 2
    assert scheduler.plan() == [], "planned while its sends were still in flight"
    scheduler.sent(session)
    assert len(scheduler.plan()) == 1
    assert scheduler.queued(session) == 2


def test_a_forward_holds_batches_up_to_the_token_budget_padding_included():
    scheduler = Scheduler(max_batch_tokens=500, max_sessions=8)
    a, b = joined(scheduler, FakeSession("a", "job-a", max_inflight=8), FakeSession("b", "job-b"))
    for _ in range(5):
        scheduler.submit(a, batch(rows=2, seq_len=100))  # 200 tokens each
    assert [p.batch.tokens for p in scheduler.plan()] == [200, 200]
    assert len(scheduler.plan()) == 2
    assert len(scheduler.plan()) == 1
    # 1 x 100 and 1 x 300 are 400 tokens, but packed they pad to 2 x 300 = 600.
    scheduler.submit(a, batch(rows=1, seq_len=100))
    scheduler.submit(b, batch(rows=1, seq_len=300))
    assert len(scheduler.plan()) == 1
    assert len(scheduler.plan()) == 1


def test_only_sessions_whose_group_formed_are_planned():
    scheduler = Scheduler(max_batch_tokens=4 * ROWS * SEQ, max_sessions=8)
    session = FakeSession("s", "job")
    scheduler.admit(session)
    scheduler.submit(session, batch())
    assert scheduler.plan() == []
    scheduler.ready(session)
    assert len(scheduler.plan()) == 1


def test_admission_stops_at_max_sessions():
    scheduler = Scheduler(max_batch_tokens=ROWS * SEQ, max_sessions=2)
    first, _ = joined(scheduler, FakeSession("a", "job-a"), FakeSession("b", "job-b"))
    with pytest.raises(ResourceExhausted, match="already serves 2 sessions"):
        scheduler.admit(FakeSession("c", "job-c"))
    scheduler.remove(first)
    scheduler.admit(FakeSession("c", "job-c"))


def test_every_rank_of_a_job_gives_the_same_weight():
    scheduler = Scheduler(max_batch_tokens=ROWS * SEQ, max_sessions=8)
    scheduler.admit(FakeSession("r0", "job", weight=2.0))
    with pytest.raises(InvalidArgument, match="already has weight 2.*same weight"):
        scheduler.admit(FakeSession("r1", "job", weight=1.0))
    scheduler.admit(FakeSession("r1", "job", weight=2.0))


# ---- shared work -----------------------------------------------------------------------


def test_identical_batches_in_one_forward_share_rows_outside_the_budget():
    scheduler = Scheduler(max_batch_tokens=2 * ROWS * SEQ, max_sessions=8)
    a, b, c = joined(scheduler, FakeSession("a", "job-a"), FakeSession("b", "job-b"), FakeSession("c", "job-c"))
    scheduler.submit(a, batch(key=b"same"))
    scheduler.submit(b, batch(key=b"same"))
    scheduler.submit(c, batch())
    plan = {p.session.session_id: p for p in scheduler.plan()}
    assert set(plan) == {"a", "b", "c"}, "the shared batch took room in the budget"
    assert plan["a"].computed and not plan["b"].computed
    assert plan["b"].row == plan["a"].row and plan["b"].cached is None
    assert plan["c"].computed and plan["c"].row == ROWS


def test_cache_hits_need_no_rows():
    scheduler = Scheduler(max_batch_tokens=ROWS * SEQ, max_sessions=8)
    a, b = joined(scheduler, FakeSession("a", "job-a"), FakeSession("b", "job-b"))
    scheduler.submit(a, batch(key=b"cached"))
    scheduler.submit(b, batch())
    asked = []

    def lookup(session, batch):
        asked.append(session.session_id)
        return "outputs" if batch.key == b"cached" else None

    plan = {p.session.session_id: p for p in scheduler.plan(lookup)}
    assert set(plan) == {"a", "b"}, "the cache hit took room in the budget"
    assert not plan["a"].computed and plan["a"].cached == "outputs"
    assert plan["b"].computed and plan["b"].row == 0
    assert sorted(asked) == ["a", "b"]


# ---- outputs held for students (held_bytes_limit) --------------------------------------------

MIB = 1 << 20


def sized(output_bytes: int) -> FakeBatch:
    return FakeBatch(f"batch-{next(_keys)}".encode(), ROWS, SEQ, output_bytes)


def test_a_session_that_does_not_receive_stops_at_its_share_and_the_others_go_on():
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8, held_bytes_limit=40 * MIB)
    slow, honest = joined(scheduler, FakeSession("slow", "job-slow", max_inflight=8),
                          FakeSession("honest", "job-honest", max_inflight=8))
    for _ in range(8):
        scheduler.submit(slow, sized(4 * MIB))
    planned = [p.session.session_id for p in scheduler.plan()]
    # Its share: half of 40 MiB by equal weights, five batches of 4 MiB.
    assert planned.count("slow") == 5 and scheduler.held_bytes() == 20 * MIB
    assert scheduler.plan() == [] and scheduler.queued(slow) == 3, "planned past its share"
    # The honest session receives what it is sent and is served all along.
    served = 0
    for _ in range(20):
        scheduler.submit(honest, sized(4 * MIB))
        plan = scheduler.plan()
        assert [p.session.session_id for p in plan] == ["honest"]
        scheduler.sent(honest, plan[0].batch)
        served += 1
    assert served == 20 and scheduler.held_bytes() == 20 * MIB
    # Once the slow student receives, it is planned again, one batch per batch received.
    scheduler.sent(slow)
    assert [p.session.session_id for p in scheduler.plan()] == ["slow"]
    assert scheduler.held_bytes() == 20 * MIB


def test_shares_follow_the_jobs_weights_and_split_among_a_jobs_sessions():
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8, held_bytes_limit=60 * MIB)
    heavy = joined(scheduler, FakeSession("h0", "heavy", weight=2.0, max_inflight=64),
                   FakeSession("h1", "heavy", weight=2.0, max_inflight=64))
    light = joined(scheduler, FakeSession("l0", "light", weight=1.0, max_inflight=64))[0]
    for session in (*heavy, light):
        for _ in range(40):
            scheduler.submit(session, sized(1 * MIB))
    while scheduler.plan():
        pass
    counts = {s.session_id: 40 - scheduler.queued(s) for s in (*heavy, light)}
    # heavy: 2/3 of 60 MiB, 20 MiB per rank; light: 1/3, 20 MiB.
    assert counts == {"h0": 20, "h1": 20, "l0": 20}, counts
    assert scheduler.held_bytes() == 60 * MIB


def test_a_batch_larger_than_a_share_is_served_from_the_pool_while_it_has_room_else_from_its_jobs_floor():
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8, held_bytes_limit=10 * MIB)
    a, b = joined(scheduler, FakeSession("a", "job-a", max_inflight=8), FakeSession("b", "job-b", max_inflight=8))
    scheduler.submit(a, sized(12 * MIB))  # more than the whole limit
    scheduler.submit(b, sized(3 * MIB))
    scheduler.submit(b, sized(3 * MIB))
    first = [p.session.session_id for p in scheduler.plan()]
    # a's batch fits no pool: its job's floor. b's first is within its 5 MiB share, its second is not.
    assert sorted(first) == ["a", "b"] and scheduler.held_bytes() == 15 * MIB and scheduler.pool_bytes() == 3 * MIB
    assert scheduler.plan() == []
    scheduler.submit(a, sized(4 * MIB))
    assert scheduler.plan() == [], "a second batch for a job that holds its floor batch, over its share"
    scheduler.sent(b)
    scheduler.sent(a)
    assert sorted(p.session.session_id for p in scheduler.plan()) == ["a", "b"]
    assert scheduler.pool_bytes() == scheduler.held_bytes() == 7 * MIB
    # A session holding nothing takes one batch past its share from the pool while the pool has room.
    scheduler.sent(a)
    scheduler.submit(a, sized(6 * MIB))
    assert [p.session.session_id for p in scheduler.plan()] == ["a"] and scheduler.pool_bytes() == 9 * MIB
    scheduler.submit(b, sized(3 * MIB))
    assert scheduler.plan() == [], "b holds 3 MiB of its 5 MiB share: 3 more is over it"


def test_a_heavy_job_that_never_receives_leaves_a_light_job_a_batch_per_round_trip():
    """Weights 100 and 1: the light job's share (1/101 of the limit) is smaller than one of its
    batches, and the heavy job's outputs leave the pool less room than one: the light job is
    still planned a batch whenever its student has received the last one."""
    batch_bytes = 3 * MIB
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8, held_bytes_limit=10 * MIB)
    heavy = joined(scheduler, FakeSession("h0", "heavy", weight=100.0, max_inflight=8),
                   FakeSession("h1", "heavy", weight=100.0, max_inflight=8))
    light = joined(scheduler, FakeSession("l0", "light", max_inflight=4), FakeSession("l1", "light", max_inflight=4))
    assert scheduler.held_share(light[0]) < batch_bytes
    for session in heavy:
        for _ in range(8):
            scheduler.submit(session, sized(1 * MIB))
    scheduler.plan()
    # Its share, 4.95 MiB per session: four batches each, 8 MiB of the pool's 10.
    assert scheduler.pool_bytes() == 8 * MIB and all(scheduler.queued(s) == 4 for s in heavy)
    served: dict[str, int] = defaultdict(int)
    for _ in range(40):
        for session in light:
            while scheduler.queued(session) < 4:
                scheduler.submit(session, sized(batch_bytes))
        plan = scheduler.plan()
        # One batch of the job (its floor), whichever rank's turn it is; none while it is held.
        assert [p.session.job_id for p in plan] == ["light"], plan
        assert scheduler.plan() == []
        assert scheduler.held_bytes() == 8 * MIB + batch_bytes <= 10 * MIB + 2 * batch_bytes
        scheduler.sent(plan[0].session, plan[0].batch)
        served[plan[0].session.session_id] += 1
    assert served == {"l0": 20, "l1": 20}, dict(served)
    assert all(scheduler.queued(s) == 4 for s in heavy), "the heavy job was planned past its share"


def test_a_job_that_joins_when_the_pool_is_full_gets_its_floor_and_the_pool_stays_within_the_limit():
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8, held_bytes_limit=10 * MIB)
    (early,) = joined(scheduler, FakeSession("early", "job-early", max_inflight=16))
    for _ in range(12):
        scheduler.submit(early, sized(1 * MIB))
    scheduler.plan()
    assert scheduler.pool_bytes() == 10 * MIB
    (late,) = joined(scheduler, FakeSession("late", "job-late", max_inflight=16))
    for _ in range(8):
        scheduler.submit(late, sized(1 * MIB))
    # early now holds twice its 5 MiB share, late nothing: late's share is no room in a full pool.
    assert [p.session.session_id for p in scheduler.plan()] == ["late"]
    assert scheduler.pool_bytes() == 10 * MIB and scheduler.held_bytes() == 11 * MIB
    for _ in range(6):
        scheduler.sent(early)
    # 6 MiB freed: each takes up to its 5 MiB share (late's floor batch counted in its).
    assert sorted(p.session.session_id for p in scheduler.plan()) == ["early"] + ["late"] * 4
    assert scheduler.pool_bytes() == 9 * MIB and scheduler.held_bytes() == 10 * MIB


def test_outputs_of_an_ended_session_stay_held_until_released_and_its_job_joining_again_waits_for_them():
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8, held_bytes_limit=10 * MIB)
    (first,) = joined(scheduler, FakeSession("first", "job-a", max_inflight=16))
    for _ in range(10):
        scheduler.submit(first, sized(1 * MIB))
    batches = [p.batch for p in scheduler.plan()]
    scheduler.remove(first)  # its sends still in progress: their tensors are still held
    assert scheduler.held_bytes() == scheduler.pool_bytes() == 10 * MIB
    again, other = joined(scheduler, FakeSession("again", "job-a", max_inflight=16),
                          FakeSession("other", "job-b", max_inflight=16))
    for session in (again, other):
        for _ in range(8):
            scheduler.submit(session, sized(1 * MIB))
    # job-a still holds 10 MiB: no room in the pool, no floor; job-b holds nothing: its floor.
    assert [p.session.session_id for p in scheduler.plan()] == ["other"]
    for batch in batches[:6]:
        scheduler.sent(first, batch)
    scheduler.sent(first, sized(1 * MIB))  # not one of its batches: releases nothing
    assert scheduler.held_bytes() == 5 * MIB
    # 4 MiB of the pool's 10 still job-a's: again takes one more up to its 5 MiB share, other four.
    planned = sorted(p.session.session_id for p in scheduler.plan())
    assert planned == ["again"] + ["other"] * 4 and scheduler.pool_bytes() == 9 * MIB, planned
    for batch in batches[6:]:
        scheduler.sent(first, batch)
    assert scheduler.held_bytes() == 6 * MIB


@pytest.mark.parametrize("seed", range(4))
def test_held_outputs_stay_within_the_limit_plus_one_batch_per_job_and_no_job_that_holds_nothing_waits(seed):
    """Random jobs (weights 1 to 100, one to three sessions), random batch sizes up to the
    largest, sessions that never receive and sessions that receive at random, jobs that come and
    go (what an ended session held is released later, at random): after every plan the pool is
    within the limit and the total within the limit plus one largest batch per job holding
    outputs, and every job that held nothing and had a batch that could be planned (its session
    ready, within max_inflight) got one in that plan."""
    rng = random.Random(seed)
    limit, largest = 16 * MIB, 5 * MIB
    scheduler = Scheduler(max_batch_tokens=10_000 * ROWS * SEQ, max_sessions=64, held_bytes_limit=limit)
    sessions: list[FakeSession] = []
    never_receive: set[str] = set()
    held: dict[str, list] = defaultdict(list)  # by session: batches planned and not yet sent
    ended: list[FakeSession] = []  # removed while holding outputs
    names = itertools.count()

    def join() -> None:
        job, weight = f"job-{next(names)}", float(rng.choice([1, 2, 10, 100]))
        for _ in range(rng.randint(1, 3)):
            session = FakeSession(f"s-{next(names)}", job, weight, rng.randint(1, 8))
            joined(scheduler, session)
            sessions.append(session)
            if rng.random() < 0.4:
                never_receive.add(session.session_id)

    for _ in range(4):
        join()
    for _ in range(400):
        if rng.random() < 0.03 and sessions:  # a job leaves
            job = rng.choice(sessions).job_id
            for session in [s for s in sessions if s.job_id == job]:
                scheduler.remove(session)
                sessions.remove(session)
                ended.append(session)
        if rng.random() < 0.05 or not sessions:
            join()
        for session in sessions:
            while scheduler.queued(session) < 2:
                scheduler.submit(session, sized(rng.randint(1, largest)))
        job_held: dict[str, int] = defaultdict(int)
        for session in sessions:
            job_held[session.job_id] += len(held[session.session_id])
        waiting = {s.job_id for s in sessions if not job_held[s.job_id] and s.max_inflight > 0}
        plan = scheduler.plan()
        for planned in plan:
            held[planned.session.session_id].append(planned.batch)
        holding = {s.job_id for s in sessions + ended if held[s.session_id]}
        assert scheduler.pool_bytes() <= limit
        assert scheduler.held_bytes() == sum(b.output_bytes for batches in held.values() for b in batches)
        assert scheduler.held_bytes() <= limit + len(holding) * largest
        assert waiting <= {p.session.job_id for p in plan}, "a job that held nothing was not planned"
        for session in sessions + ended:  # students that receive (and sends that time out) release some
            if session in ended or session.session_id not in never_receive:
                for batch in [b for b in held[session.session_id] if rng.random() < 0.7]:
                    scheduler.sent(session, batch)
                    held[session.session_id].remove(batch)


def test_without_a_limit_outputs_held_are_bounded_by_max_inflight_only():
    scheduler = Scheduler(max_batch_tokens=64 * ROWS * SEQ, max_sessions=8)
    (a,) = joined(scheduler, FakeSession("a", "job-a", max_inflight=4))
    for _ in range(6):
        scheduler.submit(a, sized(100 * MIB))
    assert len(scheduler.plan()) == 4 and scheduler.held_bytes() == 400 * MIB


# ---- a pool of replicas: a job's weight over the pool (student_trainer/pool.py) -----------------


@dataclass
class PooledSession(FakeSession):
    job_size: int = 0
    job_rank: int = 0


POOL_WEIGHTS = {"job-a": 1.0, "job-b": 1.0, "job-c": 2.0}  # three jobs of two ranks each


def placed(order: list[tuple[str, int]], at_once: bool = False, count_job: bool = True,
           replicas: int = 3) -> dict[str, list[PooledSession]]:
    """Where the ranks of POOL_WEIGHTS' jobs go, joining in `order` ((job, rank) pairs), as a pool's
    client places them (student_trainer/pool.py) from what the replicas say: each rank sees the
    ones before it, or (`at_once`) the ranks of a job see the same sums and none of their job's.
    `count_job=False`: placement as if no replica said which of the job's sessions it serves."""
    from student_trainer.pool import place

    names = [f"r{i}" for i in range(replicas)]
    where: dict[str, list[PooledSession]] = {name: [] for name in names}
    before = {name: [] for name in names}
    for index, (job, rank) in enumerate(order):
        if not at_once or index == 0 or order[index - 1][0] != job:
            before = {name: list(sessions) for name, sessions in where.items()}
        candidates = {name: (sum(s.job_id == job for s in sessions) if count_job else 0,
                             sum(POOL_WEIGHTS[s.job_id] / s.job_size for s in sessions), 0.0)
                      for name, sessions in before.items()}
        joined_ranks = {s.job_rank for sessions in before.values() for s in sessions if s.job_id == job}
        weight = POOL_WEIGHTS[job]
        where[place(candidates, names, rank, weight / 2, joined_ranks)].append(
            PooledSession(f"{job}{rank}", job, weight, job_size=2, job_rank=rank))
    return where


def lockstep_tokens(where: dict[str, list[PooledSession]], rounds: int = 120, ahead: int = 2) -> dict[str, int]:
    """The tokens each job gets when every replica runs one forward of one batch a round (alike
    and busy) and a job's ranks step together, as data-parallel ranks do: a rank has batches
    submitted at most `ahead` steps beyond its job's slowest rank (the trainer's --prefetch)."""
    schedulers = {name: Scheduler(max_batch_tokens=ROWS * SEQ, max_sessions=8) for name in where}
    ranks: dict[str, list[str]] = defaultdict(list)
    for name, sessions in where.items():
        joined(schedulers[name], *sessions)
        for session in sessions:
            ranks[session.job_id].append(session.session_id)
    received = {session_id: 0 for ids in ranks.values() for session_id in ids}
    submitted = dict(received)
    tokens: dict[str, int] = defaultdict(int)
    for _ in range(rounds):
        for name, sessions in where.items():
            for session in sessions:
                step = min(received[other] for other in ranks[session.job_id])
                while submitted[session.session_id] <= step + ahead:
                    schedulers[name].submit(session, batch())
                    submitted[session.session_id] += 1
        for scheduler in schedulers.values():
            for planned in scheduler.plan():
                scheduler.sent(planned.session)
                received[planned.session.session_id] += 1
                tokens[planned.session.job_id] += planned.batch.tokens
    return tokens


def worst_share_error(tokens: dict[str, int]) -> float:
    """The largest relative distance of a job's share of the tokens from its weight's share."""
    total, weight_total = sum(tokens.values()), sum(POOL_WEIGHTS.values())
    return max(abs(tokens[job] / total - weight / weight_total) / (weight / weight_total)
               for job, weight in POOL_WEIGHTS.items())


@pytest.mark.parametrize("joining", ["one after another", "ranks at once"])
def test_a_jobs_weight_holds_over_a_pool_of_replicas(joining):
    """Three replicas, jobs of two ranks each with weights 1, 1, 2, placed as a pool places them
    (student_trainer/pool.py) and each replica applying a job's weight in proportion to its ranks
    there: over the pool, each job's share of the tokens is within 20% of its weight's share
    (the replicas alike and busy: one forward each per round). Two ranks weigh 0.5, 0.5 or 1:
    no placement evens three replicas out exactly."""
    order = [(job, rank) for job in POOL_WEIGHTS for rank in range(2)]
    where = placed(order, at_once=joining == "ranks at once")
    replicas = {name: Scheduler(max_batch_tokens=4 * ROWS * SEQ, max_sessions=8) for name in where}
    tokens: dict[str, int] = defaultdict(int)
    for name, replica in replicas.items():
        sessions = joined(replica, *where[name])
        for job, count in by_job(forwards(replica, sessions, 600)).items():
            tokens[job] += count
    assert worst_share_error(tokens) < 0.2, dict(tokens)
    # Each replica applies half a job's weight for each of its two ranks there: the sums placement evened out.
    assert sorted(replica.weight_total() for replica in replicas.values()) == [1.0, 1.5, 1.5]
    assert all(len({s.job_id for s in sessions}) == 2 for sessions in where.values())  # a job's ranks spread


def test_a_jobs_weight_holds_over_a_pool_in_every_order_its_lockstep_ranks_join():
    """The six ranks of the jobs above, joining in each of their 720 orders (one after another,
    or each job's two at once), with each job stepping at its slowest rank's pace: every job gets
    its weight's share of the pool's tokens within 5% (2% in the runs so far). Placing by the
    least weight alone (the replicas' sessions of the job not counted, so a job's two ranks may
    share a replica) put some job more than 20% off its share in 128 of the orders one after
    another, up to 59%: why placement spreads a job's ranks first."""
    ranks = [(job, rank) for job in POOL_WEIGHTS for rank in range(2)]
    orders = [list(order) for order in itertools.permutations(ranks)]
    errors = {}
    for count_job in (True, False):
        placements = {}  # the same placement from many orders: simulated once
        for order in orders:
            for at_once in (False, True):
                where = placed(order, at_once=at_once, count_job=count_job)
                key = tuple(tuple(sorted(s.session_id for s in sessions)) for sessions in where.values())
                placements.setdefault(key, where)
        errors[count_job] = {key: worst_share_error(lockstep_tokens(where)) for key, where in placements.items()}
    assert max(errors[True].values()) < 0.05, errors[True]
    assert max(errors[False].values()) > 0.5, errors[False]
