"""Delivery: the teacher's end of every session's data plane.

For each session, a thread forms its group (blocking until the student's end comes),
then a sender thread waits, in order and with a deadline, for each batch's sends to
complete, so a slow or dead student holds up nobody but itself. The engine hands over
each forward's outputs (`deliver`): they are derived per session and their sends
posted at once, and one announcer thread tells the students once the device finished
the forward. A refused batch is marked where its student waits for the announcement.

What the engine decides stays with the engine: it is told when a group formed
(`formed`), when a batch finished sending (`sent`), and asked to end a session whose
transfer failed (`end`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distill_common import tracing
from distill_common.announcements import Announcements
from distill_common.outputs import BatchOutputs
from distill_common.session_group import (TEACHER_RANK, SessionGroup, TransferError, build_group, connect_store,
                                          handshake, prefix_token)
from teacher_server.metrics import Metrics
from teacher_server.sessions import Batch, Session

log = logging.getLogger(__name__)


@dataclass
class _Link:
    """A formed session: its group and the queue of its sender thread."""

    group: SessionGroup
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
    announcements: list  # (session, group, batch_id)


class Delivery:
    def __init__(self, metrics: Metrics, *, store, advertise_host: str, device: torch.device,
                 join_timeout_s: float, transfer_timeout_s: float,
                 formed: Callable[[Session], bool], sent: Callable[[Session, Batch, int], None],
                 end: Callable[..., None]):
        self.metrics = metrics
        self.store = store
        self.advertise_host = advertise_host
        self.device = device
        self.join_timeout_s = join_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._formed = formed  # (session) -> False when it ended meanwhile
        self._sent = sent  # (session, batch, bytes sent)
        self._end = end  # (session, reason, failure)
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()
        self._launched: queue.Queue = queue.Queue()
        self._announcer = threading.Thread(target=self._announce_loop, name="announce-forwards", daemon=True)

    def start(self) -> None:
        self._announcer.start()

    def stop(self) -> None:
        """Announces what was launched, then stops the announcer."""
        self._launched.put(None)
        self._announcer.join(timeout=10)

    # ---- session groups ----------------------------------------------------------

    def connect(self, session: Session) -> None:
        threading.Thread(target=self._form_group, args=(session,), name=f"form-group-{session.session_id}",
                         daemon=True).start()

    def _form_group(self, session: Session) -> None:
        """Builds the teacher's end of the session group (blocks until the student's end)."""
        try:
            # A store client of its own: one client serialises its operations, so a wait
            # for a student that never comes would hold up every other session's.
            store = connect_store("127.0.0.1", self.store.port, self.join_timeout_s)
            group = build_group(store, session.store_prefix, backend=session.backend, rank=TEACHER_RANK,
                                device=self.device, timeout_s=self.join_timeout_s,
                                gloo_host=self.advertise_host)
            handshake(group, prefix_token(session.store_prefix), self.join_timeout_s)
        except Exception as e:
            log.warning("session %s (job %s rank %d) did not connect: %s", session.session_id, session.job_id,
                        session.job_rank, e)
            self._end(session, "join_failed", f"the session group did not form: {e}")
            return
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

    def close(self, session: Session) -> None:
        """Stops the session's sender and aborts its group."""
        with self._lock:
            link = self._links.pop(session.session_id, None)
        if link is None:
            return
        link.sends.put(None)
        # Aborting never waits for the peer, which may be dead; other groups are untouched.
        link.group.abort()

    def refuse(self, session: Session, batch_id: int) -> None:
        """Marks a refused batch where the student of a stream_refusals_only session waits for it."""
        if not session.stream_refusals_only:
            return
        with self._lock:
            link = self._links.get(session.session_id)
        try:
            if link is not None:
                link.group.announcements.refuse(batch_id)
            else:  # refused while the group still forms
                Announcements(self.store, session.store_prefix).refuse(batch_id)
        except Exception as e:  # the student's wait then times out and it joins again
            log.warning("session %s: could not mark batch %d refused: %s", session.session_id, batch_id, e)

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
        Returns what the announcer needs once the forward is done: (session, group, batch id),
        or None when the session ended meanwhile.
        """
        with self._lock:
            link = self._links.get(session.session_id)
        if link is None:
            return None  # ended meanwhile
        # A batch that carries data of its own (ids to score) is derived for itself: an equal
        # request on identical ids and mask does not make equal tensors then.
        key = (id(out), session.outputs, session.backend, id(batch) if session.outputs.reads_batch_data else None)
        tensors = derived.get(key)
        if tensors is None:
            tensors = derived[key] = link.group.to_send(session.outputs.derive(out, batch))
        try:
            works = link.group.send_all(tensors)
        except Exception as e:
            self._end(session, "transfer_failed", f"posting the send of batch {batch.batch_id} failed: {e}")
            return None
        tracing.mark("t_forward", batch.batch_id)
        link.sends.put(_SendJob(batch, works, tensors, sum(t.numel() * t.element_size() for t in tensors)))
        # Announced by the announcer thread, not the sender thread (busy waiting for the
        # previous batch): the student posts this batch's receives as soon as the forward
        # is done, so consecutive transfers run back to back.
        return session, link.group, batch.batch_id

    def _send_loop(self, session: Session, link: _Link) -> None:
        """Waits, in order, for each batch's sends to complete; fails the session on timeout."""
        while True:
            job = link.sends.get()
            if job is None:
                return
            tracing.mark("t_watch", job.batch.batch_id)
            try:
                for work in job.works:
                    link.group.wait(work, self.transfer_timeout_s, what=f"sending batch {job.batch.batch_id}")
            except TransferError as e:
                log.warning("session %s: %s", session.session_id, e)
                self._end(session, "transfer_failed", str(e))
                return
            tracing.mark("t_sent", job.batch.batch_id)
            batch, nbytes = job.batch, job.nbytes
            del job  # NCCL is done with the tensors: free them before whatever `sent` does
            self._sent(session, batch, nbytes)

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
                for session, _, _ in launched.announcements:
                    self._end(session, "forward_failed", f"the teacher's forward failed on the device: {e}")
                continue
            if counted:
                previous_end = time.monotonic()
                self.metrics.record_forward(start, previous_end, launched.tokens)
            for session, group, batch_id in launched.announcements:
                try:
                    group.announcements.announce(batch_id)
                except Exception as e:
                    self._end(session, "transfer_failed", f"announcing batch {batch_id} failed: {e}")
                    continue
                tracing.mark("t_announced", batch_id)
