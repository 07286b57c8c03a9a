"""One session seen from the student: from a streamed batch to its received outputs.

Every Join makes a Session: the session group, the submit stream and three threads.

- read-submit-answers: reads what the teacher says on the submit stream
  (distill_common/announcements.py): refusals (the client joins with
  stream_refusals_only, so accepted batches get no answer) and failures, each failing its
  batch's future, and announcements, each telling the post-receives thread to go on.
- post-receives: for each streamed batch in order, waits for the teacher's word on it;
  once announced, allocates its header and output buffers and posts its receives; the
  teacher's sends land in them in submit order.
- complete-receives: waits for each batch's receives with a deadline (transfer_timeout_s),
  checks its header (the batch's wire id and the digest of what was sent under it: a
  mismatch fails the session, whose batches are sent again to a new one, and never
  resolves a future with another batch's outputs), assembles its TeacherOutput and hands
  it to be resolved.

A thread that fails hands its error to `on_failure`; the client decides what that leads to
(student_trainer/connection.py). Results and refusals go to `resolve`, which delivers
only what the current session sends (Link.resolve, the one place a future is
resolved). When the teacher goes away the session is stopped: its stream is cancelled,
its group aborted, and whatever its threads still finish is dropped. The client joins
again as a new Session with threads of its own, so a thread stuck on the old teacher
holds nothing up.
"""

from __future__ import annotations

import functools
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from distill_common import tracing, wire
from distill_common.announcements import ANNOUNCED, SETTLED, Board
from distill_common.outputs import JoinData, OutputRequest, TeacherOutput
from distill_common.proto.teacher.v1 import teacher_pb2 as pb
from distill_common.session_group import HEADER_LAYOUT, HeaderMismatch, SessionGroup, TransferError
from student_trainer.errors import (BatchFailed, OutOfStep, TeacherError, TeacherUnavailable, TransferFailed,
                                    from_rpc_error, from_status)

_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class Batch:
    """One submitted batch, from `submit` until its future is resolved (exactly once).

    Keeps its encoded request: after a teacher restart it is sent again, to the new session.
    """

    batch_id: int  # the client's own id: 0, 1, 2, ... in submit order, across reconnects
    shape: tuple[int, int]
    request: pb.SubmitRequest  # the ids and the mask; session_id and batch_id are set per session
    future: Future

    @functools.cached_property
    def key(self) -> bytes:
        """The batch key the teacher computes from the request (its header carries 16 bytes of it)."""
        mask = self.request.attention_mask if self.request.HasField("attention_mask") else None
        return wire.request_key(self.request.input_ids, mask)


@dataclass
class _Pending:
    """A batch sent on one session: its id on that session's wire and its receives."""

    batch: Batch
    wire_id: int  # SubmitRequest.batch_id on this session: 0, 1, 2, ... from its Join
    buffers: list[torch.Tensor] = field(default_factory=list)  # the header's, then the outputs'
    works: list = field(default_factory=list)

    @property
    def batch_id(self) -> int:
        return self.batch.batch_id

    @property
    def shape(self) -> tuple[int, int]:
        return self.batch.shape


class Session:
    """One Join: its group, its submit stream, and the threads that receive its batches' outputs."""

    def __init__(self, joined: pb.JoinResponse, group: SessionGroup, outputs: OutputRequest, address: str, *,
                 on_failure: Callable[["Session", TeacherError], None], resolve: Callable[..., bool]):
        """`on_failure(session, error)`: a thread of this session failed.
        `resolve(batch, session, result=..., error=...)`: a batch's outcome."""
        self.joined = joined
        self.session_id = joined.session_id
        self.group = group
        self.outputs = outputs  # what each batch's receives hold, in wire order
        self.joined_data = JoinData()  # what the kinds sent once, right after the handshake
        self.address = address
        self.threads: list[threading.Thread] = []
        # The teacher answers only refused batches (else every batch) on the submit stream.
        self.refusals_only = joined.stream_refusals_only
        self._board = Board()  # the teacher's word on each batch, from the stream to the post-receives thread
        self._on_failure = on_failure
        self._resolve = resolve
        self._transfer_timeout_s = 0.0  # set by start
        self._responses = None  # the SubmitStream call
        self._requests: queue.Queue = queue.Queue()  # what the submit stream sends; None ends it
        self._to_receive: queue.Queue = queue.Queue()  # to wait for, in order; receives not yet posted
        self._posted: queue.Queue = queue.Queue()  # receives posted, in order; None: no more
        self._lock = threading.Lock()  # the wire ids, what awaits an answer, stopping
        self._sent: dict[int, _Pending] = {}  # by wire id: streamed, no word on it yet
        self._next_wire_id = 0
        self._stopped = False

    def start(self, open_stream: Callable, transfer_timeout_s: float) -> None:
        """Opens the submit stream with `open_stream(requests)` and starts the threads (unless stopped)."""
        with self._lock:
            if self._stopped:
                return
            self._transfer_timeout_s = transfer_timeout_s
            self._responses = open_stream(self._request_stream())
            short = self.session_id[:8]
            self.threads = [
                threading.Thread(target=self._read_answers, name=f"read-submit-answers-{short}", daemon=True),
                threading.Thread(target=self._post_announced, name=f"post-receives-{short}", daemon=True),
                threading.Thread(target=self._complete_receives, name=f"complete-receives-{short}", daemon=True)]
        for thread in self.threads:
            thread.start()

    def send(self, batch: Batch) -> None:
        """Puts `batch` on the stream under the session's next wire id."""
        request = batch.request
        if request.session_id:  # sent before, to a session since lost, whose stream may still read it
            request = pb.SubmitRequest()
            request.CopyFrom(batch.request)
        request.session_id = self.session_id
        with self._lock:  # wire ids and the stream in one order
            request.batch_id = self._next_wire_id
            pending = self._sent[self._next_wire_id] = _Pending(batch, self._next_wire_id)
            self._next_wire_id += 1  # used up, accepted or refused (see SubmitRequest.batch_id)
            self._requests.put(request)
        self._to_receive.put(pending)  # its receives are posted once the teacher announces it

    def finish(self) -> None:
        """No more batches: the stream ends, and the threads end once what was posted is received."""
        self._requests.put(None)
        self._to_receive.put(None)

    def stop(self) -> None:
        """Ends the stream and the threads and frees the group, without waiting for the teacher."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._requests.put(None)
        self._to_receive.put(None)
        self._posted.put(None)
        self._board.close()  # the post-receives thread's wait returns
        if self._responses is not None:
            self._responses.cancel()
        self.group.abort()  # a receive blocked on the old teacher returns

    def join(self, timeout_s: float) -> None:
        """Joins the threads, each for at most `timeout_s`."""
        for thread in self.threads:
            thread.join(timeout=timeout_s)

    # ---- the submit stream -------------------------------------------------------

    def _request_stream(self):
        while True:
            request = self._requests.get()
            if request is None:
                return
            tracing.mark("s_yield", request.batch_id)
            yield request

    def _read_answers(self) -> None:
        """Reads what the teacher says on the stream, in order: answers to the streamed batches
        (every batch's, or only the refused ones': refusals_only) and events on earlier ones."""
        what = f"the submit stream to teacher {self.address}"
        try:
            for response in self._responses:
                if response.HasField("events"):
                    if not self._heard(response.events):
                        return
                    continue
                with self._lock:
                    pending = self._sent.pop(response.batch_id, None) if response.error_code else \
                        self._sent.get(response.batch_id)
                if pending is None:
                    self._protocol_error(f"answered batch {response.batch_id}, which awaits no answer")
                    return
                tracing.mark("s_ack", pending.wire_id)
                if not response.error_code:
                    continue  # accepted: its announcement comes as an event
                self._board.tell(pending.wire_id, SETTLED)
                code = _STATUS_BY_NUMBER.get(response.error_code, grpc.StatusCode.UNKNOWN)
                error = from_status(code, response.error_message, f"Submit to teacher {self.address}")
                if code == grpc.StatusCode.NOT_FOUND:  # the teacher no longer knows this session
                    self._on_failure(self, error)
                    return
                self._resolve(pending.batch, self, error=error)
            error = TeacherUnavailable(f"{what} ended: the teacher closed it", grpc.StatusCode.UNAVAILABLE)
        except grpc.RpcError as e:
            error = from_rpc_error(e, what)
        self._on_failure(self, error)

    def _heard(self, events: pb.BatchEvents) -> bool:
        """Passes the events on (announced: to the post-receives thread; failed: to the batch's
        future). False when one names a batch that awaits no word: the session failed."""
        for wire_id in events.announced:
            with self._lock:
                pending = self._sent.pop(wire_id, None)
            if pending is None:
                self._protocol_error(f"announced batch {wire_id}, which awaits no word")
                return False
            self._board.tell(wire_id, ANNOUNCED)
        for failure in events.failed:
            with self._lock:
                pending = self._sent.pop(failure.batch_id, None)
            if pending is None:
                self._protocol_error(f"failed batch {failure.batch_id}, which awaits no word")
                return False
            self._board.tell(failure.batch_id, SETTLED)
            self._resolve(pending.batch, self, error=BatchFailed(
                f"teacher {self.address} could not compute batch {pending.batch_id}: {failure.reason}"))
        return True

    def _protocol_error(self, what: str) -> None:
        self._on_failure(self, TeacherError(
            f"the submit stream to teacher {self.address} {what} (client and teacher disagree on the protocol: run "
            "the same version on both sides)"))

    # ---- receiving ---------------------------------------------------------------

    def _post_announced(self) -> None:
        """Posts each batch's receives, in order, once the teacher announced its sends."""
        try:
            while True:
                pending = self._to_receive.get()
                if pending is None or self._stopped:
                    return
                try:
                    word = self._board.await_word(pending.wire_id, self._transfer_timeout_s)
                    if word is None or self._stopped:
                        return
                    if word == SETTLED:
                        continue  # refused or failed: the answer reader failed its future with the reason
                    tracing.mark("s_announced", pending.wire_id)
                    self._post_receives(pending)
                    tracing.mark("s_posted", pending.wire_id)
                except Exception as e:
                    self._on_failure(self, TransferFailed(f"receiving batch {pending.batch_id}: {e}"))
                    return
                self._posted.put(pending)
        finally:
            self._posted.put(None)  # what was posted is still received

    def _post_receives(self, pending: _Pending) -> None:
        # On a stream of the group's own (NCCL): see SessionGroup.post_receives.
        pending.buffers, pending.works = self.group.post_receives([HEADER_LAYOUT, *self.outputs.layout(*pending.shape)])

    def _complete_receives(self) -> None:
        """Waits for each batch's receives, in order, with a deadline, and hands its outputs to be resolved."""
        while True:
            pending = self._posted.get()
            if pending is None or self._stopped:
                return
            try:
                for work in pending.works:
                    self.group.wait(work, self._transfer_timeout_s, what=f"receiving batch {pending.batch_id}")
                tracing.mark("s_received", pending.wire_id)
                # Before anything received is used: it must be this batch's.
                self.group.check_header(pending.buffers[0], pending.wire_id, pending.batch.key)
                result = self._assemble(pending)
            except HeaderMismatch as e:
                self._on_failure(self, OutOfStep(f"teacher {self.address}, session {self.session_id}: {e}"))
                return
            except TransferError as e:
                self._on_failure(self, TransferFailed(f"{e}; the teacher may have dropped this session (see its log)"))
                return
            self._resolve(pending.batch, self, result=result)
            tracing.mark("s_resolved", pending.wire_id)

    def _assemble(self, pending: _Pending) -> TeacherOutput:
        tensors = self.group.delivered(pending.buffers[1:])  # on the client's device, for the training loop's stream
        return self.outputs.assemble(pending.batch_id, tensors)  # the client's id, not the session's wire id
