"""Sessions' lifecycle: admission, leases, ending, and the sessions that recently ended.

A session is admitted at its Join (connecting), becomes ready once delivery formed its
group, may drain on Leave, and ends once: it left, its lease ran out, its group never
formed within --join-timeout-s, or the teacher shut down. Ending drops its queue, aborts
its group, deletes its rendezvous keys and forgets its metrics; why it ended is kept for
the latest ENDED_SESSIONS_KEPT sessions, so that a student told NOT_FOUND learns why.

The engine (teacher_server/engine.py) owns the condition this shares: it guards the
sessions and the scheduler both, and the engine thread waits on it for work to plan.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

from teacher_server.delivery import Delivery
from teacher_server.errors import NotFound, Unavailable
from teacher_server.metrics import Metrics
from teacher_server.scheduler import Scheduler
from teacher_server.sessions import Batch, Session

log = logging.getLogger(__name__)

# Why a session ended, kept for this many ended sessions: a student told NOT_FOUND learns why.
ENDED_SESSIONS_KEPT = 1024


class SessionLifecycle:
    """The live sessions, from admission to their end; called by the gRPC handlers (through the
    engine), by delivery (`formed`, `sent`, `failed`, `end`) and by the engine thread (`expire_leases`)."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, cond: threading.Condition, *,
                 accepting: Callable[[], bool], lease_s: float, join_timeout_s: float):
        self.scheduler = scheduler
        self.metrics = metrics
        self.delivery: Delivery | None = None  # set by the engine (`attach`): delivery calls back here
        self._accepting = accepting
        self.lease_s = lease_s
        self.join_timeout_s = join_timeout_s  # a session still connecting after this long is ended
        self._sessions: dict[str, Session] = {}
        # Session id -> (its secret, its job, why it ended), the latest ones: only a caller that
        # could have acted on the session is told why it ended (TeacherService.session_for).
        self._ended: OrderedDict[str, tuple[str, str, str]] = OrderedDict()
        self._cond = cond  # the engine's: guards the sessions and the scheduler
        self._next_lease_check = 0.0  # monotonic time of the next look for expired leases

    def attach(self, delivery: Delivery) -> None:
        self.delivery = delivery

    # ---- from the gRPC handlers: validate-free, quick ---------------------------------

    def admit(self, session: Session, max_job_sessions: int = 0, job_limit: str = "") -> None:
        """Admits a session; `max_job_sessions` (0: none) caps its job's sessions, `job_limit` says where it is set."""
        with self._cond:
            if not self._accepting():
                raise Unavailable("the teacher is shutting down or unhealthy; join another replica or retry later")
            self.scheduler.admit(session, max_job_sessions, job_limit)
            self._sessions[session.session_id] = session
        self.metrics.sessions_joined.inc()
        self.metrics.sessions_connected.inc()
        self.delivery.connect(session)

    def check_room(self, job_id: str, weight: float, max_job_sessions: int = 0, job_limit: str = "") -> None:
        """Refuses, as `admit` would, a session of `job_id` that would not be admitted now; the
        cheap check a Join makes before any work of its own (admit checks again)."""
        with self._cond:
            if not self._accepting():
                raise Unavailable("the teacher is shutting down or unhealthy; join another replica or retry later")
            self.scheduler.check_room(job_id, weight, max_job_sessions, job_limit)

    def session(self, session_id: str) -> Session:
        with self._cond:
            session = self._sessions.get(session_id)
        if session is None or not session.alive:
            raise NotFound(f"session {session_id!r} is unknown or has ended; join again")
        return session

    def ended(self, session_id: str) -> tuple[str, str, str] | None:
        """(secret, job id, why it ended) of a recently ended session; None if unknown or live."""
        with self._cond:
            return self._ended.get(session_id)

    def heartbeat(self, session: Session) -> None:
        session.last_heartbeat = time.monotonic()

    def leave(self, session: Session, drain: bool) -> None:
        with self._cond:
            if drain and session.inflight and session.state == "ready":
                session.state = "draining"  # ended once the last batch is sent (`sent`)
                return
        self.end(session, "left")

    def sessions(self) -> list[Session]:
        with self._cond:
            return [s for s in self._sessions.values() if s.alive]

    def drain(self, timeout_s: float) -> bool:
        """Waits until every submitted batch is sent; True when it finished in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(s.inflight for s in self._sessions.values() if s.state in ("ready", "draining")):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def queue_depth(self) -> int:
        with self._cond:
            return self.scheduler.queue_depth()

    def update_queue_depth(self) -> None:
        self.metrics.queue_depth.set(self.queue_depth())

    # ---- from delivery and the engine thread -------------------------------------------

    def formed(self, session: Session) -> bool:
        """Its group formed: the session's batches may be planned. False when it ended meanwhile."""
        with self._cond:
            if not session.alive:
                return False
            session.state = "ready"
            session.last_heartbeat = time.monotonic()
            self.metrics.session_connect_seconds.observe(session.last_heartbeat - session.created)
            self.scheduler.ready(session)
            self._cond.notify_all()
        log.info("session %s ready: job %s rank %d, %s", session.session_id, session.job_id, session.job_rank,
                 session.backend, extra={"session_id": session.session_id, "job_id": session.job_id})
        return True

    def sent(self, session: Session, batch: Batch, nbytes: int) -> None:
        """One batch's outputs reached the student; a draining session ends with its last."""
        labels = (session.session_id, session.job_id)
        with self._cond:
            session.batches_sent += 1
            session.tokens_served += batch.tokens
            session.bytes_sent += nbytes
            self.scheduler.sent(session, batch)
            finished = session.state == "draining" and session.inflight == 0
            self._cond.notify_all()
        self.metrics.batches.labels(*labels).inc()
        self.metrics.tokens.labels(*labels).inc(batch.tokens)
        self.metrics.bytes_sent.labels(*labels).inc(nbytes)
        self.metrics.inflight.labels(*labels).set(session.inflight)
        if finished:
            self.end(session, "left")

    def failed(self, session: Session, batch: Batch) -> None:
        """One batch of the session will never be sent (Delivery.fail): it is no longer in flight."""
        with self._cond:
            session.batches_failed += 1
            self.scheduler.sent(session, batch)
            finished = session.state == "draining" and session.inflight == 0
            self._cond.notify_all()
        self.metrics.batches_failed.inc()
        self.metrics.inflight.labels(session.session_id, session.job_id).set(session.inflight)
        if finished:
            self.end(session, "left")

    def released(self, session: Session, batch: Batch) -> None:
        """Delivery let go of the outputs of a batch of an ended session: no longer held."""
        with self._cond:
            self.scheduler.sent(session, batch)
            self._cond.notify_all()

    def end(self, session: Session, reason: str, failure: str = "") -> None:
        """Ends a session: drops its queue, aborts its group, deletes its rendezvous keys, forgets its metrics."""
        with self._cond:
            if not session.alive:
                return
            session.state = "closed" if reason == "left" else "failed"
            session.failure = failure
            self.scheduler.remove(session)
            self._sessions.pop(session.session_id, None)
            self._ended[session.session_id] = (session.secret, session.job_id,
                                               f"{reason}: {failure}" if failure else reason)
            while len(self._ended) > ENDED_SESSIONS_KEPT:
                self._ended.popitem(last=False)
            self._cond.notify_all()
        self.delivery.close(session)
        session.rendezvous.close()
        session.outbox.close()
        self.metrics.sessions_connected.dec()
        self.metrics.sessions_ended.labels(reason).inc()
        self.metrics.forget_session(session.session_id, session.job_id)
        self.update_queue_depth()
        log.info("session %s ended: %s%s", session.session_id, reason, f" ({failure})" if failure else "",
                 extra={"session_id": session.session_id, "job_id": session.job_id})

    def expire_leases(self) -> None:
        """Ends sessions whose lease ran out, and those still connecting after --join-timeout-s.

        Called by the engine thread holding the condition. Sessions still connecting hold a
        --max-sessions slot without a student behind them: a join whose group never forms (a
        crashed student, or joins made only to fill the teacher). The group formation has
        waits of its own; this bounds the whole of it from the Join.
        """
        now = time.monotonic()
        # Also called before every plan: a teacher kept busy by some students must still
        # drop a frozen one on time. Twice a second is often enough.
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + 0.5
        for session in list(self._sessions.values()):
            if session.state in ("ready", "draining") and now - session.last_heartbeat > self.lease_s:
                reason, failure = "expired", f"no heartbeat for {self.lease_s:.0f}s"
            elif session.state == "connecting" and now - session.created > self.join_timeout_s:
                reason, failure = "join_timeout", (f"its process group did not form within --join-timeout-s "
                                                   f"{self.join_timeout_s:g} of its Join")
            else:
                continue
            threading.Thread(target=self.end, args=(session, reason, failure),
                             name=f"expire-{session.session_id}", daemon=True).start()
