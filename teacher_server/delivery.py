"""Delivery: the teacher's end of every session's data plane.

For each session, a thread forms its group on the session's own rendezvous store
(blocking until the student's end comes, which reaches that store only over gRPC with
the session's secret) and checks that the peer that formed it is the student that
joined (`handshake`), and sends what the session's kinds send once at join (the
output head); then a sender thread waits, in order and with a deadline, for
each batch's sends to complete, so a slow or dead student holds up nobody but itself.
The engine hands over each forward's outputs (`deliver`): they are derived per session
and their sends posted at once, each batch's header first, and one announcer thread
tells the students, on their submit streams, once the device finished the forward.

What the engine decides stays with the engine: it is told when a group formed
(`formed`), when a batch finished sending (`sent`) or will never be sent (`failed`), when
delivery let go of the outputs of a batch of a session that ended (`released`: the engine
counts them as held until then), and asked to end a session whose transfer failed (`end`).

A batch that cannot be served (its forward failed, or deriving its outputs did) fails
alone, through `fail`: its student is told the reason on the submit stream, nothing of
it is sent, and the session goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distill_common import tracing
from distill_common.outputs import BatchOutputs, JoinData, TensorSpec
from distill_common.session_group import TEACHER_RANK, SessionGroup, TransferError, build_group, handshake
from teacher_server.metrics import Metrics
from teacher_server.session_process import IsolatedGroup
from teacher_server.sessions import Batch, Session

log = logging.getLogger(__name__)


class _Tensors:
    """A list of tensors that a weak reference can point at."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors


class SharedTensors:
    """Tensors made once per key and shared while anyone holds them: `get` returns the holder
    of a live copy, or makes one; the copy is freed when its last holder drops it."""

    def __init__(self):
        self._copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, key, make: Callable[[], list[torch.Tensor]]) -> _Tensors:
        with self._lock:  # one maker per key: two joins at once must not both make a 2 GiB copy
            held = self._copies.get(key)
            if held is None:
                held = self._copies[key] = _Tensors(make())
            return held


@dataclass
class _Link:
    """A formed session: its group and the queue of its sender thread."""

    group: SessionGroup | IsolatedGroup
    sends: queue.Queue  # _SendJob, then None to stop


@dataclass
class _SendJob:
    batch: Batch
    works: list
    tensors: list  # held until the sends complete: NCCL reads them asynchronously
    nbytes: int


@dataclass
class _Launched:
    """A forward whose sends are posted; its batches are announced once the device finished it."""

    start: float
    tokens: int
    finished: object  # a torch.cuda.Event recorded after the forward and the sends' inputs; None on CPU
    announcements: list  # (session, batch_id)


class Delivery:
    def __init__(self, metrics: Metrics, *, advertise_host: str, device: torch.device,
                 join_timeout_s: float, transfer_timeout_s: float, join_data: JoinData, isolate: bool,
                 formed: Callable[[Session], bool], sent: Callable[[Session, Batch, int], None],
                 failed: Callable[[Session, Batch], None], released: Callable[[Session, Batch], None],
                 end: Callable[..., None]):
        self.metrics = metrics
        self.advertise_host = advertise_host
        self.device = device
        self.join_timeout_s = join_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.join_data = join_data  # what the model offers a session once, at join
        self.isolate = isolate  # each session's end of its group in a process of its own (session_process.py)
        self._formed = formed  # (session) -> False when it ended meanwhile
        self._sent = sent  # (session, batch, bytes sent)
        self._failed = failed  # (session, batch): accepted, never sent
        self._released = released  # (session, batch): the session ended; its outputs are no longer held here
        self._end = end  # (session, reason, failure)
        self._links: dict[str, _Link] = {}
        self._forming: dict[str, IsolatedGroup] = {}  # by session id: groups whose transport process forms them
        self._lock = threading.Lock()
        self._join_tensors = SharedTensors()
        self._launched: queue.Queue = queue.Queue()
        self._announcer = threading.Thread(target=self._announce_loop, name="announce-forwards", daemon=True)

    def start(self) -> None:
        self._announcer.start()

    def stop(self) -> None:
        """Announces what was launched, then stops the announcer; ends the groups still forming."""
        self._launched.put(None)
        self._announcer.join(timeout=10)
        with self._lock:
            forming = list(self._forming.values())
        for group in forming:
            group.abort()
        for group in forming:  # their threads out of the store's C++ before the interpreter exits
            group.join(timeout_s=1.0)

    # ---- session groups ----------------------------------------------------------

    def connect(self, session: Session) -> None:
        if session.local_group is not None:  # an HTTP API session (teacher_server/openai/): no group to form
            self._link(session, session.local_group)
            return
        threading.Thread(target=self._form_group, args=(session,), name=f"form-group-{session.session_id}",
                         daemon=True).start()

    def _form_group(self, session: Session) -> None:
        """Builds the teacher's end of the session group (blocks until the student's end)."""
        group = None
        try:
            # On the session's own store, in this process: nobody but the student that got
            # the session's secret at Join wrote the keys it forms from. The peer that formed
            # it proves it is that student (the teacher refuses it otherwise).
            if self.isolate:  # what the peer writes is read by a process that may die alone
                group = IsolatedGroup(session.rendezvous.store, session_id=session.session_id,
                                      backend=session.backend, device=self.device, timeout_s=self.join_timeout_s,
                                      transfer_timeout_s=self.transfer_timeout_s, gloo_host=self.advertise_host,
                                      secret=session.secret.encode())
                with self._lock:  # a session ended while its group forms aborts it (close)
                    self._forming[session.session_id] = group
                if not session.alive:  # ended before it was registered
                    group.abort()
                try:
                    group.wait_formed(2 * self.join_timeout_s)  # the store wait, then the handshake
                finally:
                    with self._lock:
                        self._forming.pop(session.session_id, None)
            else:
                group = build_group(session.rendezvous.store, backend=session.backend, rank=TEACHER_RANK,
                                    device=self.device, timeout_s=self.join_timeout_s, gloo_host=self.advertise_host)
                handshake(group, session.secret.encode(), self.join_timeout_s)
            self._send_join_data(session, group)
        except Exception as e:
            if group is not None:
                group.abort()
            log.warning("session %s (job %s rank %d) did not connect: %s", session.session_id, session.job_id,
                        session.job_rank, e)
            self._end(session, "join_failed", f"the session group did not form: {e}")
            return
        self._link(session, group)

    def _link(self, session: Session, group) -> None:
        """The session's group formed: batches may be planned for it, and its sender thread runs."""
        link = _Link(group, queue.Queue())
        # Linked before the engine may plan the session's batches, so that none is
        # delivered to a session without a link.
        with self._lock:
            self._links[session.session_id] = link
        if not self._formed(session):  # left or expired while connecting
            self.close(session)
            return
        threading.Thread(target=self._send_loop, args=(session, link), name=f"send-to-{session.session_id}",
                         daemon=True).start()

    def _send_join_data(self, session: Session, group: SessionGroup | IsolatedGroup) -> None:
        """Sends what the session's kinds send once (the output head), before any batch.

        Sessions joining at once that ask for the same join-time outputs in the same dtype over
        the same transport send one copy (a float32 head of a bfloat16 128k-vocabulary teacher is
        2 GiB: one per session would let joins exhaust the device), freed once none is sending it."""
        asking = tuple(kind for kind in session.outputs if kind.join_layout(session.outputs.teacher,
                                                                           session.outputs.dtype))
        if not asking:
            return
        key = (asking, session.outputs.dtype, group.tensor_device)
        shared = self._join_tensors.get(key, lambda: group.to_send(session.outputs.join_derive(self.join_data)))
        tensors = shared.tensors
        try:
            for work in group.send_all(tensors):
                group.wait(work, self.join_timeout_s, what="sending the join-time outputs (the output head)")
        except BaseException:
            group.abort()
            raise
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        session.bytes_sent += nbytes  # no batch is sent before the group is linked: no race with `sent`
        self.metrics.bytes_sent.labels(session.session_id, session.job_id).inc(nbytes)
        log.info("session %s: sent %.1f MiB of join-time outputs", session.session_id, nbytes / 2**20)

    def close(self, session: Session) -> None:
        """Stops the session's sender and aborts its group, also one still forming."""
        with self._lock:
            link = self._links.pop(session.session_id, None)
            forming = self._forming.get(session.session_id)  # _form_group forgets it, stop joins it
        if forming is not None:
            forming.abort()
        if link is None:
            return
        link.sends.put(None)
        # Aborting never waits for the peer, which may be dead; other groups are untouched.
        link.group.abort()

    def fail(self, session: Session, batch: Batch, reason: str) -> None:
        """Fails one batch of the session, and nothing else: its student's future for it
        raises BatchFailed with `reason`, and the session goes on.

        For a batch the engine planned whose sends were never posted (none of them: the
        student posts no receive for it, and the next batch's outputs must come next on
        the group), and that was not announced.
        """
        if batch.handed:  # e.g. a step that failed after posting its sends: announced or failed already
            log.warning("session %s: batch %d failed after it was handed over, not failed again: %s",
                        session.session_id, batch.batch_id, reason)
            return
        batch.handed = True
        log.warning("session %s (job %s): batch %d failed: %s", session.session_id, session.job_id, batch.batch_id,
                    reason, extra={"session_id": session.session_id, "job_id": session.job_id})
        session.outbox.fail(batch.batch_id, reason)
        self._failed(session, batch)

    # ---- sends ---------------------------------------------------------------------

    def deliver(self, served: list[tuple[Session, Batch, BatchOutputs]], start: float, tokens: int) -> None:
        """Posts the sends of one forward's batches, each from the outputs it is served from.

        Does not wait for the device: the engine goes on to pack and launch the next
        forward while this one runs, and the announcer thread tells the students.
        `start` and `tokens` (0: no forward ran) are for the busy clock.
        """
        derived: dict = {}  # what sessions that share a batch and ask the same get, computed once
        announcements = [self._send(session, batch, out, derived) for session, batch, out in served]
        finished = None
        if self.device.type == "cuda":
            finished = torch.cuda.Event()
            # On the model's device: this thread's current device may be another one.
            finished.record(torch.cuda.current_stream(self.device))
        self._launched.put(_Launched(start, tokens, finished, [a for a in announcements if a is not None]))

    def _send(self, session: Session, batch: Batch, out: BatchOutputs, derived: dict):
        """Derives what this session asked for from the batch's outputs and posts the sends.

        `derived` holds what this forward already derived, by (outputs, request, transport, and
        the batch itself when it carries data): sessions that share a batch and ask the same are
        sent the same tensors.
        Returns what the announcer needs once the forward is done: (session, batch id),
        or None when the session ended meanwhile.
        """
        with self._lock:
            link = self._links.get(session.session_id)
        if link is None:  # ended meanwhile: nothing of it is sent
            self._released(session, batch)
            return None
        # A batch that carries data of its own (ids to score) is derived for itself: an equal
        # request on identical ids and mask does not make equal tensors then.
        key = (id(out), session.outputs, session.backend, id(batch) if session.outputs.reads_batch_data else None)
        tensors = derived.get(key)
        try:
            if tensors is None:
                tensors = derived[key] = link.group.to_send(_derive(session, batch, out))
        except Exception as e:  # e.g. out of memory: this batch of this session fails, nothing else
            log.exception("deriving the outputs of batch %d of session %s failed", batch.batch_id, session.session_id)
            self.fail(session, batch, f"deriving its outputs ({session.outputs}) failed: {type(e).__name__}: {e}")
            return None
        batch.handed = True
        try:
            # The header first: the student checks it names this batch before using what follows.
            works = link.group.send_batch(batch.batch_id, batch.header_key, tensors)
        except Exception as e:
            self._end(session, "transfer_failed", f"posting the send of batch {batch.batch_id} failed: {e}")
            self._released(session, batch)
            return None
        tracing.mark("t_forward", batch.batch_id)
        link.sends.put(_SendJob(batch, works, tensors, sum(t.numel() * t.element_size() for t in tensors)))
        # Announced by the announcer thread, not the sender thread (busy waiting for the
        # previous batch): the student posts this batch's receives as soon as the forward
        # is done, so consecutive transfers run back to back.
        return session, batch.batch_id

    def _send_loop(self, session: Session, link: _Link) -> None:
        """Waits, in order, for each batch's sends to complete; fails the session on timeout.
        Once it ends, the batches not sent are released: their tensors are dropped here."""
        while True:
            job = link.sends.get()
            if job is None:
                self._release_queued(session, link)  # posted after the stop, as the session ended
                return
            tracing.mark("t_watch", job.batch.batch_id)
            try:
                for work in job.works:
                    link.group.wait(work, self.transfer_timeout_s, what=f"sending batch {job.batch.batch_id}")
            except TransferError as e:
                log.warning("session %s: %s", session.session_id, e)
                self._end(session, "transfer_failed", str(e))
                batch = job.batch
                del job
                self._released(session, batch)
                self._release_queued(session, link)
                return
            tracing.mark("t_sent", job.batch.batch_id)
            batch, nbytes = job.batch, job.nbytes
            del job  # NCCL is done with the tensors: free them before whatever `sent` does
            self._sent(session, batch, nbytes)

    def _release_queued(self, session: Session, link: _Link) -> None:
        """Drops the send jobs left on an ended session's queue, each reported released."""
        while True:
            try:
                job = link.sends.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                batch = job.batch
                del job
                self._released(session, batch)

    # ---- announcements -------------------------------------------------------------

    def _announce_loop(self) -> None:
        """Announces each forward's batches once the device finished it, in launch order.

        Announcing only then keeps a student's receive from being posted while the teacher
        still computes: a posted NCCL receive spins on the student's GPU, taking SMs from
        its training for as long as it waits. This thread also keeps the forward clock:
        a forward is busy from its launch (or the end of the one before, as they queue on
        one stream) until the device finished it.
        """
        previous_end = 0.0
        while True:
            launched = self._launched.get()
            if launched is None:
                return
            start = max(launched.start, previous_end)
            counted = launched.tokens > 0  # 0: outputs all from the cache, no forward ran
            if counted:
                self.metrics.forward_started(start)
            try:
                if launched.finished is not None:
                    launched.finished.synchronize()  # the GIL is released while the device works
            except Exception as e:  # a device error: those sessions fail; the engine's next forward says more
                if counted:
                    self.metrics.forward_failed(start, time.monotonic())
                for session, _ in launched.announcements:
                    self._end(session, "forward_failed", f"the teacher's forward failed on the device: {e}")
                continue
            if counted:
                previous_end = time.monotonic()
                self.metrics.record_forward(start, previous_end, launched.tokens)
            # One event per session for the whole forward: each costs its stream a response.
            by_session: dict[str, tuple[Session, list[int]]] = {}
            for session, batch_id in launched.announcements:
                by_session.setdefault(session.session_id, (session, []))[1].append(batch_id)
            for session, batch_ids in by_session.values():
                session.outbox.announce(batch_ids)
                for batch_id in batch_ids:
                    tracing.mark("t_announced", batch_id)


class OutputMismatch(RuntimeError):
    """Derived outputs differ from the layout the student received them into."""


def _derive(session: Session, batch: Batch, out: BatchOutputs) -> list[torch.Tensor]:
    """The session's tensors for `batch`, checked against the layout its student allocates.

    A tensor of another shape or dtype would not fail on its own: the student's receive
    would take the wrong bytes, or wait for bytes that never come, and the session group
    would be lost; the batch fails here instead, with what differs.
    """
    tensors = session.outputs.derive(out, batch)
    expected = session.outputs.layout(*batch.layout_shape)
    got = [TensorSpec(tuple(t.shape), t.dtype) for t in tensors]
    if got != expected:
        raise OutputMismatch(f"the forward gave tensors {got}, the student receives {expected}")
    return tensors
