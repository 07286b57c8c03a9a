"""The client's connection to the teacher, as a state machine: what a failure leads to.

    CONNECTED ── the teacher went away, reconnect_timeout_s > 0 ──▶ LOST ──▶ REJOINING ── joined ──▶ CONNECTED
        │                                                                     │ ▲
        │                                                                     └─┘ an attempt failed that
        │                                                                         may go otherwise: pause
        └── any other failure ──▶ BROKEN ◀── a refusal, or reconnect_timeout_s passed ── REJOINING
    every state ── close() ──▶ CLOSED

CONNECTED: the current session serves the batches. LOST: the session that failed is
being torn down (its stream cancelled, its group aborted). REJOINING: joins are attempted,
with backoff, until a deadline. BROKEN: every outstanding and later batch fails with
`error`. CLOSED: the caller closed the client (a broken client keeps its error).

A failure of a session that is no longer current (its threads outlive it) changes
nothing, and so does any failure once the client is broken or closed: each failure is
acted on once. Nothing leaves BROKEN but close(); nothing leaves CLOSED.

Before all that, the first Join (`FirstJoin`): a teacher that is full for now is asked
again, with the same backoff, until the client's join timeout.
Rejoining is bounded by progress as well as by time: every join may succeed while one
batch keeps ending the sessions it is sent to (a batch the teacher cannot run). Each
undelivered batch keeps why each session that held it ended; a batch that was sent again
`max_resubmits` times, and whose last session ended too, is not sent again but fails with
that history (`BatchNotServed`), and the client goes on with the others.

No threads, no sockets, no lock: TeacherClient's joining procedure (student_trainer/joining.py)
calls it under the client's lock, and the transitions are tested alone
(tests/test_connection.py). The clock and the jitter of the backoff are injected.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

import grpc

from student_trainer.errors import (BatchNotServed, LimitExceeded, SessionNotFound, TeacherError, TeacherUnavailable,
                                    teacher_gone)

# Reconnecting: the first pause, doubled after each failed attempt up to the cap, each
# drawn down by up to half (jitter: the jobs of one teacher do not come back in lockstep).
RECONNECT_FIRST_DELAY_S = 0.5
RECONNECT_MAX_DELAY_S = 5.0
# Besides a teacher that is gone (errors.teacher_gone): one too slow to answer, or full
# (--max-sessions), may take the session a little later.
_REJOIN_ALSO_ON = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED})
# How many times a batch is sent again to a new session after the one holding it ended, before
# it fails: a teacher restart costs one, a batch the teacher cannot run ends every session.
MAX_RESUBMITS = 3


def worth_retrying(error: Exception) -> bool:
    """Whether joining again may go otherwise: the teacher is not up (yet), or the group did not form."""
    if isinstance(error, TeacherError):
        return teacher_gone(error) or error.code in _REJOIN_ALSO_ON
    # The rendezvous or the group: ConnectionError (the teacher host did not resolve), TransferError or a DistError
    # (a RuntimeError) from building the group.
    return isinstance(error, (ConnectionError, RuntimeError))


def counts_as_gone(heartbeat_error: TeacherError, reconnect_timeout_s: float) -> bool:
    """Whether a failed heartbeat means the session failed.

    NOT_FOUND does: the teacher forgot the session. UNAVAILABLE only when there is a
    reconnect to try; without one, one unanswered heartbeat is not worth failing for: the
    stream and the data plane tell when the teacher is really gone.
    """
    return heartbeat_error.code == grpc.StatusCode.NOT_FOUND or (
        heartbeat_error.code == grpc.StatusCode.UNAVAILABLE and reconnect_timeout_s > 0)


def too_large(error: TeacherError) -> bool:
    """Whether `error` is grpc's own refusal of a request over the teacher's --max-request-bytes
    (its text: grpc checks the size before any of the teacher's code runs). Such a refusal is
    RESOURCE_EXHAUSTED like a full teacher's, but the same request is refused again however
    long one waits."""
    return error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in str(error)


class FirstJoin:
    """When to ask again after the first Join was refused: only for capacity.

    RESOURCE_EXHAUSTED at Join means the teacher is full for now (--max-sessions, the job's
    session cap, --max-rpcs); slots come free as sessions leave, and a join that never forms
    its group gives its slot back after the teacher's --join-timeout-s. Anything else is an
    answer that asking again would not change. The pauses are the reconnect's (doubled,
    capped, jittered) and never go past `timeout_s` from the start.
    """

    def __init__(self, address: str, timeout_s: float, *, student_vocab_entries: int = 0,
                 clock: Callable[[], float] = time.monotonic, jitter: Callable[[float, float], float] = random.uniform):
        self.address = address
        self.timeout_s = timeout_s
        # The entries of the student vocabulary the Join carries (0: none): what sizes a
        # cross-tokenizer Join, and what the teacher's --max-student-vocab must admit.
        self.student_vocab_entries = student_vocab_entries
        self.deadline = clock() + timeout_s
        self.attempts = 0  # refused so far
        self._delay_s = RECONNECT_FIRST_DELAY_S
        self._clock = clock
        self._jitter = jitter

    def refused(self, error: TeacherError) -> float | None:
        """The Join was refused with `error`: the pause before asking again, or None to give up
        (raise `final(error)`)."""
        self.attempts += 1
        left_s = self.deadline - self._clock()
        if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or too_large(error) or left_s <= 0:
            return None
        pause_s = min(left_s, self._delay_s * self._jitter(0.5, 1.0))
        self._delay_s = min(2 * self._delay_s, RECONNECT_MAX_DELAY_S)
        return pause_s

    def waiting(self, error: TeacherError, pause_s: float) -> str:
        """The log line for a pause: why the client waits, and for how long at most."""
        return (f"teacher {self.address} has no room for this session yet ({error}); asking again in "
                f"{pause_s:.1f}s, for up to {max(0.0, self.deadline - self._clock()):.0f}s more (join_timeout_s)")

    def final(self, error: TeacherError) -> TeacherError:
        """What to raise when giving up: `error`, saying how long the client asked when it was full."""
        if too_large(error) and self.student_vocab_entries:
            # The teacher sizes its request limit by --max-student-vocab (docs/security.md,
            # "Limits"): that flag, not --max-request-bytes, is the one that admits a vocabulary.
            return LimitExceeded(f"{error}: the Join carries this student's vocabulary of "
                                 f"{self.student_vocab_entries:,} entries, more than the teacher's request limit "
                                 "holds; start the teacher with --max-student-vocab "
                                 f"{self.student_vocab_entries} (or more: it defaults to the teacher's own "
                                 "vocabulary size, and sizes --max-request-bytes)", error.code)
        if too_large(error):
            return LimitExceeded(f"{error}: the Join request is larger than the teacher's --max-request-bytes "
                                 "(a long logit subset, say): ask for fewer ids, or start the teacher with a larger "
                                 "--max-request-bytes", error.code)
        if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or self.attempts <= 1:
            return error
        return LimitExceeded(f"{error}; still refused after {self.attempts} attempts over join_timeout_s="
                             f"{self.timeout_s:g}s: raise the teacher's limit or the client's join timeout",
                             error.code)


class State(enum.Enum):
    CONNECTED = "connected"
    LOST = "lost"
    REJOINING = "rejoining"
    BROKEN = "broken"
    CLOSED = "closed"


class Action(enum.Enum):
    """What the client does about a failure."""

    IGNORE = "ignore"  # not the current session's, or acted on already
    REJOIN = "rejoin"  # tear the session down and join again
    BREAK = "break"  # tear the session down and fail every outstanding batch with `error`


@dataclass
class _Loss:
    """A session that ended while it held batches, and why."""

    session_id: str
    error: TeacherError
    teacher_says: str = ""  # the teacher's own account, when the error was not it (explained)

    def __str__(self) -> str:
        said = f"; the teacher says: {self.teacher_says}" if self.teacher_says else ""
        return f"session {self.session_id}: {self.error}{said}"


class Connection:
    """Which session is current and what happens to the client when something fails.

    `session` is opaque here: whatever the client calls a session (read: its `session_id`).
    Batches are the client's ids.
    """

    def __init__(self, session, address: str, reconnect_timeout_s: float, *,
                 max_resubmits: int = MAX_RESUBMITS, clock: Callable[[], float] = time.monotonic,
                 jitter: Callable[[float, float], float] = random.uniform):
        self.state = State.CONNECTED
        self.session = session
        self.address = address
        self.reconnect_timeout_s = reconnect_timeout_s
        self.error: TeacherError | None = None  # why the client is broken
        self.cause: TeacherError | None = None  # why the session was lost, while rejoining
        self.deadline: float | None = None  # until when to rejoin (the clock's time)
        self._last: BaseException | None = None  # the last rejoin attempt's error
        self._closed_while_serving = None  # the session current at close(), if it was connected
        self._delay_s = RECONNECT_FIRST_DELAY_S
        self._clock = clock
        self._jitter = jitter
        self.max_resubmits = max_resubmits
        self._losses: dict[int, list[_Loss]] = {}  # by batch: the sessions that ended while holding it
        self._last_loss: _Loss | None = None

    # ---- reading -----------------------------------------------------------------

    def serves(self, session) -> bool:
        """Whether `session`'s results are delivered: it is the current one and not lost.

        A client closed while connected lets its session deliver until its threads are joined.
        """
        if self.state is State.CLOSED:
            return session is self._closed_while_serving
        return session is self.session and self.state is State.CONNECTED

    def current(self):
        """The session to send a new batch to, or None while rejoining (the new session will get it)."""
        return self.session if self.state is State.CONNECTED else None

    @property
    def reconnecting(self) -> bool:
        return self.state in (State.LOST, State.REJOINING)

    def unusable(self) -> TeacherError | None:
        """Why nothing can be submitted any more, or None."""
        if self.error is not None:
            return self.error
        if self.state is State.CLOSED:
            return TeacherError("the client is closed")
        return None

    # ---- failures while connected ------------------------------------------------

    def failed(self, session, error: TeacherError, outstanding: Iterable[int] = ()) -> Action:
        """A thread of `session` hit `error`: join again if the teacher went away, else break.

        `outstanding`: the batches `session` held, undelivered; each remembers the loss.
        """
        if session is not self.session or self.state is not State.CONNECTED:
            return Action.IGNORE
        if self.reconnect_timeout_s > 0 and teacher_gone(error):
            self.state, self.cause = State.LOST, error
            self._last_loss = _Loss(getattr(session, "session_id", "?"), error)
            for batch_id in outstanding:
                self._losses.setdefault(batch_id, []).append(self._last_loss)
            return Action.REJOIN
        self._break(error)
        return Action.BREAK

    def heartbeat_failed(self, session, error: TeacherError, outstanding: Iterable[int] = ()) -> Action:
        if not counts_as_gone(error, self.reconnect_timeout_s):
            return Action.IGNORE
        return self.failed(session, error, outstanding)

    def explained(self, answer: TeacherError) -> None:
        """The teacher's answer about the lost session (to Leave): NOT_FOUND names why it ended it.

        Kept with the loss when its error was something else (a receive that broke when the
        teacher aborted the group), so the history says what the teacher saw.
        """
        loss = self._last_loss
        if (loss is not None and isinstance(answer, SessionNotFound) and not isinstance(loss.error, SessionNotFound)
                and self.state in (State.LOST, State.REJOINING)):
            loss.teacher_says = str(answer)

    # ---- rejoining ---------------------------------------------------------------

    def start_rejoining(self) -> bool:
        """LOST → REJOINING: the lost session is torn down; the deadline starts now.

        False when the client was closed meanwhile.
        """
        if self.state is not State.LOST:
            return False
        self.state = State.REJOINING
        self.deadline = self._clock() + self.reconnect_timeout_s
        self._delay_s = RECONNECT_FIRST_DELAY_S
        self._last = self.cause
        return True

    def may_attempt(self) -> bool:
        """Whether to make another join attempt; past the deadline the client breaks.

        False when the client is broken (see `error`) or was closed meanwhile.
        """
        if self.state is not State.REJOINING:
            return False
        if self._clock() < self.deadline:
            return True
        self._break(TeacherUnavailable(
            f"teacher {self.address} did not come back within reconnect_timeout_s={self.reconnect_timeout_s:g}s "
            f"(the trainer's --teacher-reconnect-timeout-s); it was lost: {self.cause}; last attempt: {self._last}. "
            "Restart the teacher, or raise that timeout to ride out longer outages", grpc.StatusCode.UNAVAILABLE))
        return False

    def attempt_failed(self, error: Exception) -> float | None:
        """A join attempt failed: the pause before the next one, or None.

        None when retrying would not change the answer (a different model, a wrong token:
        the client breaks) or when the client was closed meanwhile. The pause never goes
        past the deadline.
        """
        if self.state is not State.REJOINING:
            return None
        if not worth_retrying(error):
            what = f"joining teacher {self.address} again after it was lost ({self.cause})"
            self._break(type(error)(f"{what}: {error}", error.code) if isinstance(error, TeacherError)
                        else TeacherError(f"{what}: {type(error).__name__}: {error}"))
            return None
        self._last = error
        pause_s = min(max(0.0, self.deadline - self._clock()), self._delay_s * self._jitter(0.5, 1.0))
        self._delay_s = min(2 * self._delay_s, RECONNECT_MAX_DELAY_S)
        return pause_s

    def rejoined(self, session) -> bool:
        """REJOINING → CONNECTED with `session` current. False when the client was closed meanwhile:
        the caller then gives `session` up."""
        if self.state is not State.REJOINING:
            return False
        self.state, self.session, self.cause, self.deadline = State.CONNECTED, session, None, None
        return True

    def not_to_resubmit(self, undelivered: Iterable[int]) -> dict[int, BatchNotServed]:
        """Of the `undelivered` batches a new session is about to get, those that fail instead.

        A batch fails once the sessions that ended while holding it number more than
        max_resubmits: sending it again would most likely end the next one too. The history of
        every other batch is kept; that of a batch no longer undelivered is dropped.
        """
        undelivered = set(undelivered)
        self._losses = {batch_id: losses for batch_id, losses in self._losses.items() if batch_id in undelivered}
        hopeless = {batch_id: losses for batch_id, losses in self._losses.items()
                    if len(losses) > self.max_resubmits}
        for batch_id in hopeless:
            del self._losses[batch_id]
        return {batch_id: BatchNotServed(
            f"batch {batch_id} was sent to teacher {self.address} {len(losses)} times (max_resubmits="
            f"{self.max_resubmits}, the trainer's --teacher-max-resubmits) and every session it was sent to ended "
            "before its outputs came, so the teacher most likely cannot serve this batch (see its log). Why each "
            "ended: " + "; ".join(f"({i}) {loss}" for i, loss in enumerate(losses, 1)))
            for batch_id, losses in hopeless.items()}

    # ---- the end -----------------------------------------------------------------

    def close(self) -> bool:
        """Any state → CLOSED. False when it was closed already."""
        if self.state is State.CLOSED:
            return False
        if self.state is State.CONNECTED:
            self._closed_while_serving = self.session
        self.state = State.CLOSED
        return True

    def _break(self, error: TeacherError) -> None:
        self.state, self.error = State.BROKEN, error
