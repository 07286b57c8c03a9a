"""The client's connection state machine (student_trainer/connection.py), alone: no server,
no sockets, no threads. Sessions are plain objects; the clock and the backoff's jitter are
injected."""

from __future__ import annotations

import grpc
import pytest

from student_trainer.connection import (RECONNECT_FIRST_DELAY_S, RECONNECT_MAX_DELAY_S, Action, Connection, FirstJoin,
                                        State, worth_retrying)
from student_trainer.errors import (AuthenticationFailed, BatchNotServed, Incompatible, InvalidRequest, LimitExceeded,
                                    PermissionRefused, SessionNotFound, TeacherError, TeacherUnavailable,
                                    TransferFailed)

ADDRESS = "teacher:50051"


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def gone() -> TeacherUnavailable:
    return TeacherUnavailable("the submit stream ended", grpc.StatusCode.UNAVAILABLE)


def connection(reconnect_timeout_s: float = 10.0, clock: Clock | None = None, jitter=lambda a, b: b):
    first = object()
    return Connection(first, ADDRESS, reconnect_timeout_s, clock=clock or Clock(), jitter=jitter), first


def lost(conn: Connection, session) -> None:
    assert conn.failed(session, gone()) is Action.REJOIN
    assert conn.start_rejoining()


# ---- failures while connected ----------------------------------------------------------------


@pytest.mark.parametrize("error", [
    TeacherUnavailable("unreachable", grpc.StatusCode.UNAVAILABLE),
    SessionNotFound("unknown session", grpc.StatusCode.NOT_FOUND),
    TransferFailed("receiving batch 3 did not complete within 30.0s"),
])
def test_the_teacher_going_away_leads_to_joining_again(error):
    conn, first = connection()
    assert conn.failed(first, error) is Action.REJOIN
    assert conn.state is State.LOST and conn.cause is error and conn.error is None
    assert conn.reconnecting and conn.unusable() is None  # submit still takes batches: the new session gets them
    assert conn.current() is None and not conn.serves(first)


@pytest.mark.parametrize("error", [
    InvalidRequest("bad ids", grpc.StatusCode.INVALID_ARGUMENT),
    Incompatible("another vocabulary", grpc.StatusCode.FAILED_PRECONDITION),
    LimitExceeded("--max-batch-tokens", grpc.StatusCode.RESOURCE_EXHAUSTED),
    AuthenticationFailed("wrong token", grpc.StatusCode.UNAUTHENTICATED),
    TeacherError("client and teacher disagree on the protocol"),
])
def test_any_other_failure_breaks_the_client(error):
    conn, first = connection()
    assert conn.failed(first, error) is Action.BREAK
    assert conn.state is State.BROKEN and conn.error is error and conn.unusable() is error
    assert not conn.reconnecting and conn.current() is None and not conn.serves(first)


def test_without_a_reconnect_timeout_the_teacher_going_away_breaks_the_client():
    conn, first = connection(reconnect_timeout_s=0)
    error = gone()
    assert conn.failed(first, error) is Action.BREAK
    assert conn.state is State.BROKEN and conn.unusable() is error


def test_a_failure_is_acted_on_once():
    conn, first = connection()
    assert conn.failed(first, gone()) is Action.REJOIN
    # The session's other threads fail too, once its stream is cancelled and its group aborted.
    assert conn.failed(first, TransferFailed("aborted")) is Action.IGNORE
    assert conn.failed(first, InvalidRequest("late", grpc.StatusCode.INVALID_ARGUMENT)) is Action.IGNORE
    assert conn.state is State.LOST and conn.error is None


def test_a_failure_of_an_old_session_after_a_new_one_is_current_is_ignored():
    conn, first = connection()
    lost(conn, first)
    second = object()
    assert conn.rejoined(second)
    for error in (gone(), InvalidRequest("late answer", grpc.StatusCode.INVALID_ARGUMENT)):
        assert conn.failed(first, error) is Action.IGNORE
    assert conn.state is State.CONNECTED and conn.session is second and conn.serves(second)


# ---- rejoining -------------------------------------------------------------------------------


def test_lost_rejoining_connected():
    clock = Clock()
    conn, first = connection(clock=clock)
    assert conn.failed(first, gone()) is Action.REJOIN
    assert conn.start_rejoining()
    assert conn.state is State.REJOINING and conn.reconnecting and conn.deadline == clock.now + 10.0
    assert conn.may_attempt()
    assert conn.attempt_failed(ConnectionError("the store is not up yet")) is not None
    second = object()
    assert conn.rejoined(second)
    assert conn.state is State.CONNECTED and not conn.reconnecting
    assert conn.current() is second and conn.serves(second) and not conn.serves(first)


def test_the_deadline_runs_from_the_start_of_rejoining_and_then_the_client_breaks_naming_the_timeout():
    clock = Clock()
    conn, first = connection(reconnect_timeout_s=10.0, clock=clock)
    cause = gone()
    assert conn.failed(first, cause) is Action.REJOIN
    clock.now += 3.0  # tearing the lost session down does not count
    assert conn.start_rejoining()
    clock.now += 9.9
    assert conn.may_attempt()
    last = TeacherUnavailable("connection refused", grpc.StatusCode.UNAVAILABLE)
    assert conn.attempt_failed(last) == pytest.approx(0.1)  # a pause never goes past the deadline
    clock.now += 0.1
    assert not conn.may_attempt()
    assert conn.state is State.BROKEN and isinstance(conn.error, TeacherUnavailable)
    message = str(conn.error)
    assert "reconnect_timeout_s=10s" in message and "--teacher-reconnect-timeout-s" in message
    assert str(cause) in message and str(last) in message and ADDRESS in message
    assert conn.unusable() is conn.error


def test_the_pause_between_attempts_doubles_up_to_a_cap_drawn_down_by_the_jitter():
    draws = []

    def jitter(low: float, high: float) -> float:
        draws.append((low, high))
        return low if len(draws) % 2 else high

    conn, first = connection(reconnect_timeout_s=1000.0, jitter=jitter)
    lost(conn, first)
    pauses = [conn.attempt_failed(ConnectionError("not up")) for _ in range(6)]
    assert draws == [(0.5, 1.0)] * 6
    delays = [min(RECONNECT_FIRST_DELAY_S * 2 ** i, RECONNECT_MAX_DELAY_S) for i in range(6)]
    assert pauses == pytest.approx([d * (0.5 if i % 2 == 0 else 1.0) for i, d in enumerate(delays)])
    assert delays[-1] == RECONNECT_MAX_DELAY_S
    # The next loss starts again from the first pause.
    assert conn.rejoined(second := object())
    lost(conn, second)
    assert conn.attempt_failed(ConnectionError("not up")) == pytest.approx(RECONNECT_FIRST_DELAY_S * 0.5)


@pytest.mark.parametrize("error, retried", [
    (TeacherUnavailable("restarting", grpc.StatusCode.UNAVAILABLE), True),
    (TeacherUnavailable("slow", grpc.StatusCode.DEADLINE_EXCEEDED), True),
    (SessionNotFound("unknown", grpc.StatusCode.NOT_FOUND), True),
    (LimitExceeded("--max-sessions", grpc.StatusCode.RESOURCE_EXHAUSTED), True),  # full: leases expire
    (ConnectionError("cannot reach the teacher's store"), True),
    (RuntimeError("the group did not form"), True),
    (Incompatible("the teacher came back different", grpc.StatusCode.FAILED_PRECONDITION), False),
    (AuthenticationFailed("wrong token", grpc.StatusCode.UNAUTHENTICATED), False),
    (InvalidRequest("bad outputs", grpc.StatusCode.INVALID_ARGUMENT), False),
    (ValueError("unknown backend"), False),
])
def test_which_join_errors_are_worth_retrying(error, retried):
    assert worth_retrying(error) is retried
    conn, first = connection()
    lost(conn, first)
    pause_s = conn.attempt_failed(error)
    if retried:
        assert pause_s is not None and conn.state is State.REJOINING
        return
    assert pause_s is None and conn.state is State.BROKEN
    # The same kind of error, saying what was being done; a TeacherError keeps its code.
    assert type(conn.error) is (type(error) if isinstance(error, TeacherError) else TeacherError)
    assert f"joining teacher {ADDRESS} again after it was lost" in str(conn.error) and str(error) in str(conn.error)
    assert conn.error.code == getattr(error, "code", None)


# ---- heartbeats ------------------------------------------------------------------------------


@pytest.mark.parametrize("reconnect_timeout_s, code, action", [
    (10.0, grpc.StatusCode.NOT_FOUND, Action.REJOIN),  # the teacher forgot the session
    (0.0, grpc.StatusCode.NOT_FOUND, Action.BREAK),
    (10.0, grpc.StatusCode.UNAVAILABLE, Action.REJOIN),
    (0.0, grpc.StatusCode.UNAVAILABLE, Action.IGNORE),  # one missed heartbeat is not worth failing for
    (10.0, grpc.StatusCode.DEADLINE_EXCEEDED, Action.IGNORE),
])
def test_a_failed_heartbeat_fails_the_session_only_when_it_means_the_teacher_is_gone(reconnect_timeout_s, code,
                                                                                    action):
    conn, first = connection(reconnect_timeout_s=reconnect_timeout_s)
    assert conn.heartbeat_failed(first, TeacherError("heartbeat", code)) is action
    assert conn.state is {Action.REJOIN: State.LOST, Action.BREAK: State.BROKEN,
                          Action.IGNORE: State.CONNECTED}[action]


# ---- the end ---------------------------------------------------------------------------------


def _in_state(state: State) -> tuple[Connection, object]:
    conn, first = connection()
    if state is State.LOST:
        assert conn.failed(first, gone()) is Action.REJOIN
    elif state is State.REJOINING:
        lost(conn, first)
    elif state is State.BROKEN:
        assert conn.failed(first, InvalidRequest("bad", grpc.StatusCode.INVALID_ARGUMENT)) is Action.BREAK
    elif state is State.CLOSED:
        assert conn.close()
    assert conn.state is state
    return conn, first


@pytest.mark.parametrize("state", list(State))
def test_close_from_any_state_and_only_once(state):
    conn, first = _in_state(state)
    error = conn.error
    assert conn.close() is (state is not State.CLOSED)
    assert conn.state is State.CLOSED and not conn.close()
    assert not conn.reconnecting and conn.current() is None
    if state is State.BROKEN:
        assert conn.unusable() is error  # why it broke, not that it was closed
    else:
        assert "closed" in str(conn.unusable())
    # A client closed while connected (State.CLOSED: closed while connected, by _in_state) lets
    # its session deliver until its threads are joined; a lost or broken session delivers nothing.
    assert conn.serves(first) is (state in (State.CONNECTED, State.CLOSED))


@pytest.mark.parametrize("state", [State.BROKEN, State.CLOSED])
def test_nothing_leaves_broken_or_closed_but_close(state):
    conn, first = _in_state(state)
    error, new = conn.error, object()
    assert conn.failed(first, gone()) is Action.IGNORE
    assert conn.heartbeat_failed(first, SessionNotFound("gone", grpc.StatusCode.NOT_FOUND)) is Action.IGNORE
    assert not conn.start_rejoining()
    assert not conn.may_attempt()
    assert conn.attempt_failed(ConnectionError("not up")) is None
    assert not conn.rejoined(new)  # the caller gives the new session up
    assert conn.state is state and conn.error is error and conn.session is first


def test_closing_while_rejoining_ends_the_attempts_without_breaking():
    conn, first = connection()
    lost(conn, first)
    assert conn.close()
    assert not conn.may_attempt() and conn.attempt_failed(ConnectionError("not up")) is None
    assert not conn.rejoined(object())
    assert conn.state is State.CLOSED and conn.error is None


# ---- the first Join ----------------------------------------------------------------------------


def full() -> LimitExceeded:
    return LimitExceeded("the teacher already serves 4 sessions (--max-sessions 4)", grpc.StatusCode.RESOURCE_EXHAUSTED)


def test_a_first_join_refused_for_capacity_is_asked_again_with_backoff_until_the_join_timeout():
    clock = Clock()
    first = FirstJoin(ADDRESS, 20.0, clock=clock, jitter=lambda low, high: high)
    pauses = []
    while (pause_s := first.refused(full())) is not None:
        pauses.append(pause_s)
        clock.now += pause_s
    # Doubled up to the cap, the last one cut to end at the deadline; none after it.
    assert pauses == pytest.approx([0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 2.5])
    assert sum(pauses) == pytest.approx(20.0) and first.attempts == len(pauses) + 1
    final = first.final(full())
    assert isinstance(final, LimitExceeded) and final.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-sessions 4" in str(final) and "8 attempts over join_timeout_s=20s" in str(final)


def test_the_pauses_are_jittered_down_by_up_to_half():
    first = FirstJoin(ADDRESS, 100.0, clock=Clock(), jitter=lambda low, high: low)
    assert [first.refused(full()) for _ in range(3)] == pytest.approx([0.25, 0.5, 1.0])


def test_the_log_line_says_why_the_client_waits_and_for_how_long():
    clock = Clock()
    first = FirstJoin(ADDRESS, 30.0, clock=clock, jitter=lambda low, high: high)
    clock.now += 10.0
    error = full()
    line = first.waiting(error, first.refused(error))
    assert ADDRESS in line and "has no room for this session yet" in line and str(error) in line
    assert "asking again in 0.5s" in line and "up to 20s more (join_timeout_s)" in line


@pytest.mark.parametrize("error", [
    InvalidRequest("weight 3 exceeds --max-weight 2", grpc.StatusCode.INVALID_ARGUMENT),
    Incompatible("another vocabulary", grpc.StatusCode.FAILED_PRECONDITION),
    AuthenticationFailed("wrong token", grpc.StatusCode.UNAUTHENTICATED),
    PermissionRefused("this job token may join only as job 'a'", grpc.StatusCode.PERMISSION_DENIED),
    TeacherUnavailable("shutting down", grpc.StatusCode.UNAVAILABLE),
])
def test_a_first_join_refused_for_anything_but_capacity_is_not_asked_again(error):
    first = FirstJoin(ADDRESS, 60.0, clock=Clock())
    assert first.refused(error) is None
    assert first.final(error) is error  # raised as the teacher said it


def test_a_capacity_refusal_at_the_deadline_is_final_and_a_single_attempt_keeps_its_message():
    clock = Clock()
    first = FirstJoin(ADDRESS, 0.0, clock=clock)
    error = full()
    assert first.refused(error) is None
    assert first.final(error) is error

# ---- progress: a batch that keeps ending sessions ---------------------------------------------


class Named:
    """A session as the connection sees it: only its id is read."""

    def __init__(self, session_id: str):
        self.session_id = session_id


def ended_by_teacher(why: str) -> SessionNotFound:
    return SessionNotFound(f"Heartbeat to teacher: session has ended ({why}); join again [NOT_FOUND]",
                           grpc.StatusCode.NOT_FOUND)


def rejoin(conn: Connection, session, error: TeacherError, outstanding: list[int], new) -> None:
    assert conn.failed(session, error, outstanding) is Action.REJOIN
    assert conn.start_rejoining() and conn.may_attempt()
    assert conn.rejoined(new)


def test_a_batch_that_ended_every_session_it_was_sent_to_fails_with_why_each_ended_after_max_resubmits():
    clock = Clock()
    sessions = [Named(f"s{i}") for i in range(4)]
    conn = Connection(sessions[0], ADDRESS, 10.0, max_resubmits=2, clock=clock, jitter=lambda a, b: b)
    first = ended_by_teacher("batch_failed: batch 0 failed: the teacher's forward failed: RuntimeError: marked")
    rejoin(conn, sessions[0], first, [7, 8], sessions[1])
    assert conn.not_to_resubmit([7, 8]) == {}  # sent once, resubmitted to s1
    # s1 ends while it holds 7 (8 was delivered); the receive broke first, the teacher says why at Leave.
    broken = TransferFailed("receiving batch 7: connection closed by peer")
    assert conn.failed(sessions[1], broken, [7]) is Action.REJOIN
    assert conn.start_rejoining()
    conn.explained(ended_by_teacher("batch_failed: batch 0 failed: again"))
    assert conn.rejoined(sessions[2])
    assert conn.not_to_resubmit([7]) == {}  # resubmitted a second time: max_resubmits
    rejoin(conn, sessions[2], ended_by_teacher("batch_failed: third"), [7, 9], sessions[3])
    # The bound is progress, not time: every join succeeded at once.
    assert clock.now == 100.0
    hopeless = conn.not_to_resubmit([7, 9])
    assert list(hopeless) == [7]  # 9 was held by one lost session only: sent again
    error = hopeless[7]
    assert isinstance(error, BatchNotServed) and isinstance(error, TeacherError)
    message = str(error)
    assert "batch 7" in message and "3 times" in message and "--teacher-max-resubmits" in message
    history = [message.index(f"({i}) session s{i - 1}: ") for i in (1, 2, 3)]
    assert history == sorted(history)  # in the order the sessions ended
    for text in (str(first), str(broken), "the teacher says: ", "again", "third"):
        assert text in message, text
    # The client goes on: connected, not broken, and batch 7's history is gone with it.
    assert conn.state is State.CONNECTED and conn.error is None and conn.current() is sessions[3]
    assert conn.not_to_resubmit([9]) == {}


def test_with_no_resubmits_a_batch_whose_session_ended_fails_at_the_first_rejoin():
    a, b = Named("a"), Named("b")
    conn = Connection(a, ADDRESS, 10.0, max_resubmits=0, clock=Clock(), jitter=lambda lo, hi: hi)
    rejoin(conn, a, gone(), [3], b)
    assert list(conn.not_to_resubmit([3, 4])) == [3]  # 4 was submitted while rejoining: never lost

