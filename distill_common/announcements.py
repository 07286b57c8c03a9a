"""What became of each batch: announced, failed or refused, told on the session's submit stream.

Why: an NCCL receive posted before its send spins on the student's GPU, holding SMs its
training needs for as long as the teacher takes to compute the batch. So the student
posts a batch's receives only once the teacher has *announced* the batch: its outputs
exist and its sends are posted.

Where: on the session's `SubmitStream`, the authenticated (TLS-able) gRPC stream the
student submits its batches on. Only the teacher writes there, so nothing that decides
what the student receives comes from anyone else (a store that anyone on the network
could write to let a process with no token skip a student's receives, and the batches
after them resolved with the wrong outputs). Events name the batch by its id on the
session's wire (`SubmitRequest.batch_id`).

Who says what, for each batch the student streamed, exactly once:
- *announced* (teacher): the forward that computed it finished on the device and its
  sends are posted; the student posts its receives.
- *failed* (teacher, `Outbox.fail`): accepted, but it could not be computed or sent;
  nothing of it is on the data plane. The student fails that batch's future with the
  teacher's reason and posts no receive.
- *refused*: the answer to the request itself (`SubmitResponse.error_code`); nothing of
  it is on the data plane either.

Cost: each response written costs the teacher's serving thread about 110 µs of CPU
against 40 µs for a request only read (docs/performance.md). So events are coalesced:
the announcer hands over the batches of a forward together, and whatever a session has
pending when its stream is free goes out in one response (`Outbox.take`); the stream is
woken once when its outbox goes from empty to not empty, however many events follow.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from distill_common.proto.teacher.v1 import teacher_pb2 as pb

ANNOUNCED, SETTLED = "announced", "settled"  # settled: refused or failed, its future resolved with the reason


class NotAnnounced(RuntimeError):
    """A batch got no word in time: the teacher is stuck, or its stream is gone."""


class Outbox:
    """Teacher: one session's events waiting for its submit stream; any thread adds them.

    The first stream that attaches takes them (`take`); another is refused while it is
    attached. Events added before a stream attached wait for it; those of a session that
    ended are dropped (`close`).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._announced: list[int] = []
        self._failed: list[pb.BatchFailure] = []
        self._wake: Callable[[], None] | None = None  # the attached stream's
        self._closed = False

    def attach(self, wake: Callable[[], None]) -> bool:
        """A stream takes this session's events; `wake()` (thread-safe) when some are pending.
        False when another stream has them."""
        with self._lock:
            if self._wake is not None:
                return False
            self._wake = wake
            pending = bool(self._announced or self._failed)
        if pending:
            wake()
        return True

    def detach(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if self._wake is wake:
                self._wake = None

    def announce(self, batch_ids: Iterable[int]) -> None:
        """The batches' sends are posted and their outputs exist."""
        batch_ids = list(batch_ids)
        if batch_ids:
            self._add(lambda: self._announced.extend(batch_ids))

    def fail(self, batch_id: int, reason: str) -> None:
        """The batch was accepted but will never be sent."""
        self._add(lambda: self._failed.append(pb.BatchFailure(batch_id=batch_id, reason=reason)))

    def take(self) -> pb.SubmitResponse | None:
        """Everything pending, as one response (None: nothing)."""
        with self._lock:
            if not (self._announced or self._failed):
                return None
            events = pb.BatchEvents(announced=self._announced, failed=self._failed)
            self._announced, self._failed = [], []
        return pb.SubmitResponse(events=events)

    def close(self) -> None:
        """The session ended: pending and later events are dropped."""
        with self._lock:
            self._closed = True
            self._announced, self._failed = [], []

    def _add(self, add: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                return
            was_empty = not (self._announced or self._failed)
            add()
            wake = self._wake if was_empty else None
        if wake is not None:
            wake()


class Board:
    """Student: the word on each batch streamed, as the stream's reader hears it, for the
    thread that posts receives to wait on (in submit order)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._words: dict[int, str] = {}  # by wire id: heard, not yet waited for
        self._closed = False

    def tell(self, wire_id: int, word: str) -> None:
        with self._cond:
            self._words[wire_id] = word
            self._cond.notify_all()

    def await_word(self, wire_id: int, timeout_s: float) -> str | None:
        """ANNOUNCED or SETTLED once heard, and forgotten; None when the board was closed
        meanwhile (the session stopped). Raises NotAnnounced after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while wire_id not in self._words:
                remaining = deadline - time.monotonic()
                if self._closed:
                    return None
                if remaining <= 0:
                    raise NotAnnounced(f"the teacher said nothing of batch {wire_id} within {timeout_s:.0f}s "
                                       "(announced, failed or refused)")
                self._cond.wait(remaining)
            return self._words.pop(wire_id)

    def close(self) -> None:
        """Ends every wait, now and later."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
